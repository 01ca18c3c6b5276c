"""One group of weights before and after int4 quantization (Int4Linear, nanoserve/extensions/quantization.py).

    python scripts/int4_group.py SMOLLM2_FOLDER [--tensor model.layers.0.self_attn.q_proj.weight] [--show 8]

Takes the first 32 weights of the tensor's row 0, one group (bfloat16, as `dtype="bfloat16"` loads them).
Prints, as markdown for docs/quantization.md: the group's range, scale and zero, and for its first `--show`
weights their q and the dequantized value the int4 kernel multiplies by.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from nanoserve.extensions.quantization import Int4Linear


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--tensor", default="model.layers.0.self_attn.q_proj.weight")
    parser.add_argument("--show", type=int, default=8)
    args = parser.parse_args()
    with safe_open(str(Path(args.model) / "model.safetensors"), "pt") as f:
        w = f.get_tensor(args.tensor)[0, :32].to(torch.bfloat16)  # [32]
    # 16 copies of the row, since the kernel takes outputs in multiples of 16
    linear = nn.Linear(32, 16, bias=False, dtype=torch.bfloat16)
    linear.weight = nn.Parameter(w.expand(16, -1).contiguous(), requires_grad=False)
    layer = Int4Linear(linear, 32)
    scale, zero = layer.scale_and_zero[0, 0].float().tolist()
    back = layer.dequantize()[0]  # [count]
    q = torch.round((back - zero) / scale) + 8
    print(f"{args.tensor}, row 0, weights 0-31: min {w.min():.5f}, max {w.max():.5f}, scale {scale:.6g}, "
          f"zero {zero:.6g}; mean |error| {(back - w.float()).abs().mean():.5f}\n")
    print("| weight w | q | (q - 8) * scale + zero | error |\n|---|---|---|---|")
    for wi, qi, bi in list(zip(w.float().tolist(), q.int().tolist(), back.tolist()))[:args.show]:
        print(f"| {wi:+.5f} | {qi} | {bi:+.5f} | {bi - wi:+.5f} |")


if __name__ == "__main__":
    main()
