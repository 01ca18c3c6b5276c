"""Benchmark: nanoserve (continuous and static) vs transformers (static generate and continuous
batching). They run side by side in one process, on one workload. Ratios, not absolute numbers, are
the point: every engine runs on the same machine in the same run.

    python -m nanoserve.bench                       # the default ~40M-parameter random Llama, 48 requests
    python -m nanoserve.bench --dtype bfloat16      # every engine in bfloat16
    python -m nanoserve.bench --engines nanoserve,static --num-requests 16
    python -m nanoserve.bench --online --rates 2,4,8     # Poisson arrivals: TTFT, TPOT and goodput vs request rate
    python -m nanoserve.bench --workload nanovllm        # nano-vllm's bench.py, scaled to a CPU; its own shape on a GPU
    python -m nanoserve.bench --workload shared-prefix   # 32 requests, one 256-token system prompt, all at once
    python -m nanoserve.bench --profile-decode 48        # where one decode step of 48 requests spends its time
    python -m nanoserve.bench --server http://127.0.0.1:8000 --rates 2,4,8   # the same load over HTTP + SSE
    python -m nanoserve.bench --llama-cpp llama-batched-bench --gguf model.gguf --model HF_FOLDER  # vs llama.cpp
    python -m nanoserve.bench --llama-cpp ... --gguf model-q8_0.gguf --quantization int8 --dtype bfloat16  # vs Q8_0
    python -m nanoserve.bench --llama-cpp ... --gguf model-q4_0.gguf --quantization int4 --dtype bfloat16  # vs Q4_0
    python -m nanoserve.bench --busy-neighbour      # the same, beside one busy Python process at nice 10
    python -m nanoserve.bench --no-enforce-eager    # nanoserve compiled (torch.compile), not op by op
"""
from __future__ import annotations

import argparse
import atexit
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict

import torch

from nanoserve.benchmarks.http_client import run_http
from nanoserve.benchmarks.llama_cpp import compare_llama_cpp
from nanoserve.benchmarks.online import online_report, parse_slo, run_online
from nanoserve.benchmarks.profile import profile_decode
from nanoserve.benchmarks.roofline import ModelShape, describe_cpu, measure_machine
from nanoserve.benchmarks.throughput import (
    ENGINES,
    compare_prefix_caching,
    compare_tensor_parallel,
    nanovllm_table,
    report,
    run_hf_continuous,
    run_hf_generate,
    run_nanoserve,
)
from nanoserve.benchmarks.workload import WORKLOADS, build_default_model, make_workload, whole_blocks
from nanoserve.entrypoints.utils import OneLineParser


def make_parser(prog: str = "python -m nanoserve.bench") -> argparse.ArgumentParser:
    p = OneLineParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="a Llama checkpoint folder (default: a random ~40M Llama, built once)")
    p.add_argument("--num-requests", type=int, help="default: 48, or the --workload's own number")
    p.add_argument("--input-len", default="16-256", help="prompt lengths, MIN-MAX")
    p.add_argument("--output-len", default="16-192", help="output lengths, MIN-MAX")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated, from {ENGINES}")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--kv-cache-tokens", type=int,
                   help="nanoserve's KV cache size for both schedulers: the memory a static batch must reserve "
                        "(default 8192; with --workload nanovllm on a GPU, what gpu_memory_utilization leaves)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"),
                   help="every engine's dtype (default float32; bfloat16 with --workload nanovllm on a GPU)")
    p.add_argument("--max-seconds", type=float,
                   help="stop transformers' continuous batching (hf-cb) after this long and report its rate so far "
                        "(default 60 with --workload nanovllm on a GPU, where a whole run takes it half an hour)")
    p.add_argument("--quantization", choices=("int8", "int4"),
                   help="nanoserve's weights int8, a scale per output channel, or int4, a scale and a zero per "
                        "32 inputs (docs/quantization.md); with --llama-cpp, set int8 beside a Q8_0 --gguf and "
                        "int4 beside a Q4_0 one")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                   help="nanoserve op by op (the default), or compiled with --no-enforce-eager")
    p.add_argument("--busy-neighbour", action="store_true",
                   help="run every engine beside one busy Python process at nice 10 (a laptop's other work)")
    p.add_argument("--device", help="every engine's and the roofline's device (default: cuda if present, else cpu)")
    p.add_argument("--json", help="also write the results to this JSON file")
    p.add_argument("--speculative-config", type=json.loads, help="nanoserve's, as vLLM's: JSON, e.g. "
                   "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' (docs/speculative-decoding.md)")
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
                        "to a CPU: 64 requests of 13-128 tokens; on a GPU its own shape on a random Qwen3 of "
                        "Qwen3-0.6B's shape in bfloat16, beside transformers' continuous batching. shared-prefix: "
                        "32 requests, one 256-token system prompt plus 16-64 tokens each, outputs of 16-64, prefix "
                        "caching on and off")
    p.add_argument("--api-key", help="with --server: sent as a Bearer token")
    return p


def main(argv: list[str] | None = None, prog: str = "python -m nanoserve.bench") -> None:
    """Run the benchmark `argv` asks for (default: the command line's arguments) and print its tables."""
    args = make_parser(prog).parse_args(argv)
    span = lambda s: tuple(int(x) for x in s.split("-"))  # noqa: E731
    if args.server:
        # The server's vocab size is not in /v1/models: ids below 1000 are valid for any Llama vocab
        workload = make_workload(args.num_requests or 48, span(args.input_len), span(args.output_len), 1000, args.seed)
        print(run_http(args.server, workload, [float(r) for r in args.rates.split(",")], args.seed, args.api_key))
        return
    torch.manual_seed(args.seed)
    if args.busy_neighbour:  # by its weight at nice 10 it should take ~5% of two cores; killed when we exit
        neighbour = subprocess.Popen([sys.executable, "-c", "import os; os.nice(10)\nwhile True: pass"])
        atexit.register(neighbour.kill)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(describe_cpu())
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    # nano-vllm's own shape where a GPU runs it: its 256 requests of 100-1024 tokens, on its model's shape
    nanovllm_gpu = args.workload == "nanovllm" and device == "cuda"
    if nanovllm_gpu:
        args.workload = "nanovllm-gpu"
        args.dtype = args.dtype or "bfloat16"
        args.max_seconds = args.max_seconds or 60
        if args.engines == ",".join(ENGINES):
            args.engines = "nanoserve,hf-cb"
    args.dtype = args.dtype or "float32"
    path = args.model or build_default_model(os.path.join(tempfile.gettempdir(), "nanoserve-bench"), nanovllm_gpu)
    from transformers import AutoConfig
    vocab = AutoConfig.from_pretrained(path).vocab_size
    if args.llama_cpp:
        if not args.gguf:
            raise SystemExit("--llama-cpp needs --gguf, the same model in GGUF")
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads (every engine), {args.dtype}; "
              f"{args.prompt_len} prompt + {args.gen_len} generated tokens per request; llama.cpp runs "
              f"{os.path.basename(args.gguf)}, nanoserve quantization={args.quantization}, "
              f"{'compiled' if args.enforce_eager is False else 'eager'}")
        print(compare_llama_cpp(args.llama_cpp, args.gguf, path, [int(b) for b in args.batch_sizes.split(",")],
                                args.prompt_len, args.gen_len, args.dtype, vocab, args.seed, not args.no_transformers,
                                args.enforce_eager is not False, args.quantization))
        return
    sizes = WORKLOADS.get(args.workload, dict(num_requests=48, input_len=span(args.input_len),
                                               output_len=span(args.output_len)))
    workload = make_workload(vocab_size=vocab, seed=args.seed,
                             **{**sizes, "num_requests": args.num_requests or sizes["num_requests"]})
    kv_cache_tokens = args.kv_cache_tokens or (None if nanovllm_gpu else 8192)
    config = dict(block_size=args.block_size, max_num_seqs=args.max_num_seqs,
                  num_kvcache_blocks=kv_cache_tokens and kv_cache_tokens // args.block_size + 1,  # + the null block
                  max_model_len=whole_blocks(max(len(r.prompt) + r.output_len for r in workload), args.block_size),
                  dtype=args.dtype, device=device)
    if args.enforce_eager is not None:  # else LLM's default (eager)
        config["enforce_eager"] = args.enforce_eager
    if args.speculative_config:
        config["speculative_config"] = args.speculative_config
    if args.quantization:
        config["quantization"] = args.quantization
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
    if args.workload == "nanovllm" and args.engines == ",".join(ENGINES):  # on a CPU
        args.engines = "nanoserve,static"  # transformers' engines here are greedy, not at temperature 0.6
    runners = {"nanoserve": lambda: run_nanoserve(path, workload, "continuous", **config),
               "static": lambda: run_nanoserve(path, workload, "static", **config),
               "hf-generate": lambda: run_hf_generate(path, workload, args.dtype, config["device"]),
               "hf-cb": lambda: run_hf_continuous(path, workload, args.dtype, config["device"], args.max_seconds)}
    results = []
    for name in args.engines.split(","):
        if name not in runners:
            raise SystemExit(f"unknown engine {name!r}; choose from {ENGINES}")
        results.append(runners[name]())
        print(f"{name}: {results[-1].seconds:.2f} s", flush=True)
    print(report(results, machine, shape))
    if args.workload.startswith("nanovllm"):
        print(nanovllm_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"dtype": args.dtype, "machine": asdict(machine), "results": [asdict(r) for r in results]}, f)
