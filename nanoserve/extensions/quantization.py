"""Weight-only quantization: `LLM(model, quantization="int8")` or `"int4"`.

With int8, every linear layer's weight is stored as int8, with one scale per output channel. With int4,
each group of 32 inputs in a row shares a scale and a zero (`Int4Linear`). The activations, the embedding
and the KV cache stay in `dtype`.

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
- `dequantize()` is the weight a layer's products equal. The tests run transformers on those weights.
"""

import logging

import torch
from torch import nn

from nanoserve.device import has_onednn
from nanoserve.extensions.compilation import summarize_error

# from this many rows (a prompt's) a CPU step multiplies by the converted weight, not the int8 kernel (above)
DEQUANTIZE_ROWS = 128


class QuantizedLinear(nn.Module):
    """What Int8Linear and Int4Linear share: the loaded bias `self.bias`, added to the quantized product `mm`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.mm(x.contiguous())  # [N, out]
        return y if self.bias is None else y + self.bias


class Int8Linear(QuantizedLinear):
    """nn.Linear with an int8 weight [out, in] and a scale [out] in the activation dtype.
    A bias, if any, stays as loaded and is added to the product."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.bias = linear.bias  # [out] or None
        weight = linear.weight.detach()  # [out, in], in the activation dtype
        scale = (weight.abs().amax(dim=1).float() / 127).to(weight.dtype)  # [out]
        scale = scale.where(scale > 0, 1)
        # scale is rounded to dtype first, so q is the nearest int8 to W / the scale the kernel uses
        q = torch.round(weight.float() / scale.float()[:, None]).clamp(-127, 127)
        self.register_buffer("weight_int8", q.to(torch.int8))
        self.register_buffer("scale", scale)
        native = weight.dtype == torch.float32 or has_onednn(weight.dtype)  # a matmul in dtype that is not emulated
        self.convert_prompts = weight.device.type == "cpu" and native

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, in] -> [N, out], without the bias."""
        # The compiled step keeps the kernel, which inductor times against its own int8 templates.
        # is_compiling() comes before the row count, so tracing never guards on N (a guard recompiles at 128 rows).
        if self.convert_prompts and not torch.compiler.is_compiling() and x.shape[0] >= DEQUANTIZE_ROWS:
            return torch.nn.functional.linear(x, self.weight_int8.to(x.dtype)) * self.scale
        return torch.ops.aten._weight_int8pack_mm(x, self.weight_int8, self.scale)

    def dequantize(self) -> torch.Tensor:
        """The weight [out, in] this layer multiplies by: q * scale, exact in float32."""
        return self.weight_int8.float() * self.scale.float()[:, None]


class Int4Linear(QuantizedLinear):
    """nn.Linear with a 4-bit weight. Each group of `group_size` inputs in a row shares a scale and a zero.

    The rule, for one group of weights w (asymmetric: the group's range is split into 16 steps):
        scale = (max(w) - min(w)) / 15     rounded to `dtype`; a group of equal weights gets scale 1
        zero  = min(w) + 8 * scale         rounded to `dtype`
        q     = round((w - zero) / scale) + 8, an int in [0, 15]
        w    ~= (q - 8) * scale + zero
    torch's int4 kernels compute x @ that weight, reading two q per byte. The weight is packed in the
    kernel's own layout, so the q are kept nowhere else.
    """

    def __init__(self, linear: nn.Linear, group_size: int):
        super().__init__()
        self.bias = linear.bias  # [out] or None
        weight = linear.weight.detach()  # [out, in], in the activation dtype
        groups = weight.float().unflatten(1, (-1, group_size))  # [out, groups, size]
        low, high = groups.aminmax(dim=2)  # [out, groups] each
        scale = ((high - low) / 15).to(weight.dtype)
        scale = scale.where(scale > 0, 1)
        zero = (low + 8 * scale.float()).to(weight.dtype)
        # q is the nearest int4 to w under the rounded scale and zero that the kernel uses
        q = torch.round((groups - zero.float()[..., None]) / scale.float()[..., None]) + 8  # [out, groups, size]
        q = q.clamp(0, 15).to(torch.int32).flatten(1)  # [out, in]
        self.group_size = group_size
        self.register_buffer("scale_and_zero", torch.stack([scale, zero], dim=2).transpose(0, 1).contiguous())
        self.register_buffer("weight_int4", pack_int4(q))  # [groups, out, 2] above; this one is the kernel's

    def mm(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, in] -> [N, out], without the bias."""
        cpu = x.device.type == "cpu"
        mm = torch.ops.aten._weight_int4pack_mm_for_cpu if cpu else torch.ops.aten._weight_int4pack_mm
        return mm(x, self.weight_int4, self.group_size, self.scale_and_zero.to(x.dtype))  # float32 in dequantize

    def dequantize(self) -> torch.Tensor:
        """The weight [out, in] this layer multiplies by, in float32: the kernel's product with the identity.
        Each output sums one product, so it is (q - 8) * scale + zero, exact in float32."""
        eye = torch.eye(self.scale_and_zero.shape[0] * self.group_size, device=self.scale_and_zero.device)
        return self.mm(eye).T


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [out, in] (ints in [0, 15]) in the layout of torch's int4 kernel for q's device."""
    if q.device.type == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)  # its own tiles, two q per byte
    two_per_byte = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)  # [out, in / 2]: what the CUDA kernel reads
    return torch.ops.aten._convert_weight_to_int4pack(two_per_byte, 8)  # 8 inner k-tiles, as tinygemm wants


def quantize_linears(model: nn.Module, quantization: str, group_size: int = 32) -> nn.Module:
    """Replace every nn.Linear of a loaded model by its `quantization`: Int8Linear, or Int4Linear of `group_size`.
    A device, dtype or shape torch's kernel refuses is a ValueError. (Config checks the names.)"""
    weight = model.lm_head.weight
    if weight.device.type == "cpu" and weight.dtype == torch.float32:
        logging.getLogger(__name__).warning(
            f"quantization={quantization!r} with float32 activations: torch's CPU {quantization} kernel is many times "
            "slower with them than with bfloat16 ones; dtype='bfloat16' is its fast pairing (docs/quantization.md)")
    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear):
            out_features, in_features = module.weight.shape
            # int4 splits each row into whole groups, and torch's CPU kernel takes rows in tiles of 16
            if quantization == "int4" and (in_features % group_size or out_features % 16):
                raise ValueError(f"quantization='int4' cannot quantize {name} of shape {[out_features, in_features]}: "
                                 f"its {in_features} inputs must be a multiple of the group size {group_size}, "
                                 f"and its {out_features} outputs a multiple of 16")
            quantized = Int8Linear(module) if quantization == "int8" else Int4Linear(module, group_size)
            check_kernel(quantized, module.weight, quantization)
            model.set_submodule(name, quantized)
    return model


def check_kernel(layer: nn.Module, weight: torch.Tensor, quantization: str = "int8") -> None:
    """Run `layer` on one row of zeros. A device, dtype or shape the kernel refuses is then a ValueError
    now, at load, not in the first step."""
    try:
        layer(torch.zeros(1, weight.shape[1], dtype=weight.dtype, device=weight.device))
    except (RuntimeError, NotImplementedError) as error:
        raise ValueError(f"quantization={quantization!r} is not supported here: torch {torch.__version__} has no "
                         f"{quantization} kernel (aten._weight_{quantization}pack_mm) for a {list(weight.shape)} "
                         f"{weight.dtype} weight on {weight.device.type}: {summarize_error(error)}") from error
