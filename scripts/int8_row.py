"""One weight row before and after int8 quantization (nanoserve/extensions/quantization.py), and why the scale
is per row.

    python scripts/int8_row.py SMOLLM2_FOLDER [--tensor model.layers.0.self_attn.q_proj.weight] [--row 0]

Prints, as markdown for docs/quantization.md: the row's scale, its first weights with their int8 values
and what those dequantize to; a text picture of the row's values on the int8 grid; and, over every
linear weight of the checkpoint, the quantization error with a scale per row against one scale per
matrix.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from nanoserve.extensions.quantization import Int8Linear
from nanoserve.models.loader import index_checkpoint


def quantize(weight: torch.Tensor) -> Int8Linear:
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return Int8Linear(linear)


def strip(values: torch.Tensor, lo: float, hi: float, width: int = 72) -> str:
    """A row of `width` cells from lo to hi: how many values fall in each, as ' .:-=+*#%@' (none to most)."""
    counts = torch.histc(values, bins=width, min=lo, max=hi)
    marks = " .:-=+*#%@"
    return "".join(marks[min(len(marks) - 1, int(c) if c < 4 else 4 + int(c.log2()))] for c in counts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--tensor", default="model.layers.0.self_attn.q_proj.weight")
    parser.add_argument("--row", type=int, default=0)
    args = parser.parse_args()
    files = index_checkpoint(Path(args.model))
    with safe_open(files[args.tensor], framework="pt") as f:
        weight = f.get_tensor(args.tensor).float()  # [out, in]
    layer = quantize(weight)
    row, q, dequantized = weight[args.row], layer.weight_int8[args.row], layer.dequantize()[args.row]
    scale = float(layer.scale[args.row])
    print(f"{args.tensor} {list(weight.shape)}, row {args.row}: max |w| = {row.abs().max():.4f}, "
          f"scale = max |w| / 127 = {scale:.6f}\n")
    print("| i | w | q = round(w / scale) | q * scale | error |\n|---|---|---|---|---|")
    for i in range(8):
        print(f"| {i} | {row[i]:+.5f} | {int(q[i]):+d} | {dequantized[i]:+.5f} | {dequantized[i] - row[i]:+.5f} |")
    print(f"\nlargest error in the row: {(dequantized - row).abs().max():.6f} (half a step: {scale / 2:.6f})\n")
    lo, hi = -float(row.abs().max()), float(row.abs().max())
    print("```\nthe row's 576 weights from -max|w| to +max|w|, 72 cells (' .:-=+*#%@': none to most):")
    print(f"before |{strip(row, lo, hi)}|\nafter  |{strip(dequantized, lo, hi)}|")
    print(f"the int8 grid: 255 levels {scale:.5f} apart, ~3.5 per cell\n```\n")
    print("| scales | rms error / rms weight, every linear | worst matrix |\n|---|---|---|")
    names = [n for n in files if n.endswith("proj.weight")] + ["model.embed_tokens.weight"]  # tied lm_head
    for per_row in (True, False):
        errors, norms, worst = 0.0, 0.0, 0.0
        for name in names:
            with safe_open(files[name], framework="pt") as f:
                w = f.get_tensor(name).float()
            scale = w.abs().amax(dim=1, keepdim=True) if per_row else w.abs().max()
            error = (torch.round(w / (scale / 127)) * (scale / 127) - w).pow(2).sum()
            errors, norms = errors + float(error), norms + float(w.pow(2).sum())
            worst = max(worst, float((error / w.pow(2).sum()).sqrt()))
        label = "one per row (output channel)" if per_row else "one per matrix"
        print(f"| {label} | {100 * (errors / norms) ** 0.5:.3f}% | {100 * worst:.3f}% |")


if __name__ == "__main__":
    main()
