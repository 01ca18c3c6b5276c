"""Benchmark: nanoserve (continuous and static) vs transformers (static generate and continuous
batching), side by side in one process, on one workload. Ratios, not absolute numbers, are the
point: every engine runs on the same machine in the same run.

    python -m nanoserve.bench                       # the default ~40M-parameter random Llama, 48 requests
    python -m nanoserve.bench --dtype bfloat16      # every engine in bfloat16
    python -m nanoserve.bench --engines nanoserve,static --num-requests 16
    python -m nanoserve.bench --online --rates 2,4,8     # Poisson arrivals: TTFT, TPOT and goodput vs request rate
    python -m nanoserve.bench --workload nanovllm        # nano-vllm's bench.py, scaled to a CPU
    python -m nanoserve.bench --workload shared-prefix   # 32 requests, one 256-token system prompt, all at once
    python -m nanoserve.bench --profile-decode 48        # where one decode step of 48 requests spends its time
    python -m nanoserve.bench --server http://127.0.0.1:8000 --rates 2,4,8   # the same load over HTTP + SSE
    python -m nanoserve.bench --llama-cpp llama-batched-bench --gguf model.gguf --model HF_FOLDER  # vs llama.cpp
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass, field

import torch

ENGINES = ("nanoserve", "static", "hf-generate", "hf-cb")
# The warm-up prompt: ids below 3, which workloads never draw, and shorter than any block, so that
# it leaves nothing in the prefix cache that a workload's prompt could hit.
WARM_UP = [1, 2]
# The named workloads' shapes (`--workload`); "random" takes --num-requests, --input-len, --output-len.
WORKLOADS = {
    # nano-vllm's bench.py: 256 requests, prompt and output lengths uniform in 100-1024, temperature
    # 0.6, ignore_eos; scaled to a CPU: a quarter of the requests, an eighth of the lengths
    "nanovllm": dict(num_requests=64, input_len=(13, 128), output_len=(13, 128), temperature=0.6),
    # the seeds' online scenario: many users, one system prompt, arriving together
    "shared-prefix": dict(num_requests=32, input_len=(16, 64), output_len=(16, 64), shared_prefix=256),
}
DEFAULT_MODEL = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                     intermediate_size=1408, vocab_size=32000, max_position_embeddings=1024)


@dataclass
class Request:
    prompt: list[int]
    output_len: int
    temperature: float = 0.0  # nanoserve's engines sample at it; transformers' are always greedy


@dataclass
class Step:
    """One engine step as the roofline sees it."""
    seconds: float
    query_lens: list[int]   # tokens each request runs this step
    seq_lens: list[int]     # each request's context after this step
    num_sampled: int        # rows that go through lm_head

    @property
    def phase(self) -> str:
        decode = sum(n == 1 for n in self.query_lens)
        return "decode" if decode == len(self.query_lens) else "prefill" if decode == 0 else "mixed"


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
    steps: list[Step] = field(default_factory=list)  # nanoserve's steps, for the roofline

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
                  vocab_size: int, seed: int, temperature: float = 0.0, shared_prefix: int = 0) -> list[Request]:
    """Random token-id prompts and output lengths, each drawn uniformly from its range; with
    `shared_prefix`, every prompt starts with the same that many tokens (a system prompt)."""
    rng = random.Random(seed)
    system = [rng.randrange(3, vocab_size) for _ in range(shared_prefix)]
    return [Request(system + [rng.randrange(3, vocab_size) for _ in range(rng.randint(*input_len))],
                    rng.randint(*output_len), temperature) for _ in range(num_requests)]


def whole_blocks(num_tokens: int, block_size: int) -> int:
    """`num_tokens` rounded up to whole KV blocks (the engine wants max_model_len >= block_size)."""
    return -(-num_tokens // block_size) * block_size


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))] if values else float("nan")


# ------------------------------------------------------------------------------------ engines

def run_nanoserve(path: str, workload: list[Request], scheduling: str, **config) -> Result:
    """Every request queued at once. Prefix caching is off unless `config` turns it on."""
    from nanoserve import LLM, SamplingParams
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
    llm.close()  # stops tensor-parallel workers
    return Result(scheduling if scheduling == "static" else "nanoserve", seconds,
                  sum(len(o.token_ids) for o in outputs), sum(len(r.prompt) for r in workload),
                  [o.ttft for o in outputs], [(o.latency - o.ttft) / max(1, len(o.token_ids) - 1) for o in outputs],
                  peak_used, peak_alloc, total * block_size,
                  {"steps": len(steps), "prefill_tokens": prefill_tokens,
                   "computed_tokens": sum(sum(s.query_lens) for s in steps),
                   "cached_tokens": sum(o.num_cached_tokens for o in outputs),
                   "preemptions": engine.stats()["num_preemptions"]}, steps)


def nanovllm_table(results: list[Result]) -> str:
    """The columns of nano-vllm's published benchmark table, to set beside it (throughput: output
    tokens over the time to serve all requests, as its bench.py counts)."""
    lines = ["| Inference Engine | Output Tokens | Time (s) | Throughput (tokens/s) |", "|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r.engine} | {r.output_tokens:,} | {r.seconds:.2f} | {r.output_tok_s:.2f} |")
    return "\n".join(lines)


def compare_prefix_caching(path: str, workload: list[Request], config: dict) -> str:
    """The shared-prefix workload with prefix caching on and off: prefill tokens the model ran, prompt
    tokens served from the cache, time to first token (all requests arrive at once) and seconds."""
    lines = ["| prefix caching | prefill tokens computed | cached tokens | TTFT p50 / p99 (s) | seconds |",
             "|---|---|---|---|---|"]
    for caching in (True, False):
        r = run_nanoserve(path, workload, "continuous", **config, enable_prefix_caching=caching)
        lines.append(f"| {'on' if caching else 'off'} | {r.extra['prefill_tokens']} | {r.extra['cached_tokens']} | "
                     f"{percentile(r.ttft, 50):.2f} / {percentile(r.ttft, 99):.2f} | {r.seconds:.2f} |")
    return "\n".join(lines)


def load_hf(path: str, dtype: str, device: str = "cpu"):
    from transformers import LlamaForCausalLM
    model = LlamaForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    return model.to(device).eval()


@torch.inference_mode()
def run_hf_generate(path: str, workload: list[Request], dtype: str, device: str = "cpu") -> Result:
    """transformers' `generate` on one left-padded static batch: every request runs until the
    longest one is done (min_new_tokens = max_new_tokens: EOS ignored, as for the others)."""
    from transformers import LogitsProcessor, LogitsProcessorList
    model = load_hf(path, dtype, device)
    stamps: list[float] = []

    class Clock(LogitsProcessor):  # called once per generated token position: a step clock
        def __call__(self, input_ids, scores):
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
def run_hf_continuous(path: str, workload: list[Request], dtype: str, device: str = "cpu") -> Result:
    """transformers' continuous batching manager, each request with its own max_new_tokens."""
    from transformers import GenerationConfig
    model = load_hf(path, dtype, device)
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

@dataclass(frozen=True)
class Machine:
    """The two limits, measured in the run's dtype: GEMM rate π (FLOP/s) and stream bandwidth β (bytes/s)."""
    flops: float
    bandwidth: float


def best_seconds(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)  # the machine's rate, not the neighbours' load: the best of a few


def measure_machine(dtype: torch.dtype, device: str = "cpu", size: int = 1024, stream_mb: int = 256) -> Machine:
    """π from a square GEMM, β from copying a tensor far larger than the caches (read + write), on `device`."""
    a, b = torch.randn(size, size, dtype=dtype, device=device), torch.randn(size, size, dtype=dtype, device=device)
    src = torch.empty(stream_mb * 2 ** 20, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    done = torch.cuda.synchronize if torch.device(device).type == "cuda" else lambda: None  # GPU work is queued
    return Machine(flops=2 * size ** 3 / best_seconds(lambda: (a @ b, done()), 20),
                   bandwidth=2 * src.numel() / best_seconds(lambda: (dst.copy_(src), done()), 5))


@dataclass(frozen=True)
class ModelShape:
    """What a step's FLOPs and bytes depend on, from config.json."""
    layers: int
    hidden: int
    q_size: int       # heads * head_dim
    kv_size: int      # kv heads * head_dim
    intermediate: int
    vocab: int
    itemsize: int     # bytes per weight and KV element in the run's dtype

    @classmethod
    def read(cls, path: str, dtype: torch.dtype) -> ModelShape:
        from transformers import AutoConfig
        c = AutoConfig.from_pretrained(path)
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return cls(c.num_hidden_layers, c.hidden_size, c.num_attention_heads * head_dim,
                   c.num_key_value_heads * head_dim, c.intermediate_size, c.vocab_size, dtype.itemsize)

    @property
    def layer_params(self) -> int:  # qkv, o, gate_up, down
        qkv, o = self.hidden * (self.q_size + 2 * self.kv_size), self.q_size * self.hidden
        return qkv + o + 3 * self.hidden * self.intermediate


def step_limit(step: Step, m: ModelShape, machine: Machine) -> tuple[float, bool]:
    """The step's roofline time max(FLOPs / π, bytes / β), and whether FLOPs are the bound.
    FLOPs: linear layers for every token, q·Kᵀ and P·V over each query's visible keys, lm_head per
    sampled row. Bytes: the layers' weights and lm_head read once, KV read and KV written."""
    tokens = sum(step.query_lens)
    # a request with q queries over k keys (causal, its queries last): q*k - q*(q-1)/2 query-key pairs
    pairs = sum(q * k - q * (q - 1) // 2 for q, k in zip(step.query_lens, step.seq_lens))
    flops = 2 * m.layers * (m.layer_params * tokens + 2 * m.q_size * pairs) + 2 * m.hidden * m.vocab * step.num_sampled
    weights = m.layers * m.layer_params + (m.hidden * m.vocab if step.num_sampled else 0)
    kv = 2 * m.layers * m.kv_size * (sum(step.seq_lens) + tokens)  # read every context, write the new tokens
    compute, memory = flops / machine.flops, (weights + kv) * m.itemsize / machine.bandwidth
    return max(compute, memory), compute >= memory


# ------------------------------------------------------------------------------------ reporting

def report(results: list[Result], machine: Machine, shape: ModelShape) -> str:
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


def poisson_arrivals(num_requests: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each request arrives: exponential gaps at `rate` req/s."""
    rng, arrivals, t = random.Random(seed), [], 0.0
    for _ in range(num_requests):
        t += rng.expovariate(rate)
        arrivals.append(t)
    return arrivals


@dataclass
class OnlineRun:
    """One scheduler at one request rate: what each request saw, counted from its arrival."""
    scheduling: str
    rate: float
    ttft: list[float]     # seconds to the first token
    tpot: list[float]     # seconds per output token after the first: (latency - ttft) / (output tokens - 1)
    latency: list[float]  # seconds to the last token
    seconds: float        # from the first arrival to the last request's end

    def goodput(self, slo: dict[str, float]) -> float:
        """vLLM's `bench serve --goodput`: completed requests per second that meet every SLO
        (milliseconds; keys ttft, tpot, e2el, where e2el is the latency)."""
        measured = {"ttft": self.ttft, "tpot": self.tpot, "e2el": self.latency}
        good = sum(all(measured[key][i] * 1000 <= limit for key, limit in slo.items()) for i in range(len(self.ttft)))
        return good / self.seconds


def parse_slo(pair: str) -> tuple[str, float]:
    """"ttft:1000" -> ("ttft", 1000.0), as vLLM's --goodput takes it."""
    key, _, value = pair.partition(":")
    try:
        limit = float(value)
    except ValueError:
        limit = -1.0
    if key not in ("ttft", "tpot", "e2el") or limit < 0:
        raise argparse.ArgumentTypeError(f"{pair!r}: an SLO is ttft:MS, tpot:MS or e2el:MS, MS a number >= 0")
    return key, limit


def run_online(path: str, workload: list[Request], rates: list[float], seed: int, config: dict) -> list[OnlineRun]:
    """Requests arrive as a Poisson process at each rate and join the running engine; each
    scheduler at each rate. TTFT and latency count from a request's arrival (`arrival_time`), even
    when it arrived during a step."""
    from nanoserve import LLM, SamplingParams
    runs = []
    for scheduling in ("continuous", "static"):
        llm = LLM(path, scheduling=scheduling, **{"enable_prefix_caching": False, **config})
        llm.generate([WARM_UP], SamplingParams(max_tokens=2), use_tqdm=False)
        engine = llm.engine
        for rate in rates:
            arrivals = poisson_arrivals(len(workload), rate, seed)
            outputs, i, start = [], 0, time.perf_counter()
            while i < len(workload) or engine.has_unfinished_requests():
                now = time.perf_counter() - start
                while i < len(workload) and arrivals[i] <= now:  # every request that has arrived joins
                    r = workload[i]
                    engine.add_request(r.prompt, SamplingParams(temperature=r.temperature, max_tokens=r.output_len,
                                                                ignore_eos=True), arrival_time=start + arrivals[i])
                    i += 1
                if engine.has_unfinished_requests():
                    outputs += engine.step().outputs
                else:
                    time.sleep(max(0.0, arrivals[i] - now))
            runs.append(OnlineRun(scheduling, rate, [o.ttft for o in outputs],
                                  [(o.latency - o.ttft) / max(1, len(o.token_ids) - 1) for o in outputs],
                                  [o.latency for o in outputs], time.perf_counter() - start - arrivals[0]))
        llm.close()
    return runs


def online_report(runs: list[OnlineRun], slo: dict[str, float]) -> str:
    """The table, then where each scheduler's goodput peaks: past that rate it saturates (requests
    queue and miss their SLOs), and the ratio of the two at static batching's peak rate."""
    slos = ", ".join(f"{key} <= {limit:g} ms" for key, limit in slo.items())
    lines = ["| scheduling | rate (req/s) | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) "
             f"| goodput (req/s; {slos}) | seconds |", "|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r.scheduling} | {r.rate:g} | {percentile(r.ttft, 50):.2f} / {percentile(r.ttft, 99):.2f} | "
                     f"{1000 * percentile(r.tpot, 50):.1f} / {1000 * percentile(r.tpot, 99):.1f} | "
                     f"{r.goodput(slo):.2f} | {r.seconds:.1f} |")
    peaks, lines = {}, lines + [""]
    for scheduling in ("continuous", "static"):
        mine = [r for r in runs if r.scheduling == scheduling]
        peaks[scheduling] = max(mine, key=lambda r: (r.goodput(slo), -r.rate))  # the lowest rate of the best
        lines.append(f"{scheduling}: goodput peaks at {peaks[scheduling].goodput(slo):.2f} req/s, offered "
                     f"{peaks[scheduling].rate:g} req/s")
    at_static_peak = next(r for r in runs if r.scheduling == "continuous" and r.rate == peaks["static"].rate)
    static_goodput = peaks["static"].goodput(slo)
    ratio = f"{at_static_peak.goodput(slo) / static_goodput:.2f}x" if static_goodput else "inf (static meets no SLO)"
    lines.append(f"at {peaks['static'].rate:g} req/s, static batching's peak: continuous ÷ static goodput = {ratio}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ over HTTP

@dataclass
class Stream:
    """One streamed completion as the client saw it."""
    ttft: float | None    # seconds from its scheduled arrival to the first chunk with text
    itl: list[float]      # seconds between successive chunks with text
    output_tokens: int    # the server's usage count (chunks with text, if it sends no usage)


def stream_completion(client, model: str, request: Request, arrival: float) -> Stream:
    """POST one request with `stream: true` and time its SSE chunks against `arrival` (perf_counter)."""
    body = dict(model=model, prompt=request.prompt, max_tokens=request.output_len, temperature=0,
                ignore_eos=True, stream=True, stream_options=dict(include_usage=True))
    stamps, usage = [], None
    with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue  # blank lines and ": keep-alive" comments carry no tokens
            chunk = json.loads(line[len("data: "):])
            usage = chunk.get("usage") or usage
            if any(choice.get("text") for choice in chunk["choices"]):
                stamps.append(time.perf_counter())
    return Stream(stamps[0] - arrival if stamps else None, [b - a for a, b in zip(stamps, stamps[1:])],
                  usage["completion_tokens"] if usage else len(stamps))


def run_http(url: str, workload: list[Request], rates: list[float], seed: int, api_key: str | None) -> str:
    """`run_online`'s Poisson load sent to a running OpenAI-compatible server, one thread per request."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    lines = ["| rate (req/s) | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) | output tok/s | seconds |",
             "|---|---|---|---|---|"]
    with httpx.Client(base_url=url, headers=headers, timeout=600, limits=httpx.Limits(max_connections=None)) as client:
        model = client.get("/v1/models").raise_for_status().json()["data"][0]["id"]
        stream_completion(client, model, Request(workload[0].prompt, 2), time.perf_counter())  # warm-up
        for rate in rates:
            arrivals, start = poisson_arrivals(len(workload), rate, seed), time.perf_counter()

            def send(i: int, start: float = start, arrivals: list[float] = arrivals) -> Stream:
                time.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
                return stream_completion(client, model, workload[i], start + arrivals[i])

            with ThreadPoolExecutor(len(workload)) as pool:
                streams = list(pool.map(send, range(len(workload))))
            seconds = time.perf_counter() - start
            ttft = [s.ttft for s in streams if s.ttft is not None]
            itl = [gap for s in streams for gap in s.itl]
            lines.append(f"| {rate:g} | {percentile(ttft, 50):.2f} / {percentile(ttft, 99):.2f} | "
                         f"{1000 * percentile(itl, 50):.1f} / {1000 * percentile(itl, 99):.1f} | "
                         f"{sum(s.output_tokens for s in streams) / seconds:.0f} | {seconds:.1f} |")
    return "\n".join(lines)


def profile_decode(path: str, num_requests: int, vocab_size: int, config: dict) -> str:
    """Where one decode step's time goes: `num_requests` requests past their prompts (100-200
    tokens each). Attention (writing K/V, gathering blocks, SDPA) is timed around every layer's call of
    the attention backend over 5 steps (the median step is reported); op shares come from
    torch.profiler on one more."""
    from nanoserve import LLM, SamplingParams
    # room for all: each request reaches at most 232 tokens, 15 blocks of 16; the cache must also
    # hold one max_model_len request, so that is 256 here, not the model's (8192 for SmolLM2)
    config = config | dict(num_kvcache_blocks=num_requests * 18 + 1, max_model_len=256)
    engine = LLM(path, enable_prefix_caching=False, **config).engine
    rng = random.Random(0)
    for _ in range(num_requests):
        engine.add_request([rng.randrange(3, vocab_size) for _ in range(rng.randint(100, 200))],
                           SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    while engine.step().num_prefill_tokens:  # until every request decodes
        pass
    attention: list[float] = []
    backend = engine.model_runner.model.model.attention  # one backend, called by every layer
    forward = backend.forward

    def timed_forward(*args: object) -> torch.Tensor:
        start = time.perf_counter()
        out = forward(*args)
        attention.append(time.perf_counter() - start)
        return out
    backend.forward = timed_forward
    steps = []
    for _ in range(5):
        attention.clear()
        start = time.perf_counter()
        engine.step()
        steps.append((time.perf_counter() - start, sum(attention)))
    step, attend = sorted(steps)[2]
    with torch.profiler.profile() as prof:
        engine.step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    share = lambda *names: 100 * sum(e.self_cpu_time_total for e in events if e.key in names) / total  # noqa: E731
    return ("| dtype | requests | step (ms) | attention | matmuls | SDPA | index_select (KV gather) |\n"
            "|---|---|---|---|---|---|---|\n"
            f"| {config['dtype']} | {num_requests} | {1000 * step:.1f} | {100 * attend / step:.0f}% | "
            f"{share('aten::mm', 'aten::addmm', 'mkldnn::_linear_pointwise'):.0f}% | "
            f"{share('aten::_scaled_dot_product_flash_attention_for_cpu'):.0f}% | "
            f"{share('aten::index_select'):.0f}% |")


# ------------------------------------------------------------------------------------ llama.cpp as a peer

@dataclass(frozen=True)
class PeerRow:
    """One engine at one batch size: B requests, each a fixed prompt and a fixed number of outputs."""
    engine: str
    batch_size: int
    ms_per_token: float   # one decode step, i.e. one output token of each request
    total_tok_s: float    # prompt + generated tokens over the wall time


def parse_batched_bench(output: str) -> list[PeerRow]:
    """Rows of `llama-batched-bench --output-format jsonl`: t_tg is the time of its tg decode steps
    after the prompts, speed is (B * pp + B * tg) / (t_pp + t_tg)."""
    rows = [json.loads(line) for line in output.splitlines() if line.startswith('{"n_kv_max"')]
    return [PeerRow("llama.cpp", r["pl"], 1000 * r["t_tg"] / r["tg"], r["speed"]) for r in rows]


def run_llama_cpp(binary: str, gguf: str, batch_sizes: list[int], prompt_len: int, gen_len: int,
                  threads: int) -> list[PeerRow]:
    """llama.cpp's own batched benchmark: B independent sequences (prompts not shared), each with
    `prompt_len` random prompt tokens, then `gen_len` decode steps of all B together."""
    found = shutil.which(binary)
    if found is None:
        raise SystemExit(f"llama-batched-bench not found or not executable: {binary!r} (the README's "
                         "'llama.cpp as a yardstick' shows how to build it)")
    context = max(batch_sizes) * (prompt_len + gen_len)  # it skips any B whose sequences do not fit
    cmd = [found, "-m", gguf, "-c", str(context), "-npp", str(prompt_len), "-ntg", str(gen_len),
           "-npl", ",".join(map(str, batch_sizes)), "-t", str(threads), "-tb", str(threads), "--output-format", "jsonl"]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rows = parse_batched_bench(done.stdout)
    if done.returncode != 0 or len(rows) != len(batch_sizes):
        raise SystemExit(f"{' '.join(cmd)} failed (exit {done.returncode}):\n{done.stdout[-2000:]}")
    return rows


def run_nanoserve_batch(path: str, batch_size: int, prompt_len: int, gen_len: int, dtype: str,
                        vocab_size: int, seed: int) -> PeerRow:
    """The same shape on nanoserve: B requests of random prompt ids, greedy, EOS ignored, all at once."""
    workload = make_workload(batch_size, (prompt_len, prompt_len), (gen_len, gen_len), vocab_size, seed)
    max_model_len = whole_blocks(prompt_len + gen_len, 16)
    result = run_nanoserve(path, workload, "continuous", block_size=16, max_num_seqs=batch_size, dtype=dtype,
                           max_model_len=max_model_len, num_kvcache_blocks=batch_size * max_model_len // 16 + 1)
    decode = [s.seconds for s in result.steps if s.phase == "decode"]  # every request past its prompt
    return PeerRow("nanoserve", batch_size, 1000 * statistics.mean(decode), result.total_tok_s)


def run_transformers_batch(path: str, batch_size: int, prompt_len: int, gen_len: int, dtype: str,
                           vocab_size: int, seed: int) -> PeerRow:
    """The same shape on transformers' `generate` (run_hf_generate): one static batch with no padding,
    every prompt being prompt_len long; a decode step is the time between two generated tokens."""
    workload = make_workload(batch_size, (prompt_len, prompt_len), (gen_len, gen_len), vocab_size, seed)
    result = run_hf_generate(path, workload, dtype)
    return PeerRow("transformers", batch_size, 1000 * statistics.mean(result.tpot), result.total_tok_s)


def peer_table(rows: list[PeerRow]) -> str:
    """One line per batch size, the engines side by side (in the order of `rows`), and nanoserve's
    time per output token over llama.cpp's; "n/a" where an engine has no row for that B."""
    engines = list(dict.fromkeys(r.engine for r in rows))
    by_key = {(r.engine, r.batch_size): r for r in rows}
    lines = ["| B | " + " | ".join(f"{e} ms/token" for e in engines) + " | "
             + " | ".join(f"{e} total tok/s" for e in engines) + " | nanoserve ÷ llama.cpp ms/token |",
             "|---" * (2 * len(engines) + 2) + "|"]
    for b in sorted({r.batch_size for r in rows}):
        cells = [by_key.get((e, b)) for e in engines]
        ours, theirs = by_key.get(("nanoserve", b)), by_key.get(("llama.cpp", b))
        ratio = f"{ours.ms_per_token / theirs.ms_per_token:.2f}x" if ours and theirs else "n/a"
        lines.append(f"| {b} | " + " | ".join(f"{r.ms_per_token:.1f}" if r else "n/a" for r in cells) + " | "
                     + " | ".join(f"{r.total_tok_s:.0f}" if r else "n/a" for r in cells) + f" | {ratio} |")
    return "\n".join(lines)


def compare_llama_cpp(binary: str, gguf: str, path: str, batch_sizes: list[int], prompt_len: int, gen_len: int,
                      dtype: str, vocab_size: int, seed: int, with_transformers: bool = True) -> str:
    rows = run_llama_cpp(binary, gguf, batch_sizes, prompt_len, gen_len, torch.get_num_threads())
    rows += [run_nanoserve_batch(path, b, prompt_len, gen_len, dtype, vocab_size, seed) for b in batch_sizes]
    if with_transformers:
        rows += [run_transformers_batch(path, b, prompt_len, gen_len, dtype, vocab_size, seed) for b in batch_sizes]
    return peer_table(rows)


def compare_tensor_parallel(path: str, workload: list[Request], config: dict, size: int) -> str:
    """The same workload on one process with T and size*T threads, and on `size` ranks of T threads
    each (T: torch's threads now; the ranks split their process's size*T): the same cores, two ways."""
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


def describe_cpu() -> str:
    """Which CPU a run measured, for every table: its model name, the ISA extensions that pick torch's and
    oneDNN's kernels (as the hardware reports them), torch's kernel level (ATEN_CPU_CAPABILITY can lower
    it), whether oneDNN runs bfloat16 here, the threads, and any env var that holds an ISA back."""
    model = platform.processor() or platform.machine()
    if os.path.isfile("/proc/cpuinfo"):  # Linux: the marketing name ("AMD EPYC 9B14")
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    isa = {"avx2": torch.cpu._is_avx2_supported(), "avx512f": torch.cpu._is_avx512_supported(),
           "avx512_bf16": torch.cpu._is_avx512_bf16_supported(), "amx": torch.cpu._is_amx_tile_supported()}
    held = [f"{k}={os.environ[k]}" for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
            if k in os.environ]
    from nanoserve.device import has_onednn
    bf16 = has_onednn(torch.bfloat16)
    return (f"CPU: {model}; ISA {' '.join(k if v else f'no-{k}' for k, v in isa.items())}; torch capability "
            f"{torch.backends.cpu.get_cpu_capability()}; oneDNN bf16 {'yes' if bf16 else 'no'}; "
            f"{torch.get_num_threads()} threads" + (f"; held back by {' '.join(held)}" if held else ""))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a Llama checkpoint folder (default: a random ~40M Llama, built once)")
    p.add_argument("--num-requests", type=int, help="default: 48, or the --workload's own number")
    p.add_argument("--input-len", default="16-256", help="prompt lengths, MIN-MAX")
    p.add_argument("--output-len", default="16-192", help="output lengths, MIN-MAX")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, from {ENGINES}")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--kv-cache-tokens", type=int, default=8192,
                   help="nanoserve's KV cache size for both schedulers: the memory a static batch must reserve")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="every engine's dtype")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--device", help="every engine's and the roofline's device (default: cuda if present, else cpu)")
    p.add_argument("--json", help="also write the results to this JSON file")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--online", action="store_true", help="Poisson arrivals to nanoserve continuous and static")
    mode.add_argument("--profile-decode", type=int, metavar="N", help="profile one decode step of N requests instead")
    mode.add_argument("--server", metavar="URL", help="Poisson arrivals over HTTP to a running server (no engine here)")
    mode.add_argument("--llama-cpp", metavar="BINARY",
                      help="llama-batched-bench vs nanoserve, per batch size (needs --gguf)")
    mode.add_argument("--tensor-parallel", type=int, metavar="N",
                      help="nanoserve on 1 process vs N ranks (tensor parallelism), --threads each")
    p.add_argument("--gguf", help="with --llama-cpp: the --model checkpoint converted to GGUF in the same dtype")
    p.add_argument("--batch-sizes", default="1,8,64", help="with --llama-cpp: B requests decoding together")
    p.add_argument("--prompt-len", type=int, default=128, help="with --llama-cpp: prompt tokens per request")
    p.add_argument("--gen-len", type=int, default=128, help="with --llama-cpp: generated tokens per request")
    p.add_argument("--no-transformers", action="store_true",
                   help="with --llama-cpp: leave out transformers' generate on the same shape")
    p.add_argument("--rates", default="1,2,4,8", help="with --online or --server: request rates (req/s)")
    p.add_argument("--goodput", nargs="+", type=parse_slo, default=[("ttft", 1000.0), ("tpot", 100.0)],
                   metavar="KEY:MS",
                   help="with --online: the SLOs a request must meet to count (vLLM's bench serve --goodput): "
                        "ttft, tpot and e2el in milliseconds (default: ttft:1000 tpot:100)")
    p.add_argument("--workload", default="random", choices=("random", "nanovllm", "shared-prefix"),
                   help="random: --num-requests of --input-len and --output-len, greedy. nanovllm: nano-vllm's "
                        "bench.py (256 requests, prompts and outputs of 100-1024 tokens, temperature 0.6) scaled "
                        "to a CPU: 64 requests of 13-128 tokens. shared-prefix: 32 requests, one 256-token system "
                        "prompt plus 16-64 tokens each, outputs of 16-64, prefix caching on and off")
    p.add_argument("--api-key", help="with --server: sent as a Bearer token")
    args = p.parse_args(argv)
    span = lambda s: tuple(int(x) for x in s.split("-"))  # noqa: E731
    if args.server:
        # The server's vocab size is not in /v1/models: ids below 1000 are valid for any Llama vocab
        workload = make_workload(args.num_requests or 48, span(args.input_len), span(args.output_len), 1000, args.seed)
        print(run_http(args.server, workload, [float(r) for r in args.rates.split(",")], args.seed, args.api_key))
        return
    torch.manual_seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(describe_cpu())
    path = args.model or build_default_model(os.path.join(tempfile.gettempdir(), "nanoserve-bench"))
    from transformers import AutoConfig
    vocab = AutoConfig.from_pretrained(path).vocab_size
    if args.llama_cpp:
        if not args.gguf:
            raise SystemExit("--llama-cpp needs --gguf, the same model in GGUF")
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads (every engine), {args.dtype}; "
              f"{args.prompt_len} prompt + {args.gen_len} generated tokens per request")
        print(compare_llama_cpp(args.llama_cpp, args.gguf, path, [int(b) for b in args.batch_sizes.split(",")],
                                args.prompt_len, args.gen_len, args.dtype, vocab, args.seed, not args.no_transformers))
        return
    sizes = WORKLOADS.get(args.workload, dict(num_requests=48, input_len=span(args.input_len),
                                               output_len=span(args.output_len)))
    workload = make_workload(vocab_size=vocab, seed=args.seed,
                             **{**sizes, "num_requests": args.num_requests or sizes["num_requests"]})
    config = dict(block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                  num_kvcache_blocks=args.kv_cache_tokens // args.block_size + 1,  # + the null block
                  max_model_len=whole_blocks(max(len(r.prompt) + r.output_len for r in workload), args.block_size),
                  dtype=args.dtype, device=args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    print(f"torch {torch.__version__} on {config['device']}, {torch.get_num_threads()} threads, {args.dtype}; "
          f"{len(workload)} requests, "
          f"{sum(len(r.prompt) for r in workload)} prompt + {sum(r.output_len for r in workload)} output tokens")
    if args.profile_decode:
        print(profile_decode(path, args.profile_decode, vocab, config))
        return
    if args.tensor_parallel:
        print(compare_tensor_parallel(path, workload, config, args.tensor_parallel))
        return
    if args.online:
        runs = run_online(path, workload, [float(r) for r in args.rates.split(",")], args.seed, config)
        print(online_report(runs, dict(args.goodput)))
        return
    if args.workload == "shared-prefix":
        print(compare_prefix_caching(path, workload, config))
        return
    dtype = getattr(torch, args.dtype)
    machine, shape = measure_machine(dtype, config["device"]), ModelShape.read(path, dtype)
    if args.workload == "nanovllm" and args.engines == ",".join(ENGINES):
        args.engines = "nanoserve,static"  # transformers' engines here are greedy, not at temperature 0.6
    runners = {"nanoserve": lambda: run_nanoserve(path, workload, "continuous", **config),
               "static": lambda: run_nanoserve(path, workload, "static", **config),
               "hf-generate": lambda: run_hf_generate(path, workload, args.dtype, config["device"]),
               "hf-cb": lambda: run_hf_continuous(path, workload, args.dtype, config["device"])}
    results = []
    for name in args.engines.split(","):
        if name not in runners:
            raise SystemExit(f"unknown engine {name!r}; choose from {ENGINES}")
        results.append(runners[name]())
        print(f"{name}: {results[-1].seconds:.2f} s", flush=True)
    print(report(results, machine, shape))
    if args.workload == "nanovllm":
        print(nanovllm_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dtype": args.dtype, "machine": asdict(machine), "results": [asdict(r) for r in results]}, f)


if __name__ == "__main__":
    main()
