"""Eager against compiled (enforce_eager), one process each:

    python scripts/compare_eager_compiled.py MODEL eager
    python scripts/compare_eager_compiled.py MODEL compiled

Prints LLM()'s start-up time and, for 1 and for 48 requests, the best of two runs of 48 greedy tokens
each, in tok/s. The figures are in docs/performance.md ("The compiled step")."""
import sys
import time

from nanoserve import LLM, SamplingParams

NUM_TOKENS = 48


def best_tok_per_s(llm: LLM, num_requests: int) -> float:
    params = SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, temperature=0)
    llm.generate(["Hello there"] * num_requests, SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    seconds = []
    for _ in range(2):
        start = time.perf_counter()
        llm.generate([f"Hello there {i}" for i in range(num_requests)], params, use_tqdm=False)
        seconds.append(time.perf_counter() - start)
    return num_requests * NUM_TOKENS / min(seconds)


def main() -> None:
    path, kind = sys.argv[1], sys.argv[2]
    start = time.perf_counter()
    llm = LLM(path, dtype="float32", enforce_eager=kind == "eager")
    start_seconds = time.perf_counter() - start
    rates = {n: round(best_tok_per_s(llm, n), 1) for n in (1, 48)}
    print(f"{kind}: start {start_seconds:.1f} s, tok/s at 1 and 48 requests {rates}, "
          f"compiled: {llm.engine.model_runner.compiled}")


if __name__ == "__main__":
    main()
