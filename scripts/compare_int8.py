"""Decode steps with int8 weights against float32 and bfloat16 ones, every engine in one process, in turns:

    python scripts/compare_int8.py SMOLLM2_FOLDER [--rounds 3] [--compiled] [--requests 1,48]

For 1 and for 48 requests (random prompts of 16 tokens, 32 greedy tokens each, EOS ignored) each engine
decodes in turn, `--rounds` times; printed is the median decode step (ms) over the rounds, so that a
neighbour's load falls on every engine alike. int8 with float32 activations runs at 1 request only
(at 48 its kernel takes seconds a step). `--compiled` adds int8 with bfloat16 activations compiled
(enforce_eager=False); `--requests 1` measures one request alone. The figures are in docs/quantization.md.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

from nanoserve import LLM, SamplingParams
from nanoserve.benchmarks.roofline import describe_cpu

ENGINES = {
    "float32": dict(dtype="float32"),
    "bfloat16": dict(dtype="bfloat16"),
    "int8, float32 activations": dict(dtype="float32", quantization="int8"),
    "int8, bfloat16 activations": dict(dtype="bfloat16", quantization="int8"),
}


def decode_step_ms(llm: LLM, num_requests: int, seed: int) -> float:
    """The median time of the steps in which every request decodes (no prompt tokens), in ms."""
    engine, rng = llm.engine, random.Random(seed)
    for _ in range(num_requests):
        engine.add_request([rng.randrange(3, 40000) for _ in range(16)],
                           SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        result = engine.step()
        if result.num_prefill_tokens == 0 and len(result.scheduled) == num_requests:
            times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compiled", action="store_true")
    parser.add_argument("--requests", default="1,48", help="comma-separated numbers of requests, of 1 and 48")
    args = parser.parse_args()
    engines = dict(ENGINES)
    if args.compiled:
        engines["int8, bfloat16 activations, compiled"] = dict(dtype="bfloat16", quantization="int8",
                                                               enforce_eager=False)
    print(describe_cpu())
    llms = {name: LLM(args.model, max_num_seqs=48, max_model_len=64, **options) for name, options in engines.items()}
    print("compiled:", {name: llm.engine.model_runner.compiled for name, llm in llms.items()})
    print("| engine | 1 request, ms per decode step | 48 requests, ms per decode step | 48 requests, tok/s |")
    print("|---|---|---|---|")
    sizes = [int(n) for n in args.requests.split(",")]
    times = {(name, n): [] for name in llms for n in (1, 48)}
    for round_ in range(args.rounds):
        for n in sizes:
            for name, llm in llms.items():
                if n == 48 and "float32 activations" in name:
                    continue
                times[name, n].append(decode_step_ms(llm, n, seed=round_))
    for name in llms:
        one, many = (statistics.median(times[name, n]) if times[name, n] else None for n in (1, 48))
        cells = [f"{one:.1f}", f"{many:.1f}" if many else "n/a", f"{48000 / many:.0f}" if many else "n/a"]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
