"""Time n samples of one echoed prompt with logprobs (the server's echo + logprobs with n > 1: n requests,
each asking for the prompt's logprobs), against the same without prompt logprobs. Prints the prompt tokens
the model ran, those served from the prefix cache, and the seconds, on the bundled model:

    python scripts/echo_n.py --n 128 --prompt-tokens 200
"""
from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this tree's nanoserve, not an installed one

from nanoserve import DEFAULT_MODEL, LLM, SamplingParams  # noqa: E402


def serve(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[int, int, float]:
    """Add the n samples as the server does and step until done: (prompt tokens run, cached, seconds)."""
    engine = llm.engine
    cached_before = engine.stats()["num_cached_tokens"]
    start, num_prefill = time.perf_counter(), 0
    for i in range(params.n):
        engine.add_request(prompt, params.for_sample(i))
    while engine.has_unfinished_requests():
        num_prefill += engine.step().num_prefill_tokens
    return num_prefill, engine.stats()["num_cached_tokens"] - cached_before, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    vocab_size = LLM(DEFAULT_MODEL).engine.vocab_size
    prompt = [random.Random(0).randrange(3, vocab_size) for _ in range(args.prompt_tokens)]
    print(f"n={args.n} samples of a {args.prompt_tokens}-token prompt, {args.max_tokens} tokens each")
    for name, prompt_logprobs in (("echo + logprobs", 1), ("no echo", None)):
        llm = LLM(DEFAULT_MODEL)  # an empty prefix cache
        llm.generate(prompt[:8], use_tqdm=False)  # warm up
        params = SamplingParams(max_tokens=args.max_tokens, seed=0, n=args.n, logprobs=1,
                                prompt_logprobs=prompt_logprobs)
        num_prefill, num_cached, seconds = serve(llm, prompt, params)
        print(f"{name:>16}: {num_prefill:,} prompt tokens run, {num_cached:,} from the prefix cache, {seconds:.2f} s")

if __name__ == "__main__":
    main()
