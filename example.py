"""Serve a few prompts through nanoserve's continuous batching, one engine step at a time.

    python example.py                  # the tiny Llama that ships with nanoserve (trained on Jane Austen)
    python example.py --model PATH     # any local Llama checkpoint folder (config.json, safetensors, tokenizer)
    python example.py --trace          # also print the first steps as the walkthrough's arrays (docs/walkthrough.md)
    python example.py --quantization int8   # int8 weights, a scale per output channel (docs/quantization.md)
    python example.py --model SMOLLM2 --quantization int4   # int4 weights, a scale and zero per 32 inputs

Seven requests start together; an eighth arrives a few steps later and joins the running batch.
It repeats the opening of an earlier prompt, so its first KV blocks come from the prefix cache.
"""
import argparse
import time
from dataclasses import dataclass

from nanoserve import DEFAULT_MODEL, LLM, LLMEngine, RequestOutput, SamplingParams, StepResult
from nanoserve.entrypoints.trace import format_step

OPENING = "It is a truth universally acknowledged, that a single man in possession of a good fortune"
GREEDY = SamplingParams(temperature=0, max_tokens=40)
PROMPTS = [  # (prompt, sampling): greedy, or top-p with a seed so every run prints the same
    ("My dear Jane,", GREEDY),
    ("She was", SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=48)),
    (OPENING + ", must be in want of a wife.", GREEDY),
    ("Mr. Darcy looked at her, and", SamplingParams(temperature=0.7, top_p=0.9, seed=2, max_tokens=40)),
    ("The weather was fine, and the whole party set off for", GREEDY),
    ("\"I cannot think what you mean,\" said Emma.",
     SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=64)),
    ("Hello, my name is", GREEDY),
]
LATE_PROMPT, LATE_STEP = (OPENING + " is", SamplingParams(temperature=0.8, top_p=0.9, seed=4, max_tokens=40)), 3


@dataclass
class Stats:
    """Running totals over StepResults. A step with prompt tokens counts as prefill time."""
    steps: int = 0
    max_batch: int = 0
    peak_blocks: int = 0
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0          # all decode tokens, including those mixed into prefill steps
    decode_only_tokens: int = 0
    decode_only_seconds: float = 0.0

    def record(self, result: StepResult, engine: LLMEngine, seconds: float) -> None:
        self.steps += 1
        self.max_batch = max(self.max_batch, len(result.scheduled))
        used = engine.model_runner.num_blocks - 1 - engine.scheduler.block_manager.num_free_blocks  # 0: null block
        self.peak_blocks = max(self.peak_blocks, used)
        self.prefill_tokens += result.num_prefill_tokens
        self.decode_tokens += result.num_decode_tokens
        if result.num_prefill_tokens:
            self.prefill_seconds += seconds
        else:
            self.decode_only_tokens += result.num_decode_tokens
            self.decode_only_seconds += seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="a local Llama checkpoint folder (default: the bundled one)")
    parser.add_argument("--trace", nargs="?", type=int, const=4, default=0, metavar="STEPS",
                        help="print the first STEPS steps (default 4) the way the walkthrough shows them")
    parser.add_argument("--quantization", choices=["int8", "int4"],
                        help="the weights int8 or int4 (docs/quantization.md); int4 needs layers whose inputs are "
                             "a multiple of 32, so not the bundled model's (688)")
    args = parser.parse_args()
    # the KV cache fits 8 full-length requests
    llm = LLM(args.model, block_size=16, max_num_seqs=8, quantization=args.quantization)
    engine = llm.engine
    if engine.tokenizer is None:
        parser.error(f"{args.model} has no tokenizer; this example sends text prompts")
    for prompt, params in PROMPTS:
        engine.add_request(prompt, params)
    outputs, stats = [], Stats()
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        result = engine.step()  # schedule -> build_batch -> forward + sample -> update; see result.batch
        stats.record(result, engine, time.perf_counter() - start)
        if stats.steps <= args.trace:
            print(format_step(result, stats.steps), end="\n\n")
        outputs += result.outputs
        if stats.steps == LATE_STEP:
            engine.add_request(*LATE_PROMPT)
    for out in sorted(outputs, key=lambda o: int(o.request_id)):
        print(f"[{out.request_id}] {out.prompt!r}\n    -> {out.text!r}\n"
              f"    ({len(out.token_ids)} tokens, {out.finish_reason}, {out.num_cached_tokens} prompt tokens "
              f"from the prefix cache, TTFT {out.ttft * 1000:.0f} ms, latency {out.latency:.2f} s)")
    print_summary(stats, engine, outputs)


def print_summary(stats: Stats, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
    total_blocks = engine.model_runner.num_blocks - 1
    print(f"\nSummary: {len(outputs)} requests in {stats.steps} steps, largest batch {stats.max_batch} requests")
    print(f"prefill: {stats.prefill_tokens} tokens, {stats.prefill_tokens / stats.prefill_seconds:.0f} tok/s; "
          f"decode: {stats.decode_tokens} tokens, "
          f"{stats.decode_only_tokens / max(stats.decode_only_seconds, 1e-9):.0f} tok/s in decode-only steps")
    print(f"peak KV cache use: {stats.peak_blocks} of {total_blocks} blocks "
          f"({100 * stats.peak_blocks / total_blocks:.0f}%), {engine.config.block_size} tokens each")
    print(f"prefix cache hits: {sum(o.num_cached_tokens for o in outputs)} prompt tokens reused")


if __name__ == "__main__":
    main()
