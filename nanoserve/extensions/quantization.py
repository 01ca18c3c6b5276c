"""Int8 weight-only quantization (`LLM(model, quantization="int8")`). Every linear layer's weight is stored
as int8, with one scale per output channel. The activations, the embedding and the KV cache stay in `dtype`.

Why: a decode step of a few requests reads every weight once, and does little arithmetic with each.
So its time is about its bytes (docs/quantization.md). An int8 weight is half of bfloat16's bytes and a
quarter of float32's.

The rule, for a weight W [out, in] (symmetric, per output channel o):
    scale[o] = max_i |W[o, i]| / 127          rounded to `dtype`; a row of zeros gets scale 1
    q[o, i]  = round(W[o, i] / scale[o])      an int8 in [-127, 127]
    x @ (q * scale[:, None]).T == (x @ q.T) * scale
The right-hand side is what torch's `_weight_int8pack_mm` computes. It converts q to floats as it reads
it, so the dequantized matrix is never written out.

But that kernel converts the whole weight again for every row. So from DEQUANTIZE_ROWS rows on (a prompt),
a CPU step converts q to `dtype` once and multiplies it whole. The conversion is exact, since |q| <= 127.
It does so where the CPU multiplies `dtype` natively: float32, and bfloat16 with oneDNN's kernels.
That is 2.4-2.7x faster at 128-512 rows in bfloat16, and 18-38x in float32. bfloat16 held to AVX2 keeps
the kernel, which is 2.9x faster there (docs/quantization.md, "Many rows").

Invariants:
- Only linears are quantized: those of the decoder layers and lm_head. A tied lm_head gets its own int8
  copy. The embedding it shares the matrix with keeps its rows in `dtype`.
- Quantizing follows loading, so with tensor parallelism each rank quantizes its own shard.
  A row-parallel shard (o_proj, down_proj: split on in) has scales of its own slice's rows.
- `Int8Linear.dequantize()` is the weight its products equal; the tests run transformers on those weights.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from nanoserve.device import has_onednn

# from this many rows (a prompt's) a CPU step multiplies by the converted weight, not the int8 kernel (above)
DEQUANTIZE_ROWS = 128


class Int8Linear(nn.Module):
    """nn.Linear with an int8 weight [out, in] and a scale [out] in the activation dtype.
    A bias, if any, stays as loaded and is added to the product."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach()  # [out, in], in the activation dtype
        scale = (weight.abs().amax(dim=1).float() / 127).to(weight.dtype)  # [out]
        scale = scale.where(scale > 0, 1)
        # scale is rounded to dtype first, so q is the nearest int8 to W / the scale the kernel uses
        q = torch.round(weight.float() / scale.float()[:, None]).clamp(-127, 127)
        self.register_buffer("weight_int8", q.to(torch.int8))
        self.register_buffer("scale", scale)
        self.bias = linear.bias  # [out] or None
        native = weight.dtype == torch.float32 or has_onednn(weight.dtype)  # a matmul in dtype that is not emulated
        self.convert_prompts = weight.device.type == "cpu" and native

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x [N, in]; the compiled step keeps the kernel, which inductor times against its own int8 templates
        if x.shape[0] >= DEQUANTIZE_ROWS and self.convert_prompts and not torch.compiler.is_compiling():
            y = torch.nn.functional.linear(x, self.weight_int8.to(x.dtype)) * self.scale  # [N, out]
        else:
            y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.weight_int8, self.scale)  # [N, out]
        return y if self.bias is None else y + self.bias

    def dequantize(self) -> torch.Tensor:
        """The weight [out, in] this layer multiplies by: q * scale, exact in float32."""
        return self.weight_int8.float() * self.scale.float()[:, None]


def quantize_linears(model: nn.Module, quantization: str) -> nn.Module:
    """Replace every nn.Linear of a loaded model by its `quantization` ("int8": Int8Linear).
    Raise a ValueError where torch has no int8 kernel for this device and dtype. (Config checks the name.)"""
    weight = model.lm_head.weight
    if weight.device.type == "cpu" and weight.dtype == torch.float32:
        logging.getLogger(__name__).warning(
            "quantization='int8' with float32 activations: torch's CPU int8 kernel is many times slower with them "
            "than with bfloat16 ones; dtype='bfloat16' is its fast pairing (docs/quantization.md)")
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear):
            quantized = Int8Linear(module)
            check_kernel(quantized, module.weight)
            model.set_submodule(name, quantized)
    return model


def check_kernel(layer: Int8Linear, weight: torch.Tensor) -> None:
    """Run `layer` on one row of zeros. A device, dtype or shape the kernel refuses is then a ValueError
    now, at load, not in the first step."""
    try:
        layer(torch.zeros(1, weight.shape[1], dtype=weight.dtype, device=weight.device))
    except (RuntimeError, NotImplementedError) as error:
        first_line = (str(error).strip().splitlines() or [""])[0]
        raise ValueError(f"quantization='int8' is not supported here: torch {torch.__version__} has no int8 kernel "
                         f"(aten._weight_int8pack_mm) for a {list(weight.shape)} {weight.dtype} weight on "
                         f"{weight.device.type}: {first_line}") from error
