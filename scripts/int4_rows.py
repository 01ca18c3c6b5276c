"""How the int4 kernel's time grows with rows, against a bfloat16 matmul, on SmolLM2-135M's shapes.

    python scripts/int4_rows.py [--group-size 32] [--repeats 5]

Random weights of each linear shape of SmolLM2-135M (q/o_proj 576x576, gate/up 1536x576, down 576x1536,
lm_head 49152x576). Each is timed at 1, 8, 48, 128 and 512 rows of bfloat16 activations, in one process:
a plain bfloat16 `F.linear`, and `Int4Linear` (torch's `_weight_int4pack_mm_for_cpu`). Best of `--repeats`,
in ms. Printed as markdown for docs/quantization.md.
"""
from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from nanoserve.benchmarks.roofline import describe_cpu
from nanoserve.extensions.quantization import Int4Linear

SHAPES = {"576x576": (576, 576), "1536x576": (1536, 576), "576x1536": (576, 1536), "49152x576": (49152, 576)}
ROWS = (1, 8, 48, 128, 512)


def best_ms(fn, x: torch.Tensor, repeats: int) -> float:
    """The fastest of `repeats` calls of fn(x), after one warm-up call, in ms."""
    fn(x)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(x)
        times.append(time.perf_counter() - start)
    return 1000 * min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--group-size", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(describe_cpu())
    print("| shape [out x in] | engine | " + " | ".join(f"{m} rows" for m in ROWS) + " |")
    print("|---" * (len(ROWS) + 2) + "|")
    torch.manual_seed(0)
    with torch.no_grad():
        for name, (out_features, in_features) in SHAPES.items():
            linear = nn.Linear(in_features, out_features, bias=False).to(torch.bfloat16)
            int4 = Int4Linear(linear, args.group_size)
            for engine, fn in (("bfloat16 F.linear", linear), (f"int4, groups of {args.group_size}", int4)):
                cells = [best_ms(fn, torch.randn(m, in_features, dtype=torch.bfloat16), args.repeats) for m in ROWS]
                print(f"| {name} | {engine} | " + " | ".join(f"{c:.2f}" for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
