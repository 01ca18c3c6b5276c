"""What int8 and int4 weights (quantization="int8", "int4") change in a real model's output, against float32.

    python scripts/quantization_error.py SMOLLM2_FOLDER [--max-tokens 32]

Two measures, each for float32, bfloat16, int8 weights with float32 and with bfloat16 activations, and
int4 weights (groups of 32 and of 64) with bfloat16 activations:
- perplexity, exp(-mean log p(token | the tokens before it)), of two English passages: the preamble of the
  GNU GPL version 3 (/usr/share/common-licenses/GPL-3 on Debian and Ubuntu) and the opening of Pride and
  Prejudice (nanoserve/benchmarks/spec_decode.py's PASSAGE), read from the engine's prompt logprobs;
- greedy agreement: each sentence of those passages cut to its first 8 words is a prompt; how many of the
  greedy continuations equal float32's token for token over their first 8, 16 and `--max-tokens` tokens,
  and, where one parts from float32's, by how much float32 preferred its own token there (the log-
  probability gap between its top two tokens: a near tie is parted by any rounding);
- teacher-forced agreement: at every position of both passages, whether the most likely next token is
  float32's. Each position is scored on the same (true) prefix, so one parting does not carry into the
  next tokens: a less noisy measure than the continuations, over ~800 positions instead of 27 prompts.
Printed as a markdown table (docs/quantization.md).
"""
from __future__ import annotations

import argparse
import math
import re

from nanoserve import LLM, SamplingParams
from nanoserve.benchmarks.roofline import describe_cpu
from nanoserve.benchmarks.spec_decode import PASSAGE

GPL = "/usr/share/common-licenses/GPL-3"
VARIANTS = {
    "float32": dict(dtype="float32"),
    "bfloat16": dict(dtype="bfloat16"),
    "int8, float32 activations": dict(dtype="float32", quantization="int8"),
    "int8, bfloat16 activations": dict(dtype="bfloat16", quantization="int8"),
    "int4 (groups of 32), bfloat16 activations": dict(dtype="bfloat16", quantization="int4"),
    "int4 (groups of 64), bfloat16 activations": dict(dtype="bfloat16", quantization="int4",
                                                      quantization_config={"group_size": 64}),
}


def read_preamble() -> str:
    """The GPL-3's preamble, from its heading to the terms, as one paragraph of plain text."""
    text = open(GPL).read()
    preamble = text[text.index("Preamble") + len("Preamble"):text.index("TERMS AND CONDITIONS")]
    return " ".join(preamble.split())


def score(llm: LLM, text: str) -> tuple[float, list[int]]:
    """The perplexity of `text` (exp of the mean negative log-probability of every token after its first),
    and the most likely token at each of those positions."""
    [output] = llm.generate([text], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    pairs = list(zip(output.prompt_token_ids[1:], output.prompt_logprobs[1:]))
    logprobs = [by_token[token].logprob for token, by_token in pairs]
    top = [next(t for t, lp in by_token.items() if lp.rank == 1) for _, by_token in pairs]
    return math.exp(-sum(logprobs) / len(logprobs)), top


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens a and b share from the start."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def top_two_gap(logprobs: dict) -> float:
    """log p(top token) - log p(second) at one step, from its logprobs (the sampled token and the top 2;
    under greedy the sampled token is the top one)."""
    ranked = sorted(logprobs.values(), key=lambda lp: lp.rank)
    return ranked[0].logprob - ranked[1].logprob


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    passages = {"GPL-3 preamble": read_preamble(), "Pride and Prejudice": PASSAGE}
    sentences = [s for p in passages.values() for s in re.split(r"(?<=[.?!])\s+", p) if len(s.split()) > 8]
    prompts = [" ".join(s.split()[:8]) for s in sentences]
    print(describe_cpu())
    results = {}
    for name, options in VARIANTS.items():
        llm = LLM(args.model, **options)
        ppl, top = zip(*[score(llm, text) for text in passages.values()])
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, logprobs=2)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        results[name] = ppl, [o.token_ids for o in outputs], [o.outputs[0].logprobs for o in outputs], sum(top, [])
        llm.close()
    reference_ppl, reference_tokens, reference_logprobs, reference_top = results["float32"]
    lengths = (8, 16, args.max_tokens)
    print(f"{len(prompts)} prompts, {args.max_tokens} greedy tokens each\n")
    print("| weights, activations | " + " | ".join(f"perplexity, {p}" for p in passages) + " | "
          + " | ".join(f"first {n} tokens equal to float32's" for n in lengths)
          + " | float32's top-2 gap where they part (median, nats) | teacher-forced top token equal to float32's |")
    print("|---" * (len(passages) + len(lengths) + 3) + "|")
    for name, (ppl, tokens, _, top) in results.items():
        equal = [sum(t[:n] == r[:n] for t, r in zip(tokens, reference_tokens)) for n in lengths]
        gaps = sorted(top_two_gap(reference_logprobs[i][shared_prefix(t, r)])
                      for i, (t, r) in enumerate(zip(tokens, reference_tokens)) if t != r)
        cells = [f"{p:.3f} ({100 * (p / r - 1):+.2f}%)" for p, r in zip(ppl, reference_ppl)]
        median = f"{gaps[len(gaps) // 2]:.2f}" if gaps else "n/a"
        print(f"| {name} | " + " | ".join(cells) + " | " + " | ".join(f"{e} of {len(prompts)}" for e in equal)
              + f" | {median} | {sum(a == b for a, b in zip(top, reference_top))} of {len(top)} |")


if __name__ == "__main__":
    main()
