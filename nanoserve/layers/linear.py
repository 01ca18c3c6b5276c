"""Linear layers (y = x @ W.T, no bias in Llama): how each weight is stored and multiplied on this
device. `pack_linears` is the one place that choice is made; the model is built from plain
`nn.Linear`s, the reference formulation every other choice must equal.

Why the choice matters on a CPU: a decode step multiplies a few rows of activations by every weight
matrix, and how fast the GEMM library does that depends on the weight's memory layout (measured
figures: README, "Where a decode step's time goes").
"""
from __future__ import annotations

import torch
from torch import nn


def column_major(weight: torch.Tensor) -> torch.Tensor:
    """The same `[out, in]` weight, laid out as `[in, out]` in memory (strides (1, out)): on CPU in
    float32, `x @ weight.T` is then MKL's plain (not transposed) GEMM, faster at decode sizes."""
    return weight.t().contiguous().t()


class PackedLinear(nn.Module):
    """nn.Linear without bias, its weight laid out once in oneDNN's own blocked format: the same
    products bit for bit, faster in bfloat16 on CPU. The packed weight is opaque (only this reads
    it) and a copy: a tied lm_head keeps the embedding matrix and gets its own packed one."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())  # [out, in]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, None, "none", [], "")


def has_onednn_bf16() -> bool:
    """oneDNN's bfloat16 kernels need AVX512 (or AVX-NE-CONVERT) on x86: elsewhere, nn.Linear."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack_linears(model: nn.Module) -> nn.Module:
    """Give every bias-free nn.Linear of a loaded model the implementation this device runs fastest:
      * CPU, float32: nn.Linear with a `column_major` weight (MKL's GEMM);
      * CPU, bfloat16, where oneDNN has bf16 kernels: a PackedLinear;
      * anywhere else (CUDA, other dtypes): nn.Linear as loaded.
    A float32 weight tied to the embedding stays row-major: a column-major copy would be a second
    vocab x hidden matrix, and the embedding's row lookups want rows."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or module.bias is not None or module.weight.device.type != "cpu":
            continue
        if module.weight.dtype == torch.float32 and id(module.weight) not in embeddings:
            module.weight = nn.Parameter(column_major(module.weight), requires_grad=False)
        elif module.weight.dtype == torch.bfloat16 and has_onednn_bf16():
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, PackedLinear(module))
    return model
