"""Linear layers: y = x @ W.T + b, with b only where the checkpoint has one. This module decides how each
weight is stored and multiplied on this device. `pack_linears` is the one place that choice is made.
The model is built from plain `nn.Linear`s, the reference formulation every other choice must equal.

Why the choice matters on a CPU: a decode step multiplies a few rows of activations by every weight
matrix. How fast the GEMM library does that depends on the weight's memory layout. (docs/performance.md,
"Where a decode step's time goes", has the measured figures.)
"""

import torch
from torch import Tensor, nn

from nanoserve.device import has_onednn

# x @ W.T + b with W in oneDNN's blocked layout, as an op of our own: torch.compile calls it as it is
# (inductor cannot lower oneDNN's op on an opaque packed weight) and fuses what is around it. Defined
# through torch.library, not @custom_op, whose Python wrapper cost ~8 us more a call (121 calls a step).
LIBRARY = torch.library.Library("nanoserve", "FRAGMENT")
LIBRARY.define("packed_linear(Tensor x, Tensor packed_weight, Tensor? bias, int out_features) -> Tensor")


@torch.library.impl(LIBRARY, "packed_linear", "CompositeExplicitAutograd")  # any backend: the weight is MkldnnCPU
def packed_linear(x: Tensor, packed_weight: Tensor, bias: Tensor | None,
                  out_features: int) -> Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


@torch.library.register_fake("nanoserve::packed_linear")
def _(x: Tensor, packed_weight: Tensor, bias: Tensor | None, out_features: int) -> Tensor:
    return x.new_empty(*x.shape[:-1], out_features)  # the shape the compiler traces: [..., out]


class PackedLinear(nn.Module):
    """nn.Linear, its weight laid out once in oneDNN's own blocked format. Its bias, if any, is kept as it
    is: oneDNN adds it to the product.

    The packed weight is opaque (only this reads it), and a copy. So a tied lm_head keeps the embedding
    matrix and gets its own packed one. In bfloat16 the products equal nn.Linear's bit for bit. In float32
    they may round differently (another summation order), as any GEMM library's may."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.register_buffer("packed_weight", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach()))
        self.bias = linear.bias  # [out] or None
        self.out_features = linear.out_features

    def forward(self, x: Tensor) -> Tensor:
        return torch.ops.nanoserve.packed_linear(x, self.packed_weight, self.bias, self.out_features)


def choose_linear(dtype: torch.dtype, compiled_one_row: bool) -> str:
    """How this CPU multiplies a `dtype` weight fastest at the engine's shapes.
    It is decided from what the CPU and torch support (docs/performance.md, "Which CPU", has the figures).
      * "packed" (PackedLinear): bfloat16 where oneDNN has bf16 kernels, and float32 on x86.
        On x86, oneDNN took 0.45-0.7x MKL's time at decode batches of 8-48 rows, and ~0.8x at prefill.
        With torch's default threads it took 0.68-0.75x at one row. That held on AVX-512 and AVX2 CPUs alike.
      * "column_major": float32 otherwise (and on Arm, or a torch without oneDNN). Also float32 where the
        compiled step runs one row at a time (`compiled_one_row`: enforce_eager=False, max_num_seqs=1).
        There inductor lays plain weights out for its own GEMM templates (extensions/compilation.py).
      * "row_major": nn.Linear as loaded (bfloat16 without oneDNN's kernels, where it is emulated)."""
    if has_onednn(dtype) and not (dtype == torch.float32 and compiled_one_row):
        return "packed"
    return "column_major" if dtype == torch.float32 else "row_major"


def pack_linears(model: nn.Module, compiled_one_row: bool = False) -> nn.Module:
    """Give every nn.Linear of a loaded CPU model the implementation `choose_linear` picks. The pick depends
    on its dtype and the engine's shape (`compiled_one_row`). A bias stays as loaded in every layout.

    A float32 weight tied to the embedding must stay row-major for the embedding's row lookups. So where
    it would be column-major, it is packed instead (a copy), where oneDNN can. Row-major, MKL took
    2.3-2.9x oneDNN's time for SmolLM2's 49152 x 576 lm_head at one row (9.7 ms, 3.4-4.3 ms; AMD EPYC,
    2 threads). That is the largest matmul of a one-request step."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or module.weight.device.type != "cpu":
            continue
        weight = module.weight
        layout = choose_linear(weight.dtype, compiled_one_row)
        if layout == "column_major" and id(weight) in embeddings:
            layout = "packed" if has_onednn(weight.dtype) else "row_major"
        if layout == "column_major":
            # The same [out, in] weight, laid out as [in, out] in memory (strides (1, out)): on CPU in float32,
            # x @ weight.T is then MKL's plain (not transposed) GEMM, faster at one-row decode.
            module.weight = nn.Parameter(weight.t().contiguous().t(), requires_grad=False)
        elif layout == "packed":
            model.set_submodule(name, PackedLinear(module))
    return model
