"""SmolLM2's 210 decoder linears at one row, in each dtype and each lowering, in one process, in turns:

    python scripts/linear_lowerings.py SMOLLM2_FOLDER [--dtypes float32,bfloat16,int8]
        [--modes eager,freezing,autotune] [--rounds 5]

The linears alone (30 layers of q, k, v, o, gate, up and down projections; no lm_head, nothing between
them), each applied to one random row, as a decode step of one request applies them:
- eager: `F.linear` (float32, bfloat16) or `_weight_int8pack_mm` with bfloat16 rows (int8: nanoserve's
  Int8Linear, one scale per output channel);
- freezing: `torch.compile(..., options={"freezing": True})`: inductor folds the weights into the graph
  as constants and prepacks them for oneDNN itself;
- autotune: freezing plus `max_autotune` over inductor's C++ GEMM templates and aten
  (`max_autotune_gemm_backends="CPP,ATEN"`), which generate micro-kernels for this CPU.
The options are set around the first call (`torch._inductor.config.patch`), where dynamo traces and
reads `freezing` (passed as `torch.compile(options=...)` they would freeze nothing), and restored after.
Printed: the compile time of each, and the median over `--rounds` turns of each one's median time (ms)
for all 210 linears. Run it again
with `ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2` for an AVX2 CPU.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from safetensors.torch import load_file
from torch import nn

from nanoserve.benchmarks.roofline import describe_cpu
from nanoserve.extensions.quantization import Int8Linear

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
MODES = {"eager": None, "freezing": {"freezing": True},
         "autotune": {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN"}}


class Linears(nn.Module):
    """Every decoder linear of the checkpoint, each applied to the one row of its input width."""

    def __init__(self, path: str, dtype: str):
        super().__init__()
        weights = load_file(f"{path}/model.safetensors")
        float_dtype = torch.float32 if dtype == "float32" else torch.bfloat16
        layers = []
        for name in sorted(k for k in weights if k.endswith(tuple(p + ".weight" for p in PROJECTIONS))):
            linear = nn.Linear(*reversed(weights[name].shape), bias=False, dtype=float_dtype)
            linear.weight = nn.Parameter(weights[name].to(float_dtype), requires_grad=False)
            layers.append(Int8Linear(linear) if dtype == "int8" else linear)
        self.linears = nn.ModuleList(layers)

    def forward(self, rows: dict[int, torch.Tensor]) -> list[torch.Tensor]:
        return [linear(rows[linear.weight_int8.shape[1] if isinstance(linear, Int8Linear) else linear.in_features])
                for linear in self.linears]


def time_ms(fn, rows: dict[int, torch.Tensor], repeats: int = 20) -> float:
    """The median of `repeats` calls, in ms."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(rows)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--dtypes", default="float32,bfloat16,int8")
    parser.add_argument("--modes", default="eager,freezing,autotune")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    print(describe_cpu())
    runs = {}
    with torch.inference_mode():
        for dtype in args.dtypes.split(","):
            module = Linears(args.model, dtype).eval()
            print(f"{dtype}: {len(module.linears)} linears")
            rows = {width: torch.randn(1, width, dtype=torch.float32 if dtype == "float32" else torch.bfloat16)
                    for width in (576, 1536)}
            for mode in args.modes.split(","):
                fn = module if MODES[mode] is None else torch.compile(module)
                start = time.perf_counter()
                with torch._inductor.config.patch(MODES[mode] or {}):  # as dynamo traces: it reads freezing then
                    fn(rows)
                print(f"  {mode}: first call (compile) {time.perf_counter() - start:.1f} s", flush=True)
                runs[dtype, mode] = fn, rows, []
    for _ in range(args.rounds):
        for fn, rows, times in runs.values():
            times.append(time_ms(fn, rows))
    print("| dtype | " + " | ".join(args.modes.split(",")) + " |")
    print("|---" * (1 + len(args.modes.split(","))) + "|")
    for dtype in args.dtypes.split(","):
        cells = [f"{statistics.median(runs[dtype, mode][2]):.1f} ms" for mode in args.modes.split(",")]
        print(f"| {dtype} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
