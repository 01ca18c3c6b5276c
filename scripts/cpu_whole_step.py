"""The whole step compiled on a CPU, measured beside nanoserve's eager step, each in a fresh process:

    python scripts/cpu_whole_step.py MODEL_FOLDER [--dtypes float32,bfloat16] [--requests 1,48]
        [--modes eager,plain,whole,autotune] [--prompt 96] [--tokens 32]

Modes (a prototype for the compiled step issue 50 asks for; nothing here is in the engine):
- eager: `LLM(MODEL, enforce_eager=True)` as users run it (layers/linear.py's layouts: column-major or
  oneDNN-packed weights);
- plain: the same eager step on plain `nn.Linear` weights (what inductor starts from);
- whole: embeddings to logits as ONE graph, `torch.compile(dynamic=True)` with freezing, so inductor
  folds the weights in as constants and prepacks them itself; attention enters the graph as one opaque
  custom op per layer (`proto::paged_attention`), which runs attention.py's torch backend;
- autotune: whole, plus `max_autotune` over inductor's C++ GEMM templates and aten.

Two things the prototype found, which the engine's version must respect:
- The op takes the WHOLE KV cache and the layer's index, and slices `kv_cache[0, layer]` inside. An op
  that declares it mutates `k_cache`, `v_cache` given as views of a graph input (`kv_cache[0, i]`, as the
  eager layers pass them) came out of inductor with wrong logits (torch 2.13, CPU): the writes into the
  views were lost between layers.
- The torch backend's plan (which requests attend together) costs ~0.2 ms to build: built in every
  layer it would cost ~6 ms a step on SmolLM2 (30 layers). The prototype builds it once per step,
  outside the graph, and the op reads it from a module-level slot: fine for a measurement, not for the
  engine (which would pass it as tensors the op can read; see docs/performance.md).

Printed per run: start-up (load + compile + warm-up) seconds, prefill seconds, decode ms per step
((time for `--tokens` - time for 1) / (tokens - 1), best of 2), decode tok/s, and the first greedy
tokens, which must equal eager's. Run again with `ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
MKL_ENABLE_INSTRUCTIONS=AVX2` for an AVX2 CPU.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

PLAN = {}  # the step's attention plan, set once per step (the prototype's shortcut, see above)


@torch.library.custom_op("proto::paged_attention", mutates_args=("kv_cache",))
def paged_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                       scale: float) -> torch.Tensor:
    """q `[N, H, D]`, k, v `[N, Hkv, D]` -> `[N, H, D]`: the torch backend's store and attention for one layer."""
    from nanoserve.attention import paged_attention, store_kvcache
    plan = PLAN["plan"]
    store_kvcache(k, v, kv_cache[0, layer], kv_cache[1, layer], plan.slot_mapping)
    return paged_attention(q, kv_cache[0, layer], kv_cache[1, layer], plan, scale).contiguous()


@paged_attention_op.register_fake
def _(q, k, v, kv_cache, layer, scale):
    return q.new_empty(q.shape)


def compile_whole_step(llm, autotune: bool) -> None:
    """Replace the model's forward with one compiled graph from token ids to logits."""
    from nanoserve.models.llama import embed
    model = llm.engine.model_runner.model
    inner, backend = model.model, model.model.attention
    options = {"freezing": True}
    if autotune:
        options.update(max_autotune=True, max_autotune_gemm_backends="CPP,ATEN")

    def step(input_ids, positions, logits_indices, kv_cache):
        x = embed(input_ids, inner.embed_tokens.weight, inner.shard)  # [N, hidden]
        cos, sin = inner.rotary(positions, x.dtype)
        for i, layer in enumerate(inner.layers):
            # each layer's attention: the op on the whole cache and this layer's index
            backend.forward = (lambda i: lambda q, k, v, k_cache, v_cache, metadata: torch.ops.proto.paged_attention(
                q, k, v, kv_cache, i, backend.scale))(i)
            x = layer(x, cos, sin, None, None, None)
        return model.lm_head(inner.norm(x[logits_indices])).float()

    compiled = torch.compile(step, dynamic=True, options=options)

    def forward(batch, kv_cache):
        PLAN["plan"] = backend.prepare(batch, kv_cache.shape[3], kv_cache.dtype)
        return compiled(batch.input_ids, batch.positions, batch.logits_indices, kv_cache)
    model.forward = forward


def run_one(args) -> dict:
    from nanoserve import LLM, SamplingParams
    import nanoserve.models.loader as loader
    if args.mode != "eager":  # nn.Linear everywhere: eager's reference, and what inductor packs itself
        loader.pack_linears = lambda model, max_num_seqs: model
    start = time.perf_counter()
    llm = LLM(args.model, dtype=args.dtype, enforce_eager=True, max_num_seqs=args.requests,
              max_model_len=args.prompt + args.tokens + 8, num_kvcache_blocks=args.blocks)
    vocab = llm.engine.vocab_size
    prompts = [[(7 * i + 13 * j) % (vocab - 10) + 5 for j in range(args.prompt)] for i in range(args.requests)]
    if args.mode in ("whole", "autotune"):
        compile_whole_step(llm, args.mode == "autotune")

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
    parser.add_argument("--modes", default="eager,plain,whole,autotune")
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
    print(f"CPU: {describe_cpu()}; torch {torch.__version__}; prompt {args.prompt}, {args.tokens} tokens out")
    print("| dtype | requests | mode | start-up s | prefill s | decode ms/step | decode tok/s | vs eager | first tokens |")
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
