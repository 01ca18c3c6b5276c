"""Speculative decoding by n-gram prompt lookup (spec_decode.py), measured. It runs three cases, with and
without speculation:
- one request that repeats a passage with an edit;
- one that repeats nothing;
- 48 requests at once.
Beside them runs transformers' own prompt lookup (`generate(prompt_lookup_num_tokens=k)`) on the same prompt.
It is greedy throughout. The script checks that every engine's tokens are the same.

    python scripts/make_smollm2.py build/smollm2
    python -m nanoserve.benchmarks.spec_decode --model build/smollm2 [--k 4] [--threads 2] [--repeats 3]
"""
from __future__ import annotations

import argparse
import time

import torch

from nanoserve import LLM, SamplingParams
from nanoserve.benchmarks.roofline import describe_cpu

PASSAGE = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in "
           "want of a wife. However little known the feelings or views of such a man may be on his first entering a "
           "neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is "
           "considered the rightful property of some one or other of their daughters. \"My dear Mr. Bennet,\" said "
           "his lady to him one day, \"have you heard that Netherfield Park is let at last?\" Mr. Bennet replied "
           "that he had not. \"But it is,\" returned she; \"for Mrs. Long has just been here, and she told me all "
           "about it.\" Mr. Bennet made no answer.")
EDIT = f"Repeat the following passage word for word, but write Mr. Smith instead of Mr. Bennet:\n\n{PASSAGE}"
NO_REPEAT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def spec_config(k: int, **extra: int) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2, **extra}


def time_nanoserve(llm: LLM, prompts: list[list[int]], max_tokens: int, repeats: int) -> tuple[float, list, dict]:
    """Best of `repeats` wall times of generating all `prompts` at once; the tokens; the spec counters of one run."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
    times, stats_before = [], dict(llm.engine.stats())
    for _ in range(repeats):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    stats = {name: (value - stats_before[name]) // repeats for name, value in llm.engine.stats().items()
             if name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    return min(times), [o.token_ids for o in outputs], stats


def time_transformers(path: str, prompt: list[int], max_tokens: int, k: int | None, repeats: int) -> tuple[float, list]:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    extra = {} if k is None else dict(prompt_lookup_num_tokens=k)
    times = []
    with torch.no_grad():
        model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=2,
                       pad_token_id=model.config.eos_token_id)  # warm-up
        for _ in range(repeats):
            start = time.perf_counter()
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                                 pad_token_id=model.config.eos_token_id, **extra)
            times.append(time.perf_counter() - start)
    return min(times), out[0, len(prompt):].tolist()


def chat_prompt(llm: LLM, chat: str) -> list[int]:
    ids = llm.engine.tokenizer.apply_chat_template([{"role": "user", "content": chat}], add_generation_prompt=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def acceptance(stats: dict) -> str:
    if not stats.get("num_drafts"):
        return "-"
    rate = stats["num_accepted_tokens"] / max(1, stats["num_draft_tokens"])
    per_step = 1 + stats["num_accepted_tokens"] / stats["num_drafts"]
    return f"{rate:.0%} of {stats['num_draft_tokens']} drafted, {per_step:.2f} tok/step"


def single_request(args: argparse.Namespace, name: str, chat: str) -> list[str]:
    """Rows of the one-request table for one prompt: nanoserve off and on, transformers off and with lookup."""
    plain = LLM(args.model, dtype="float32")
    prompt = chat_prompt(plain, chat)
    spec = LLM(args.model, dtype="float32", speculative_config=spec_config(args.k))
    base, base_tokens, _ = time_nanoserve(plain, [prompt], args.max_tokens, args.repeats)
    fast, fast_tokens, stats = time_nanoserve(spec, [prompt], args.max_tokens, args.repeats)
    assert fast_tokens == base_tokens, "speculation changed the greedy output"
    n = len(base_tokens[0])
    rows = [f"| {name} | nanoserve | off | {1000 * base / n:.1f} | 1.00x | - |",
            f"| {name} | nanoserve | k={args.k} | {1000 * fast / n:.1f} | {base / fast:.2f}x | {acceptance(stats)} |"]
    hf_base, hf_tokens = time_transformers(args.model, prompt, n, None, args.repeats)
    hf_fast, hf_fast_tokens = time_transformers(args.model, prompt, n, args.k, args.repeats)
    same = "same tokens" if hf_tokens == hf_fast_tokens == base_tokens[0] else "tokens differ"
    rows += [f"| {name} | transformers | off | {1000 * hf_base / n:.1f} | 1.00x | {same} |",
             f"| {name} | transformers | prompt_lookup_num_tokens={args.k} | {1000 * hf_fast / n:.1f} | "
             f"{hf_base / hf_fast:.2f}x | - |"]
    start = plain.engine.tokenizer.decode(base_tokens[0][:40])
    print(f"{name}: {n} tokens, prompt {len(prompt)} tokens; output starts {start!r}")
    return rows


def many_requests(args: argparse.Namespace) -> list[str]:
    """48 edit requests at once, each a different name to write. It measures throughput in three ways: off,
    on by default (no drafts while DISABLE_BY_BATCH_SIZE or more run), and on at every batch size."""
    probe = LLM(args.model, dtype="float32")
    chats = [EDIT.replace("Mr. Smith", f"Mr. {name}") for name in ["Smith", "Jones", "Brown", "Taylor"] * 12]
    prompts = [chat_prompt(probe, c) for c in chats]
    rows, base, base_tokens = [], None, None
    for label, config in (("off", None), (f"k={args.k}, default: none from 8 running", spec_config(args.k)),
                          (f"k={args.k}, every batch size", spec_config(args.k, disable_by_batch_size=10_000))):
        llm = LLM(args.model, dtype="float32", speculative_config=config)
        seconds, tokens, stats = time_nanoserve(llm, prompts, args.batch_max_tokens, 1)
        base, base_tokens = base or seconds, base_tokens or tokens
        assert tokens == base_tokens, "speculation changed the greedy output"
        num = sum(map(len, tokens))
        rows.append(f"| 48 requests | nanoserve | {label} | {num / seconds:.0f} tok/s | {base / seconds:.2f}x | "
                    f"{acceptance(stats)} |")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens; transformers' prompt_lookup_num_tokens")
    p.add_argument("--max-tokens", type=int, default=100)
    p.add_argument("--batch-max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2, help="best of this many runs")
    p.add_argument("--threads", type=int)
    p.add_argument("--skip-batch", action="store_true")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(describe_cpu(), f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32")
    rows = ["| prompt | engine | speculation | ms/token (or tok/s) | speed-up | acceptance |",
            "|---|---|---|---|---|---|"]
    for name, chat in (("edit a passage", EDIT), ("no repeats", NO_REPEAT)):
        rows += single_request(args, name, chat)
        print("\n".join(rows), flush=True)
    if not args.skip_batch:
        rows += many_requests(args)
    print("\n".join(rows))
    print(f"best of {args.repeats} runs (48 requests: one run); ms/token = the request's whole time / output tokens")


if __name__ == "__main__":
    main()
