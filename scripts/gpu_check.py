"""Check nanoserve on one GPU in one command, and print the results as one markdown table, row by row.

    python scripts/gpu_check.py            # on a CUDA machine: a few minutes on one H200
    python scripts/gpu_check.py --dry-run  # the same code on the CPU with tiny sizes (the test suite runs it)

Needs torch, transformers and the test extra (pytest); flash-attn is optional, the network is not used
(every model is built here with random weights). What it checks, each as rows of the table:
  1. the environment: versions, the GPU and its compute capability, and what LLM() picks there
     (attention backend, block_size, dtype), or why flash-attn cannot run;
  2. `pytest -m gpu`: the tests that run the default path on CUDA against transformers;
  3. the engine on the device against transformers on the same device: float32 token for token,
     bfloat16 close (first tokens equal, 80% of all), through chunked prefill, preemption, more than
     8 decode rows and prefix hits (tests/test_gpu.py's workload);
  4. the flash contract: the engine's flash branch, its arrays on the device in bfloat16, through
     the strict flash-attn reference (tests/flash_reference.py, flash-attn 2.8.3's checks, nothing
     relaxed); and where flash-attn 2 runs, the real kernels, against transformers;
  5. a random ~1B Llama decoding at batch sizes 1, 32, 256 against transformers `generate` on the same
     GPU: tokens/s side by side and the share of equal tokens;
  6. per decode step at batch 32: kernel launches and host syncs (torch.profiler);
  7. peak memory against the budget: the KV cache, the peak allocated, gpu_memory_utilization x total;
  8. CUDA graphs (nanoserve/extensions/cuda_graphs.py), on the same ~1B Llama in bfloat16 with the flash backend
     (flash-attn where installed, else a stand-in a graph can capture: see `graph_safe_flash_attn`):
     decode graphs over the eager model against the eager model, token for token at batch 1, 32 and
     256 (graph sizes, so the same kernels run); tok/s at each, eager against `enforce_eager=False`
     (compiled, with graphs); and host-side kernel launches per decode step of each.
     With --dry-run a graph is not captured (no CUDA): its replay runs the captured function again;
  9. nano-vllm's benchmark shape (`nanoserve bench --workload nanovllm`: 256 requests of 100-1024 tokens in and
     out at temperature 0.6, on a random Qwen3 of Qwen3-0.6B's shape in bfloat16): nanoserve beside transformers'
     continuous batching on the same GPU, output tok/s of each, each stopped after 30 s (a rate over the start
     of the run where it did not finish).
A failing check is a FAIL row (with its error), never the end of the run; the exit status is 1 if any failed.
Each row is printed (and appended to --out) as soon as it is known, and the checks not started within --budget
seconds (230 on a GPU) are SKIP rows, so that a run cut short still reports what it measured.
"""
from __future__ import annotations

import argparse
import gc
import importlib.metadata
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback
import types
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from test_gpu import ENGINE, agreement, hf_generate, run_engine, workload  # noqa: E402

from flash_reference import FlashReference, fake_flash_attn_module  # noqa: E402
from nanoserve import LLM, SamplingParams, attention  # noqa: E402
from nanoserve.attention import attend, gather_blocks, select_attention  # noqa: E402
from nanoserve.benchmarks.throughput import run_hf_continuous, run_nanoserve  # noqa: E402
from nanoserve.benchmarks.workload import WORKLOADS, build_default_model, make_workload  # noqa: E402
from nanoserve.config import cdiv  # noqa: E402
from nanoserve.device import resolve_dtype  # noqa: E402
from nanoserve.extensions import cuda_graphs  # noqa: E402

TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=256, max_position_embeddings=256, initializer_range=0.1)
ONE_B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
             intermediate_size=8192, vocab_size=32000, max_position_embeddings=2048)  # ~1.1B parameters
DRY_ONE_B = dict(TINY, vocab_size=512, max_position_embeddings=512)
Row = tuple[str, str, str]  # check, PASS | FAIL | SKIP | INFO, detail


def build_llama(path: str, device: str, dtype: torch.dtype, **sizes: int) -> str:
    """A random Llama saved to `path`, initialised on `device` (fast for ~1B on a GPU)."""
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(LlamaConfig(bos_token_id=1, eos_token_id=2, **sizes))
    model.to(dtype).save_pretrained(path)
    return path


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def check_environment(device: str) -> list[Row]:
    versions = {name: version(name) for name in ("torch", "transformers", "triton", "flash-attn")}
    rows = [("versions", "INFO", ", ".join(f"{k} {v}" for k, v in versions.items()) + f", CUDA {torch.version.cuda}")]
    dev = torch.device(device)
    if device == "cuda":
        name, capability = torch.cuda.get_device_name(), torch.cuda.get_device_capability(dev)
        rows.append(("GPU", "INFO", f"{name}, compute capability {capability}, "
                                    f"{torch.cuda.mem_get_info()[1] / 2**30:.0f} GiB"))
    dtype = resolve_dtype("auto", dev)
    for head_dim in (64, 128):
        backend, block_size = select_attention("auto", "auto", dev, dtype, head_dim)
        why = attention.why_not_flash(dev, dtype, head_dim)
        rows.append((f"LLM() picks (head_dim {head_dim})", "INFO",
                     f"{backend}, block_size {block_size}, {dtype}" + (f"; no flash: {why}" if why else "")))
    return rows


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def check_pytest_gpu(dry_run: bool) -> list[Row]:
    """The gpu-marked tests (on the CPU, with --dry-run, they are all skipped: the run checks they collect)."""
    command = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-rs",
               str(ROOT / "tests" / ("test_gpu.py" if dry_run else ""))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    summary = (result.stdout.strip().splitlines() or ["no output"])[-1]
    return [("pytest -m gpu", "PASS" if result.returncode == 0 else "FAIL", summary.replace("|", "/"))]


def check_engine(path: str, device: str, max_tokens: int) -> list[Row]:
    rows = []
    for exact in (True, False):
        config = dict(ENGINE, dtype="float32") if exact else dict(ENGINE, num_kvcache_blocks=None)
        llm = LLM(path, device=device, **config)
        ours, reached = run_engine(llm, workload(seed=2), max_tokens)
        used = llm.engine.model_runner.dtype
        theirs = hf_generate(path, workload(seed=2), max_tokens, device, used)
        share = agreement(ours, theirs)
        ok = ours == theirs if exact else [o[0] for o in ours] == [t[0] for t in theirs] and share >= 0.8
        rows.append((f"engine vs transformers, {used}", "PASS" if ok else "FAIL",
                     f"{'token-exact' if exact else 'close'}: {share:.1%} of tokens equal; backend "
                     f"{llm.engine.model_runner.backend}, block_size {llm.engine.block_size}; reached {reached}"))
    return rows


def check_flash_contract(path: str, device: str, max_tokens: int) -> list[Row]:
    """The engine's flash branch with flash-attn replaced by the strict reference (nothing relaxed), then,
    where flash-attn 2 runs, by flash-attn itself."""
    strict, saved = FlashReference(), (sys.modules.get("flash_attn"), attention.why_not_flash)
    sys.modules["flash_attn"] = fake_flash_attn_module(strict)
    attention.why_not_flash = lambda device, dtype, head_dim: None
    try:
        rows = [flash_row("flash branch through the strict reference", path, device, max_tokens, strict.calls)]
    finally:
        sys.modules["flash_attn"], attention.why_not_flash = saved
        if saved[0] is None:
            del sys.modules["flash_attn"]
    why = attention.why_not_flash(torch.device(device), torch.bfloat16, 16)
    if why:
        return rows + [("flash-attn itself", "SKIP", why)]
    return rows + [flash_row("flash-attn itself", path, device, max_tokens, [])]


def flash_row(name: str, path: str, device: str, max_tokens: int, calls: list[dict]) -> Row:
    llm = LLM(path, device=device, dtype="bfloat16", attention_backend="flash", max_num_batched_tokens=32)
    prompts = workload(seed=3)
    ours, _ = run_engine(llm, prompts, max_tokens)
    theirs = hf_generate(path, prompts, max_tokens, device, torch.bfloat16)
    share = agreement(ours, theirs)
    ok = [o[0] for o in ours] == [t[0] for t in theirs] and share >= 0.8
    mixed = sum(1 for c in calls if c["fn"] == "varlen" and 1 in c["q_lens"] and max(c["q_lens"]) > 1)
    seen = f"; {len(calls)} checked calls ({mixed} varlen mixing chunks and decodes)" if calls else ""
    return (name, "PASS" if ok else "FAIL", f"bfloat16 vs transformers: {share:.1%} of tokens equal{seen}")


def check_decoding(path: str, device: str, batch_sizes: list[int], prompt_len: int, max_tokens: int) -> list[Row]:
    """Decoding at each batch size, nanoserve and transformers side by side; then kernels and syncs per
    decode step, and peak memory against the budget."""
    utilization = 0.6  # the rest is left to transformers, which runs in the same process
    llm = LLM(path, device=device, max_model_len=prompt_len + max_tokens, max_num_seqs=max(batch_sizes),
              gpu_memory_utilization=utilization)
    runner, rng, rows = llm.engine.model_runner, random.Random(0), []
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    prompts = {b: [[rng.randrange(3, 500) for _ in range(prompt_len)] for _ in range(b)] for b in batch_sizes}
    ours, seconds = {}, {}
    for b in batch_sizes:
        sync(device)
        start = time.perf_counter()
        ours[b] = [o.outputs[0].token_ids for o in llm.generate(prompts[b], params, use_tqdm=False)]
        sync(device)
        seconds[b] = time.perf_counter() - start
    rows.append(profile_decode(llm, device, prompts[batch_sizes[min(1, len(batch_sizes) - 1)]], max_tokens))
    rows.append(memory_row(llm, device, utilization))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=runner.dtype).to(device).eval()
    for b in batch_sizes:
        ids = torch.tensor(prompts[b], device=device)
        sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                              min_new_tokens=max_tokens, pad_token_id=0)
        sync(device)
        theirs = (out[:, prompt_len:]).tolist()
        ratio = (seconds_hf := time.perf_counter() - start) / seconds[b]
        rows.append((f"decode B={b}, {runner.dtype}", "INFO",
                     f"nanoserve {b * max_tokens / seconds[b]:.0f} tok/s, "
                     f"transformers {b * max_tokens / seconds_hf:.0f}"
                     f" tok/s (nanoserve {ratio:.2f}x); {agreement(ours[b], theirs):.1%} of tokens equal; "
                     f"backend {runner.backend}, block_size {llm.engine.block_size}"))
    return rows


def profile_decode(llm: LLM, device: str, prompts: list[list[int]], max_tokens: int) -> Row:
    """Kernel launches and host syncs per decode step, with every request decoding."""
    events, steps = profile_decode_steps(llm, device, prompts, max_tokens)
    kernels = sum(1 for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    waits = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
    syncs = sum(1 for e in events if e.name in waits)
    reads = sum(1 for e in events if e.name == "aten::_local_scalar_dense")
    return (f"per decode step, B={len(prompts)}", "INFO", f"{kernels / steps:.0f} kernel launches, {syncs / steps:.1f} "
            f"host syncs, {reads / steps:.1f} scalar reads (item/tolist)")


def profile_decode_steps(llm: LLM, device: str, prompts: list[list[int]], max_tokens: int,
                         steps: int = 10) -> tuple[list, int]:
    """The profiler's events over `steps` decode steps with every request of `prompts` decoding, and `steps`."""
    from torch.profiler import ProfilerActivity, profile
    engine = llm.engine
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    while any(seq.num_computed_tokens < seq.num_prompt_tokens for seq in engine.requests.values()):
        engine.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
        sync(device)
    for request_id in list(engine.requests):
        engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return prof.events(), steps


def memory_row(llm: LLM, device: str, utilization: float) -> Row:
    runner = llm.engine.model_runner
    kv = runner.kv_cache.numel() * runner.kv_cache.element_size()
    if device != "cuda":
        return ("peak memory vs KV budget", "SKIP", f"KV cache {kv / 2**20:.0f} MiB; the peak is measured on CUDA only")
    peak, total = torch.cuda.max_memory_allocated(), torch.cuda.mem_get_info()[1]
    ok = peak <= utilization * total
    return ("peak memory vs KV budget", "PASS" if ok else "FAIL",
            f"peak allocated {peak / 2**30:.1f} GiB (KV cache {kv / 2**30:.1f} GiB, {runner.num_blocks} blocks) "
            f"<= gpu_memory_utilization {utilization} x {total / 2**30:.0f} GiB = {utilization * total / 2**30:.1f}")


def graph_safe_flash_attn() -> tuple[types.ModuleType, str]:
    """flash-attn where it is installed; else the strict reference's varlen (prefill steps run outside
    graphs) beside `with_kvcache_on_device`: (the module, which it is)."""
    try:
        import flash_attn
        return flash_attn, f"flash-attn {version('flash-attn')}"
    except ImportError:
        module = fake_flash_attn_module(FlashReference())
        module.flash_attn_with_kvcache = with_kvcache_on_device
        return module, "flash-attn absent: the strict reference's varlen, with_kvcache_on_device"


def with_kvcache_on_device(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                           cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                           softmax_scale=None, causal=False, **unused):
    """flash_attn_with_kvcache as the engine calls it at decode (one query per request, the cache already
    written), in plain torch without a host read, so that a CUDA graph can capture it: every block of
    each row of `block_table`, keys at or past cache_seqlens masked."""
    keys, values = gather_blocks(k_cache, block_table), gather_blocks(v_cache, block_table)  # [B, L, Hkv, D]
    past = torch.arange(keys.shape[1], device=q.device) >= cache_seqlens[:, None]  # [B, L]
    bias = torch.zeros(past.shape, dtype=q.dtype, device=q.device).masked_fill(past, float("-inf"))
    return attend(q, keys, values, softmax_scale, bias[:, None, None])  # q [B, 1, H, D] -> [B, 1, H, D]


def attach_graphs(llm: LLM, device: str) -> None:
    """Capture decode graphs over `llm`'s model as it is (eager). On the CPU (--dry-run) a graph's replay
    runs the captured function again."""
    runner, saved = llm.engine.model_runner, cuda_graphs.capture
    if device == "cpu":
        cuda_graphs.capture = lambda run, pool: (run, None)
    try:
        runner.graphs = cuda_graphs.DecodeGraphs(runner.model, runner.kv_cache, llm.engine.config.max_num_seqs,
                                                 cdiv(llm.engine.max_model_len, runner.block_size))
    finally:
        cuda_graphs.capture = saved


def check_nanovllm_shape(path: str | None, device: str, max_seconds: float = 30) -> list[Row]:
    """nanoserve and transformers' continuous batching on nano-vllm's workload, as `nanoserve bench --workload
    nanovllm` runs them on a GPU (on the CPU, --dry-run: 8 short requests on `path`)."""
    sizes = WORKLOADS["nanovllm-gpu"]
    if path is None:
        path = build_default_model(tempfile.mkdtemp(prefix="gpu_check_"), nanovllm_gpu=True)
    else:
        sizes = dict(sizes, num_requests=8, input_len=(10, 40), output_len=(5, 20))
    dtype = "bfloat16" if device == "cuda" else "float32"
    workload = make_workload(vocab_size=AutoConfig.from_pretrained(path).vocab_size, seed=0, **sizes)
    max_model_len = max(len(r.prompt) + r.output_len for r in workload)
    ours = run_nanoserve(path, workload, "continuous", max_seconds, dtype=dtype, device=device,
                         max_model_len=cdiv(max_model_len, 16) * 16, max_num_seqs=len(workload))
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    theirs = run_hf_continuous(path, workload, dtype, device, max_seconds)
    cut = lambda r: f" ({r.extra['cut']})" if "cut" in r.extra else ""  # noqa: E731
    return [(f"nano-vllm's shape, {dtype}", "INFO",
             f"{len(workload)} requests: nanoserve {ours.output_tok_s:.0f} output tok/s{cut(ours)}, transformers' "
             f"continuous batching {theirs.output_tok_s:.0f}{cut(theirs)} (nanoserve "
             f"{ours.output_tok_s / theirs.output_tok_s:.2f}x)")]


def check_graphs(path: str, device: str, batch_sizes: list[int], prompt_len: int, max_tokens: int) -> list[Row]:
    """The ~1B Llama in bfloat16 with the flash backend, three ways: eager; eager with decode graphs attached
    (token for token the same: the same kernels run); and enforce_eager=False (compiled, with graphs)."""
    module, which = graph_safe_flash_attn()
    saved = sys.modules.get("flash_attn"), attention.why_not_flash
    sys.modules["flash_attn"], attention.why_not_flash = module, lambda device, dtype, head_dim: None
    rng = random.Random(1)
    prompts = {b: [[rng.randrange(3, 500) for _ in range(prompt_len)] for _ in range(b)] for b in batch_sizes}
    middle = prompts[batch_sizes[min(1, len(batch_sizes) - 1)]]
    try:
        runs = {name: decode_with(path, device, name, prompts, max_tokens, middle)
                for name in ("eager", "eager + graphs", "compiled + graphs")}
    finally:
        sys.modules["flash_attn"], attention.why_not_flash = saved
        if saved[0] is None:
            del sys.modules["flash_attn"]
    eager, graphs, compiled = runs["eager"], runs["eager + graphs"], runs["compiled + graphs"]
    rows = [("attention for the graph checks", "INFO", which)]
    for b in batch_sizes:
        rows.append((f"graphs vs eager B={b}", "PASS" if graphs.tokens[b] == eager.tokens[b] else "FAIL",
                     f"{agreement(graphs.tokens[b], eager.tokens[b]):.1%} of tokens equal; tok/s eager "
                     f"{eager.tok_s[b]:.0f}, {compiled.name} {compiled.tok_s[b]:.0f} "
                     f"({compiled.tok_s[b] / eager.tok_s[b]:.2f}x; {agreement(compiled.tokens[b], eager.tokens[b]):.1%}"
                     f" of its tokens equal)"))
    launches = f"eager {eager.launches:.0f}, with graphs {graphs.launches:.0f}, {compiled.name} {compiled.launches:.0f}"
    return rows + [(f"launches per decode step, B={len(middle)}", "INFO", f"{launches} (kernels and graphs)")]


@dataclass
class GraphRun:
    name: str
    tokens: dict[int, list[list[int]]]
    tok_s: dict[int, float]
    launches: float


def decode_with(path: str, device: str, name: str, prompts: dict[int, list[list[int]]], max_tokens: int,
                profiled: list[list[int]]) -> GraphRun:
    """Greedy decoding of each batch of `prompts` by an engine run `name`'s way, then launches per step."""
    compiled = name == "compiled + graphs" and device == "cuda"  # on the CPU compiling is the test suite's job
    llm = LLM(path, device=device, dtype="bfloat16", attention_backend="flash", max_num_seqs=max(prompts),
              max_model_len=len(profiled[0]) + max_tokens, gpu_memory_utilization=0.3, enforce_eager=not compiled)
    if name != "eager" and llm.engine.model_runner.graphs is None:
        attach_graphs(llm, device)
    # what actually ran: a compile that fell back to eager says so in the table
    label = f"{'compiled' if llm.engine.model_runner.compiled else 'eager'} + graphs" if name != "eager" else name
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    tokens, tok_s = {}, {}
    for b, batch in prompts.items():
        sync(device)
        start = time.perf_counter()
        tokens[b] = [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
        sync(device)
        tok_s[b] = b * max_tokens / (time.perf_counter() - start)
    run = GraphRun(label, tokens, tok_s, count_launches(llm, device, profiled, max_tokens))
    del llm
    if device == "cuda":
        torch.cuda.empty_cache()
    return run


def count_launches(llm: LLM, device: str, prompts: list[list[int]], max_tokens: int) -> float:
    """Host-side launches per decode step, kernels and graphs, with every request decoding."""
    events, steps = profile_decode_steps(llm, device, prompts, max_tokens)
    launches = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")
    return sum(1 for e in events if e.name in launches) / steps


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="the same checks on the CPU with tiny sizes")
    parser.add_argument("--out", help="also write the table to this file, row by row")
    parser.add_argument("--budget", type=float, help="seconds (default 230 on a GPU, none with --dry-run): "
                                                       "checks not started by then are SKIP rows")
    args = parser.parse_args()
    device = "cpu" if args.dry_run else "cuda"
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("no CUDA device here: run with --dry-run to check the script on the CPU")
    folder = tempfile.mkdtemp(prefix="gpu_check_")
    tiny = build_llama(f"{folder}/tiny", device, torch.float32, **TINY)
    big = build_llama(f"{folder}/big", device, torch.bfloat16, **(DRY_ONE_B if args.dry_run else ONE_B))
    decode = ([1, 4, 8], 16, 8) if args.dry_run else ([1, 32, 256], 128, 128)
    max_tokens = 6 if args.dry_run else 16  # per request of the tiny model's workload
    checks = [("environment", lambda: check_environment(device)),
              ("pytest -m gpu", lambda: check_pytest_gpu(args.dry_run)),
              ("engine vs transformers", lambda: check_engine(tiny, device, max_tokens)),
              ("flash contract", lambda: check_flash_contract(tiny, device, max_tokens)),
              ("decoding", lambda: check_decoding(big, device, *decode)),
              ("nano-vllm's shape", lambda: check_nanovllm_shape(big if args.dry_run else None, device)),
              ("CUDA graphs", lambda: check_graphs(big, device, *decode))]
    header = f"{'Dry run on the CPU' if args.dry_run else 'On ' + torch.cuda.get_device_name()}:\n\n" \
             "| check | result | detail |\n|---|---|---|\n"
    emit(header, args.out, mode="w")
    rows: list[Row] = []
    budget = args.budget if args.budget is not None else float("inf") if args.dry_run else 230
    deadline = time.perf_counter() + budget
    for name, check in checks:
        start = time.perf_counter()
        if start > deadline:  # a run cut short still says what it skipped
            new = [(name, "SKIP", f"out of time: the run's budget of {budget:.0f} s was spent")]
        else:
            try:
                new = check()
            except Exception as error:  # one failed check is a row, the others still run
                traceback.print_exc()
                new = [(name, "FAIL", f"{type(error).__name__}: {error}".replace("\n", " ")[:300])]
        rows += new
        emit("".join(f"| {c} | {r} | {d} |\n" for c, r, d in new), args.out)  # each row as soon as it is known
        print(f"{name}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    return 1 if any(r == "FAIL" for _, r, _ in rows) else 0


def emit(text: str, out: str | None, mode: str = "a") -> None:
    """Print `text` now, and append it to `out` too: a run cut short keeps every row it had."""
    print(text, end="", flush=True)
    if out:
        with open(out, mode) as f:
            f.write(text)

if __name__ == "__main__":
    sys.exit(main())
