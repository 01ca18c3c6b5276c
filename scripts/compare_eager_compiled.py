"""Eager against compiled (enforce_eager), both engines in one process, run in turns:

    python scripts/compare_eager_compiled.py MODEL DTYPE REQUESTS [ROUNDS] [--plain] [--int8]

--plain: the compiled engine's linears are plain nn.Linear (not layers/linear.py's layouts), which
inductor's freezing lays out itself. --int8: both engines with quantization="int8" (DTYPE: the activations').

Each round times REQUESTS requests (max_num_seqs=REQUESTS) of 96 random prompt tokens generating 1 token
(the prefill) and then 48 tokens, on each engine in turn; a decode step is the difference over 47 steps.
Prints each engine's median ms per decode step and per prefill, their ratio, every round, and each
LLM()'s start-up time. Running the two in turns keeps a machine whose speed drifts from favouring one
of them. The figures are in docs/performance.md ("The compiled step")."""
import random
import statistics
import sys
import time
from unittest import mock

from nanoserve import LLM, SamplingParams
from nanoserve.models import loader

PROMPT_LEN, NUM_TOKENS = 96, 48


def timed_generate(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start


def main() -> None:
    path, dtype, num_requests = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 and sys.argv[4].isdigit() else 3
    engines, start_seconds = {}, {}
    options = dict(dtype=dtype, max_num_seqs=num_requests, quantization="int8" if "--int8" in sys.argv else None)
    for name in ("eager", "compiled"):
        start = time.perf_counter()
        if name == "compiled" and "--plain" in sys.argv:  # nn.Linear weights: inductor's freezing lays them out
            with mock.patch.object(loader, "pack_linears", lambda model, compiled_one_row: model):
                engines[name] = LLM(path, enforce_eager=False, **options)
        else:
            engines[name] = LLM(path, enforce_eager=name == "eager", **options)
        start_seconds[name] = time.perf_counter() - start
    assert engines["compiled"].engine.model_runner.compiled, "the compiled engine fell back to eager"
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(PROMPT_LEN)] for _ in range(num_requests)]
    for llm in engines.values():
        timed_generate(llm, prompts, 4)  # warm-up
    ms_per_step: dict[str, list[float]] = {name: [] for name in engines}
    prefill_ms: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(rounds):
        for name, llm in engines.items():
            prefill = timed_generate(llm, prompts, 1)
            ms_per_step[name].append(1000 * (timed_generate(llm, prompts, NUM_TOKENS) - prefill) / (NUM_TOKENS - 1))
            prefill_ms[name].append(1000 * prefill)
    median = {name: statistics.median(times) for name, times in ms_per_step.items()}
    prefill = {name: statistics.median(times) for name, times in prefill_ms.items()}
    print(f"{dtype}, {num_requests} requests: eager {median['eager']:.1f} ms/step, compiled "
          f"{median['compiled']:.1f} ms/step, compiled / eager {median['compiled'] / median['eager']:.2f}; "
          f"rounds {ms_per_step}; LLM() start eager {start_seconds['eager']:.1f} s, compiled "
          f"{start_seconds['compiled']:.1f} s; prefill (the prompts, 1 token) eager {prefill['eager']:.0f} ms, "
          f"compiled {prefill['compiled']:.0f} ms")


if __name__ == "__main__":
    main()
