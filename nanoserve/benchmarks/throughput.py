"""Offline throughput: a whole workload queued at once on each engine, side by side in one process.
So ratios, not absolute numbers, are the point. The engines (`ENGINES`):
- nanoserve with continuous batching, and with static batching;
- transformers' `generate` on one padded batch;
- transformers' continuous batching.
`report` prints their table, and nanoserve's steps against the roofline (roofline.py). The comparisons
print prefix caching on and off, and one process against tensor parallel ranks on the same cores."""
from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING

import torch

from nanoserve import LLM, SamplingParams
from nanoserve.benchmarks.roofline import Machine, ModelShape, step_limit
from nanoserve.benchmarks.workload import WARM_UP, Request, Result, Step, percentile

if TYPE_CHECKING:
    from transformers import PreTrainedModel

ENGINES = ("nanoserve", "static", "hf-generate", "hf-cb")


def run_nanoserve(path: str, workload: list[Request], scheduling: str, max_seconds: float | None = None,
                  **config: object) -> Result:
    """Every request queued at once. Prefix caching is off unless `config` turns it on. With `max_seconds`, the
    run stops then and counts the tokens generated so far, as a rate over the start of the run."""
    llm = LLM(path, scheduling=scheduling, **{"enable_prefix_caching": False, **config})
    engine, bm = llm.engine, llm.engine.scheduler.block_manager
    llm.generate([WARM_UP], SamplingParams(max_tokens=2), use_tqdm=False)
    block_size, total = engine.block_size, engine.model_runner.num_blocks - 1
    start = time.perf_counter()
    for r in workload:
        engine.add_request(r.prompt, SamplingParams(temperature=r.temperature, max_tokens=r.output_len,
                                                    ignore_eos=True))
    outputs, peak_used, peak_alloc, steps, prefill_tokens = [], 0, 0, [], 0
    while engine.has_unfinished_requests():
        step_start = time.perf_counter()
        if max_seconds is not None and step_start - start > max_seconds:
            break
        result = engine.step()
        prefill_tokens += result.num_prefill_tokens
        if result.batch is not None:
            q_starts = result.batch.query_start_loc.tolist()
            steps.append(Step(time.perf_counter() - step_start, [e - s for s, e in zip(q_starts, q_starts[1:])],
                              result.batch.seq_lens.tolist(), result.batch.logits_indices.numel()))
        outputs += result.outputs
        running = engine.scheduler.running
        peak_used = max(peak_used, sum(s.num_computed_tokens for s in running))
        peak_alloc = max(peak_alloc, (total - bm.num_free_blocks) * block_size)
    seconds = time.perf_counter() - start
    unfinished = sum(seq.num_tokens - seq.num_prompt_tokens for seq in engine.requests.values())  # stopped early
    cut = {"cut": f"first {seconds:.0f} s, {len(outputs)} of {len(workload)} done"} if engine.requests else {}
    llm.close()  # stops tensor-parallel workers
    return Result(scheduling if scheduling == "static" else "nanoserve", seconds,
                  sum(len(o.token_ids) for o in outputs) + unfinished, sum(len(r.prompt) for r in workload),
                  [o.ttft for o in outputs], [(o.latency - o.ttft) / max(1, len(o.token_ids) - 1) for o in outputs],
                  peak_used, peak_alloc, total * block_size,
                  {"steps": len(steps), "prefill_tokens": prefill_tokens,
                   "computed_tokens": sum(sum(s.query_lens) for s in steps),
                   "cached_tokens": sum(o.num_cached_tokens for o in outputs),
                   "preemptions": engine.stats()["num_preemptions"],
                   **{name: value for name, value in engine.stats().items() if "draft" in name or "accepted" in name},
                   **cut},
                  steps)


def load_hf(path: str, dtype: str, device: str = "cpu") -> PreTrainedModel:
    """transformers' own model for the checkpoint (the class its config.json names), with SDPA attention."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    return model.to(device).eval()


@torch.inference_mode()
def run_hf_generate(path: str, workload: list[Request], dtype: str, device: str = "cpu") -> Result:
    """transformers' `generate` on one left-padded static batch. Every request runs until the longest one
    is done. min_new_tokens = max_new_tokens, so EOS is ignored, as for the others."""
    from transformers import LogitsProcessor, LogitsProcessorList
    model = load_hf(path, dtype, device)
    stamps: list[float] = []

    class Clock(LogitsProcessor):  # called once per generated token position: a step clock
        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            stamps.append(time.perf_counter())
            return scores

    width = max(len(r.prompt) for r in workload)
    ids = torch.tensor([[0] * (width - len(r.prompt)) + r.prompt for r in workload], device=device)
    mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in workload], device=device)
    longest = max(r.output_len for r in workload)
    model.generate(ids[:1, -8:], attention_mask=mask[:1, -8:], max_new_tokens=2, do_sample=False)  # warm-up
    start = time.perf_counter()
    model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=longest, min_new_tokens=longest,
                   pad_token_id=0, logits_processor=LogitsProcessorList([Clock()]))
    seconds = time.perf_counter() - start
    ttft = [stamps[0] - start] * len(workload)
    tpot = [(stamps[r.output_len - 1] - stamps[0]) / max(1, r.output_len - 1) for r in workload]
    kv = len(workload) * (width + longest)  # a dense cache: every row padded to the longest
    return Result("hf-generate", seconds, sum(r.output_len for r in workload), sum(len(r.prompt) for r in workload),
                  ttft, tpot, sum(len(r.prompt) + r.output_len for r in workload), kv, kv)


@torch.inference_mode()
def run_hf_continuous(path: str, workload: list[Request], dtype: str, device: str = "cpu",
                      max_seconds: float | None = None) -> Result:
    """transformers' continuous batching manager, each request with its own max_new_tokens, sampling at the
    workload's temperature. With `max_seconds`, it stops then. It counts the tokens generated so far
    (its requests stream them), as a rate over the start of the run."""
    from transformers import GenerationConfig
    model = load_hf(path, dtype, device)
    temperature = workload[0].temperature
    config = GenerationConfig(do_sample=temperature > 0, temperature=temperature or None, eos_token_id=-1,
                              max_new_tokens=max(r.output_len for r in workload))
    with model.continuous_batching_context_manager(generation_config=config) as manager:
        start = time.perf_counter()
        ids = [manager.add_request(r.prompt, max_new_tokens=r.output_len, eos_token_id=-1, record_timestamps=True,
                                   streaming=max_seconds is not None) for r in workload]
        latest, finished = {}, 0  # each request's newest output
        while finished < len(ids) and (max_seconds is None or time.perf_counter() - start < max_seconds):
            out = manager.get_result(timeout=1)
            if out is not None:
                latest[out.request_id] = out
                finished += out.is_finished()
        seconds = time.perf_counter() - start
    outs = [latest[i] for i in ids if i in latest and latest[i].is_finished()]
    ttft = [o.timestamps[0] - o.created_time for o in outs]
    tpot = [(o.timestamps[-1] - o.timestamps[0]) / max(1, len(o.timestamps) - 1) for o in outs]
    cut = {"cut": f"first {seconds:.0f} s, {finished} of {len(ids)} done"} if finished < len(ids) else {}
    return Result("hf-cb", seconds, sum(len(o.generated_tokens) for o in latest.values()),
                  sum(len(r.prompt) for r in workload), ttft or [float("nan")], tpot or [float("nan")], extra=cut)


def report(results: list[Result], machine: Machine, shape: ModelShape) -> str:
    """One row per engine, then the roofline of nanoserve's steps: the whole run, and by phase."""
    lines = ["| engine | output tok/s | total tok/s | TTFT p50 / p99 (s) | TPOT (ms) "
             "| peak KV used / allocated (slots) | tokens computed (preemptions) | nanoserve ÷ this |",
             "|---|---|---|---|---|---|---|---|"]
    ours = next((r for r in results if r.engine == "nanoserve"), None)
    for r in results:
        kv = f"{r.peak_kv_used} / {r.peak_kv_allocated}" if r.peak_kv_used is not None else "n/a"
        # every prompt and output token's KV once, but the last output token's, plus what preemption recomputed
        computed = f"{r.extra['computed_tokens']} ({r.extra['preemptions']})" if "preemptions" in r.extra else "n/a"
        ratio = f"{ours.output_tok_s / r.output_tok_s:.2f}x" if ours else "n/a"
        lines.append(f"| {r.engine} | {r.output_tok_s:.0f} | {r.total_tok_s:.0f} | {percentile(r.ttft, 50):.2f} / "
                     f"{percentile(r.ttft, 99):.2f} | {1000 * statistics.mean(r.tpot):.1f} | {kv} | {computed} "
                     f"| {ratio} |")
    for r in results:  # speculative decoding (docs/speculative-decoding.md)
        if r.extra.get("num_drafts"):
            lines.append(f"\n{r.engine}: speculative decoding accepted {r.extra['num_accepted_tokens']} of "
                         f"{r.extra['num_draft_tokens']} draft tokens in {r.extra['num_drafts']} verifications "
                         f"(by position: {r.extra['num_accepted_tokens_per_pos']})")
    # The roofline is taken over the steps nanoserve (continuous, else static) ran: the same useful work for all
    scheduled = next((r for r in results if r.steps), None)
    if scheduled is None:
        return "\n".join(lines)
    limits = [step_limit(step, shape, machine) for step in scheduled.steps]
    roofline = sum(t for t, _ in limits)
    lines.append(f"\nmeasured GEMM π {machine.flops / 1e9:.0f} GFLOP/s, copy β {machine.bandwidth / 1e9:.1f} GB/s; "
                 f"{scheduled.engine}'s {len(limits)} steps at max(FLOPs/π, bytes/β) each take {roofline:.2f} s "
                 f"(roofline; {sum(c for _, c in limits)} steps compute-bound)")
    for r in results:
        lines.append(f"- {r.engine}: {r.seconds:.2f} s, {100 * roofline / r.seconds:.0f}% of the roofline")
    lines += [f"\n{scheduled.engine} by phase:",
              "| phase | steps | seconds | share of time | roofline (s) | % of roofline |", "|---|---|---|---|---|---|"]
    for phase in ("prefill", "mixed", "decode"):
        steps = [(s, limit) for s, (limit, _) in zip(scheduled.steps, limits) if s.phase == phase]
        seconds, limit = sum(s.seconds for s, _ in steps), sum(limit for _, limit in steps)
        share = 100 * seconds / sum(s.seconds for s in scheduled.steps)
        lines.append(f"| {phase} | {len(steps)} | {seconds:.2f} | {share:.0f}% | {limit:.2f} | "
                     f"{100 * limit / seconds if seconds else 0:.0f}% |")
    return "\n".join(lines)


def nanovllm_table(results: list[Result]) -> str:
    """The columns of nano-vllm's published benchmark table, to set beside it. Throughput is output tokens
    over the time to serve all requests, as its bench.py counts."""
    lines = ["| Inference Engine | Output Tokens | Time (s) | Throughput (tokens/s) |", "|---|---|---|---|"]
    for r in results:
        engine = f"{r.engine} ({r.extra['cut']})" if "cut" in r.extra else r.engine  # a rate over the run's start
        lines.append(f"| {engine} | {r.output_tokens:,} | {r.seconds:.2f} | {r.output_tok_s:.2f} |")
    return "\n".join(lines)


def compare_prefix_caching(path: str, workload: list[Request], config: dict) -> str:
    """The shared-prefix workload with prefix caching on and off. It reports the prefill tokens the model ran,
    prompt tokens served from the cache, time to first token (all requests arrive at once) and seconds."""
    lines = ["| prefix caching | prefill tokens computed | cached tokens | TTFT p50 / p99 (s) | seconds |",
             "|---|---|---|---|---|"]
    for caching in (True, False):
        r = run_nanoserve(path, workload, "continuous", **config, enable_prefix_caching=caching)
        lines.append(f"| {'on' if caching else 'off'} | {r.extra['prefill_tokens']} | {r.extra['cached_tokens']} | "
                     f"{percentile(r.ttft, 50):.2f} / {percentile(r.ttft, 99):.2f} | {r.seconds:.2f} |")
    return "\n".join(lines)


def compare_tensor_parallel(path: str, workload: list[Request], config: dict, size: int) -> str:
    """The same workload on the same cores, two ways. One process runs it with T and size*T threads.
    Then `size` ranks run it with T threads each. T is torch's threads now. The ranks split their
    process's size*T."""
    threads = torch.get_num_threads()
    setups = [(1, threads), (1, size * threads), (size, threads)]  # (ranks, threads per rank)
    lines = ["| ranks x threads | seconds | total tok/s | decode step (median ms) | vs 1 x "
             f"{size * threads} |", "|---|---|---|---|---|"]
    results = []
    try:
        for ranks, per_rank in setups:
            torch.set_num_threads(ranks * per_rank)  # with ranks > 1, rank 0 gives each rank 1/ranks of them
            results.append(run_nanoserve(path, workload, "continuous", tensor_parallel_size=ranks, **config))
    finally:
        torch.set_num_threads(threads)
    for (ranks, per_rank), r in zip(setups, results):
        decode = statistics.median(s.seconds for s in r.steps if s.phase == "decode") * 1000
        lines.append(f"| {ranks} x {per_rank} | {r.seconds:.2f} | {r.total_tok_s:.0f} | {decode:.1f} | "
                     f"{results[1].seconds / r.seconds:.2f}x |")
    return "\n".join(lines)
