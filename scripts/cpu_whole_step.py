"""The compiled step against the eager one on a CPU, each engine in a fresh process, as users run it:

    python scripts/cpu_whole_step.py MODEL_FOLDER [--dtypes float32,bfloat16] [--requests 1,48]
        [--modes eager,compiled] [--prompt 96] [--tokens 32] [--blocks N]

eager: `LLM(MODEL, enforce_eager=True)`; compiled: `enforce_eager=False`, the whole step as one graph
(nanoserve/extensions/compilation.py). Printed per run: start-up (load + compile + warm-up) seconds,
prefill seconds, decode ms per step ((time for `--tokens` - time for 1) / (tokens - 1), best of 2),
decode tok/s, the ratio to eager, and the first greedy tokens, which must equal eager's. Run again with
`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2` for an AVX2 CPU.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch


def run_one(args) -> dict:
    from nanoserve import LLM, SamplingParams
    start = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, enforce_eager=args.mode == "eager", max_num_seqs=args.requests,
              max_model_len=args.prompt + args.tokens + 8, num_kvcache_blocks=args.blocks)
    vocab = llm.engine.vocab_size
    prompts = [[(7 * i + 13 * j) % (vocab - 10) + 5 for j in range(args.prompt)] for i in range(args.requests)]

    def generate(tokens):
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        t = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t, outputs
    generate(2)  # warm-up: compiles N >= 2 and N = 1
    startup = time.perf_counter() - start
    prefill = min(generate(1)[0] for _ in range(2))
    full, outputs = min((generate(args.tokens) for _ in range(2)), key=lambda r: r[0])
    step_ms = 1000 * (full - prefill) / (args.tokens - 1)
    return dict(startup_s=round(startup, 1), prefill_s=round(prefill, 3), decode_ms=round(step_ms, 2),
                decode_tok_s=round(1000 * args.requests / step_ms, 1), first=outputs[0].outputs[0].token_ids[:6])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--requests", default="1,48")
    parser.add_argument("--modes", default="eager,compiled")
    parser.add_argument("--prompt", type=int, default=96)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=None, help="num_kvcache_blocks (default: from free memory)")
    parser.add_argument("--one", nargs=3, metavar=("DTYPE", "REQUESTS", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        args.dtype, args.requests, args.mode = args.one[0], int(args.one[1]), args.one[2]
        print(json.dumps(run_one(args)))
        return
    from nanoserve.benchmarks.roofline import describe_cpu
    print(f"{describe_cpu()}; torch {torch.__version__}; prompt {args.prompt}, {args.tokens} tokens out")
    print("| dtype | requests | mode | start-up s | prefill s | decode ms/step | decode tok/s | vs eager "
          "| first tokens |")
    print("|---|---|---|---|---|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        for requests in args.requests.split(","):
            eager_ms = None
            for mode in args.modes.split(","):
                command = [sys.executable, __file__, args.model, "--prompt", str(args.prompt), "--tokens",
                           str(args.tokens), "--one", dtype, requests, mode]
                done = subprocess.run(command, capture_output=True, text=True)
                if done.returncode:
                    print(f"| {dtype} | {requests} | {mode} | failed: {done.stderr.strip().splitlines()[-1]} |")
                    continue
                r = json.loads(done.stdout.strip().splitlines()[-1])
                eager_ms = eager_ms or (r["decode_ms"] if mode == "eager" else None)
                ratio = f"{eager_ms / r['decode_ms']:.2f}x" if eager_ms else ""
                print(f"| {dtype} | {requests} | {mode} | {r['startup_s']} | {r['prefill_s']} | {r['decode_ms']} | "
                      f"{r['decode_tok_s']} | {ratio} | {r['first']} |", flush=True)


if __name__ == "__main__":
    main()
