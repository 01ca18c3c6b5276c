"""Benchmark: nanoserve (continuous and static) vs transformers (static generate and continuous
batching), side by side in one process, on one workload. Ratios, not absolute numbers, are the
point: every engine runs on the same machine in the same run.

    python -m nanoserve.bench                       # the default ~40M-parameter random Llama, 48 requests
    python -m nanoserve.bench --engines nanoserve,static --num-requests 16
    python -m nanoserve.bench --online --rates 2,4,8     # Poisson arrivals: TTFT/TPOT vs request rate
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field

import torch

ENGINES = ("nanoserve", "static", "hf-generate", "hf-cb")
DEFAULT_MODEL = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                     intermediate_size=1408, vocab_size=32000, max_position_embeddings=1024)


@dataclass
class Request:
    prompt: list[int]
    output_len: int


@dataclass
class Result:
    engine: str
    seconds: float
    output_tokens: int            # useful tokens: each request's own output_len, no padding waste
    prompt_tokens: int
    ttft: list[float]             # per request, seconds from arrival
    tpot: list[float]             # per request, seconds per output token after the first
    peak_kv_used: int | None = None       # KV slots holding tokens, at the peak
    peak_kv_allocated: int | None = None  # KV slots held by requests (allocated blocks), at the peak
    kv_total: int | None = None
    extra: dict = field(default_factory=dict)

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tok_s(self) -> float:
        return (self.output_tokens + self.prompt_tokens) / self.seconds


def build_default_model(folder: str) -> str:
    """The default workload's random Llama, built once with transformers and kept in `folder`."""
    path = os.path.join(folder, "nanoserve-bench-llama-40m")
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**DEFAULT_MODEL)).save_pretrained(path)
    return path


def make_workload(num_requests: int, input_len: tuple[int, int], output_len: tuple[int, int],
                  vocab_size: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [Request([rng.randrange(3, vocab_size) for _ in range(rng.randint(*input_len))], rng.randint(*output_len))
            for _ in range(num_requests)]


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))] if values else float("nan")


# ------------------------------------------------------------------------------------ engines

def run_nanoserve(path: str, workload: list[Request], scheduling: str, **config) -> Result:
    from nanoserve import LLM, SamplingParams
    llm = LLM(path, scheduling=scheduling, enable_prefix_caching=False, **config)
    engine, bm = llm.engine, llm.engine.scheduler.block_manager
    llm.generate([workload[0].prompt], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    block_size, total = engine.config.block_size, engine.model_runner.num_blocks - 1
    start = time.perf_counter()
    for r in workload:
        engine.add_request(r.prompt, SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True))
    outputs, peak_used, peak_alloc, steps = [], 0, 0, 0
    while engine.has_unfinished_requests():
        result = engine.step()
        steps += 1
        outputs += result.outputs
        running = engine.scheduler.running
        peak_used = max(peak_used, sum(s.num_computed_tokens for s in running))
        peak_alloc = max(peak_alloc, (total - bm.num_free_blocks) * block_size)
    seconds = time.perf_counter() - start
    return Result(scheduling if scheduling == "static" else "nanoserve", seconds,
                  sum(len(o.token_ids) for o in outputs), sum(len(r.prompt) for r in workload),
                  [o.ttft for o in outputs], [(o.latency - o.ttft) / max(1, len(o.token_ids) - 1) for o in outputs],
                  peak_used, peak_alloc, total * block_size, {"steps": steps})


def load_hf(path: str):
    from transformers import LlamaForCausalLM
    return LlamaForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()


@torch.inference_mode()
def run_hf_generate(path: str, workload: list[Request]) -> Result:
    """transformers' `generate` on one left-padded static batch: every request runs until the
    longest one is done (min_new_tokens = max_new_tokens: EOS ignored, as for the others)."""
    from transformers import LogitsProcessor, LogitsProcessorList
    model = load_hf(path)
    stamps: list[float] = []

    class Clock(LogitsProcessor):  # called once per generated token position: a step clock
        def __call__(self, input_ids, scores):
            stamps.append(time.perf_counter())
            return scores

    width = max(len(r.prompt) for r in workload)
    ids = torch.tensor([[0] * (width - len(r.prompt)) + r.prompt for r in workload])
    mask = torch.tensor([[0] * (width - len(r.prompt)) + [1] * len(r.prompt) for r in workload])
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
def run_hf_continuous(path: str, workload: list[Request]) -> Result:
    """transformers' continuous batching manager, each request with its own max_new_tokens."""
    from transformers import GenerationConfig
    model = load_hf(path)
    config = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=max(r.output_len for r in workload))
    with model.continuous_batching_context_manager(generation_config=config) as manager:
        start = time.perf_counter()
        ids = [manager.add_request(r.prompt, max_new_tokens=r.output_len, eos_token_id=-1, record_timestamps=True)
               for r in workload]
        results = {}
        while len(results) < len(ids):
            out = manager.get_result(timeout=1)
            if out is not None and out.is_finished():
                results[out.request_id] = out
        seconds = time.perf_counter() - start
    outs = [results[i] for i in ids]
    ttft = [o.timestamps[0] - o.created_time for o in outs]
    tpot = [(o.timestamps[-1] - o.timestamps[0]) / max(1, len(o.timestamps) - 1) for o in outs]
    return Result("hf-cb", seconds, sum(len(o.generated_tokens) for o in outs),
                  sum(len(r.prompt) for r in workload), ttft, tpot)


# ------------------------------------------------------------------------------------ roofline

def measure_gemm_flops(size: int = 1024, repeats: int = 20) -> float:
    """This machine's float32 matmul rate (FLOP/s), from a square GEMM."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * size ** 3 * repeats / (time.perf_counter() - start)


def workload_flops(path: str, workload: list[Request]) -> float:
    """Matmul FLOPs the workload needs at least: the linear layers for every prompt and output
    token, attention (QK^T and PV) over each token's context, lm_head once per output token."""
    from transformers import AutoConfig
    c = AutoConfig.from_pretrained(path)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q, kv = c.num_attention_heads * head_dim, c.num_key_value_heads * head_dim
    linear = c.hidden_size * (q + 2 * kv) + q * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
    flops = 0.0
    for r in workload:
        tokens = len(r.prompt) + r.output_len - 1           # the last sampled token is never run
        context = tokens * (tokens + 1) / 2                  # sum of context lengths over its tokens
        flops += 2 * c.num_hidden_layers * (linear * tokens + 2 * q * context)
        flops += 2 * c.hidden_size * c.vocab_size * r.output_len
    return flops


# ------------------------------------------------------------------------------------ reporting

def report(results: list[Result], roofline_seconds: float, gemm: float) -> str:
    lines = ["| engine | output tok/s | total tok/s | TTFT p50 / p99 (s) | TPOT (ms) | peak KV used / allocated (slots) "
             "| nanoserve ÷ this |", "|---|---|---|---|---|---|---|"]
    ours = next((r for r in results if r.engine == "nanoserve"), None)
    for r in results:
        kv = f"{r.peak_kv_used} / {r.peak_kv_allocated}" if r.peak_kv_used is not None else "n/a"
        ratio = f"{ours.output_tok_s / r.output_tok_s:.2f}x" if ours else "n/a"
        lines.append(f"| {r.engine} | {r.output_tok_s:.0f} | {r.total_tok_s:.0f} | {percentile(r.ttft, 50):.2f} / "
                     f"{percentile(r.ttft, 99):.2f} | {1000 * statistics.mean(r.tpot):.1f} | {kv} | {ratio} |")
    lines.append(f"\nmeasured GEMM rate {gemm / 1e9:.0f} GFLOP/s; the workload's matmuls at that rate take "
                 f"{roofline_seconds:.2f} s (roofline)")
    for r in results:
        lines.append(f"- {r.engine}: {r.seconds:.2f} s, {100 * roofline_seconds / r.seconds:.0f}% of the roofline")
    return "\n".join(lines)


def run_online(path: str, workload: list[Request], rates: list[float], seed: int, config: dict) -> str:
    """Requests arrive as a Poisson process at each rate; TTFT and TPOT percentiles per scheduler."""
    from nanoserve import LLM, SamplingParams
    lines = ["| scheduling | rate (req/s) | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) | seconds |", "|---|---|---|---|---|"]
    for scheduling in ("continuous", "static"):
        llm = LLM(path, scheduling=scheduling, enable_prefix_caching=False, **config)
        llm.generate([workload[0].prompt], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
        engine = llm.engine
        for rate in rates:
            rng = random.Random(seed)
            arrivals, t = [], 0.0
            for _ in workload:
                t += rng.expovariate(rate)
                arrivals.append(t)
            outputs, late, i, start = [], {}, 0, time.perf_counter()
            while i < len(workload) or engine.has_unfinished_requests():
                now = time.perf_counter() - start
                while i < len(workload) and arrivals[i] <= now:  # every request that has arrived joins
                    request_id = engine.add_request(workload[i].prompt, SamplingParams(
                        temperature=0, max_tokens=workload[i].output_len, ignore_eos=True))
                    late[request_id] = now - arrivals[i]  # it arrived during a step: count that wait
                    i += 1
                if engine.has_unfinished_requests():
                    outputs += engine.step().outputs
                else:
                    time.sleep(max(0.0, arrivals[i] - now))
            ttft = [o.ttft + late[o.request_id] for o in outputs]
            tpot = [(o.latency - o.ttft) / max(1, len(o.token_ids) - 1) for o in outputs]
            lines.append(f"| {scheduling} | {rate:g} | {percentile(ttft, 50):.2f} / {percentile(ttft, 99):.2f} | "
                         f"{1000 * percentile(tpot, 50):.1f} / {1000 * percentile(tpot, 99):.1f} | "
                         f"{time.perf_counter() - start:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a Llama checkpoint folder (default: a random ~40M Llama, built once)")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--input-len", default="16-256", help="prompt lengths, MIN-MAX")
    p.add_argument("--output-len", default="16-192", help="output lengths, MIN-MAX")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, from {ENGINES}")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--kv-cache-tokens", type=int, default=8192,
                   help="nanoserve's KV cache size for both schedulers: the memory a static batch must reserve")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--json", help="also write the results to this JSON file")
    p.add_argument("--online", action="store_true", help="Poisson arrivals to nanoserve continuous and static")
    p.add_argument("--rates", default="1,2,4,8", help="with --online: request rates (req/s)")
    args = p.parse_args(argv)
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.model or build_default_model(os.path.join(tempfile.gettempdir(), "nanoserve-bench"))
    from transformers import AutoConfig
    vocab = AutoConfig.from_pretrained(path).vocab_size
    span = lambda s: tuple(int(x) for x in s.split("-"))  # noqa: E731
    workload = make_workload(args.num_requests, span(args.input_len), span(args.output_len), vocab, args.seed)
    config = dict(block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                  num_kvcache_blocks=args.kv_cache_tokens // args.block_size + 1,  # + the null block
                  max_model_len=max(len(r.prompt) + r.output_len for r in workload))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {len(workload)} requests, "
          f"{sum(len(r.prompt) for r in workload)} prompt + {sum(r.output_len for r in workload)} output tokens")
    if args.online:
        print(run_online(path, workload, [float(r) for r in args.rates.split(",")], args.seed, config))
        return
    gemm = measure_gemm_flops()
    runners = {"nanoserve": lambda: run_nanoserve(path, workload, "continuous", **config),
               "static": lambda: run_nanoserve(path, workload, "static", **config),
               "hf-generate": lambda: run_hf_generate(path, workload),
               "hf-cb": lambda: run_hf_continuous(path, workload)}
    results = []
    for name in args.engines.split(","):
        if name not in runners:
            raise SystemExit(f"unknown engine {name!r}; choose from {ENGINES}")
        results.append(runners[name]())
        print(f"{name}: {results[-1].seconds:.2f} s", flush=True)
    roofline = workload_flops(path, workload) / gemm
    print(report(results, roofline, gemm))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gemm_flops": gemm, "roofline_seconds": roofline, "results": [asdict(r) for r in results]}, f)


if __name__ == "__main__":
    main()
