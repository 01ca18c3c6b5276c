"""The "triton" attention backend: nanoserve's own paged-attention kernel (kernels/triton_attention.py).
It is one launch per layer for the whole flat batch, reading the cache through `block_tables`.

It has the shape of attention.py's backends:
- `prepare(batch, block_size, dtype)` runs once per step. It returns the Batch's four arrays the kernels
  read (`TritonMetadata`: tensors only).
- `forward(q, k, v, kv_cache, layer, metadata)` runs per layer. It calls one custom op,
  `nanoserve::triton_attention`, whose inputs are tensors only.
So the compiled step (compilation.py), one graph for the whole step, holds the op as it is. It guards on
tensors, never on Python lists or host copies of lengths.

"auto" picks it on CUDA where flash-attn 2 cannot serve (attention.select_attention). On a CPU it runs
only when asked for and TRITON_INTERPRET=1 is set. Triton's interpreter then runs the kernels in numpy,
slowly, to debug the GPU path on a laptop.
"""

import os
from typing import NamedTuple

import torch
from torch import Tensor

from nanoserve.batch import Batch
from nanoserve.kv_cache import store_kvcache


class TritonMetadata(NamedTuple):
    """What every layer's attention shares in a step. It is the Batch's arrays the store and the kernel read.
    The fields are in the order triton_attention takes them, so `forward` passes them as `*metadata`."""
    slot_mapping: Tensor     # [N] int64
    query_start_loc: Tensor  # [B+1] int32
    seq_lens: Tensor         # [B] int32
    block_tables: Tensor     # [B, max_blocks] int32


@torch.library.custom_op("nanoserve::triton_attention", mutates_args=("kv_cache",))
def triton_attention(q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor, layer: int, slot_mapping: Tensor,
                     query_start_loc: Tensor, seq_lens: Tensor, block_tables: Tensor, scale: float,
                     softcap: float, window: int | None) -> Tensor:
    """q `[N, H, D]`, k, v `[N, Hkv, D]` -> `[N, H, D]`.
    The step's k, v are written into their slots of layer `layer` first. So each query finds its own
    token's key through the block table, like any other. `window` is the layer's sliding window, or None."""
    k_cache, v_cache = kv_cache[:, layer]  # views taken inside the op: it declares the whole cache mutated
    # Imported only when run. Triton reads TRITON_INTERPRET as the kernel is defined. And attention.py
    # imports this module, so this module cannot import attention.py at its top.
    from nanoserve.kernels.triton_attention import paged_attention
    store_kvcache(k, v, k_cache, v_cache, slot_mapping)
    return paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, scale, softcap, window)


@triton_attention.register_fake
def _(q: Tensor, *rest: Tensor | float) -> Tensor:
    """The output's shape for torch.compile's tracing: q's, laid out contiguously.
    The other inputs, passed as the op's, do not change it."""
    return q.new_empty(q.shape)


class TritonBackend:
    """The Triton kernel on CUDA (or under TRITON_INTERPRET=1). Each layer runs the store of
    kv_cache.store_kvcache, then one attention launch."""

    def __init__(self, scale: float, softcap: float = 0.0) -> None:
        self.scale, self.softcap = scale, softcap  # softcap: Gemma 2's, 0 for none (kernels/triton_attention.py)

    def prepare(self, batch: Batch, block_size: int, dtype: torch.dtype) -> TritonMetadata:
        return TritonMetadata(batch.slot_mapping, batch.query_start_loc, batch.seq_lens, batch.block_tables)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor, layer: int,
                metadata: TritonMetadata, window: int | None = None) -> Tensor:
        """q `[N, H, D]`, k, v `[N, Hkv, D]` -> `[N, H, D]`, in one custom op (triton_attention).
        `window` is the layer's sliding window, or None."""
        return torch.ops.nanoserve.triton_attention(q, k, v, kv_cache, layer, *metadata, self.scale, self.softcap,
                                                    window)


def interpreting() -> bool:
    """TRITON_INTERPRET is set as triton reads it: its kernels run in the interpreter, on the CPU."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "yes", "on")


def why_not_triton(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the triton backend cannot serve here, or None where it can.
    It needs CUDA, or the CPU under the interpreter, and triton importable. On the interpreter a bfloat16
    tl.dot returns garbage."""
    if device.type == "cpu" and not interpreting():
        return "on a CPU its kernels run only in Triton's interpreter: set TRITON_INTERPRET=1 (slow; for debugging)"
    if device.type not in ("cpu", "cuda"):
        return f"it runs on CUDA (or the CPU under TRITON_INTERPRET=1), got device {device}"
    if device.type == "cpu" and dtype == torch.bfloat16:
        return "Triton's interpreter computes bfloat16 tl.dot wrongly: use dtype float32 or float16"
    try:
        import triton  # noqa: F401
    except Exception as error:  # absent (macOS), or built for another torch
        return f"triton is not importable ({type(error).__name__}: {error})"
    return None


def choose_backend(name: str, device: torch.device, dtype: torch.dtype, flash_runs: bool) -> str:
    """The last word of attention.select_attention, once flash-attn's case is known. In this order:
    - "triton" when asked for, or a ValueError naming why where it cannot run;
    - "flash" where it runs;
    - "triton" under "auto", on CUDA where triton is importable;
    - "torch".
    Any block_size serves triton, because each key finds its own block."""
    if name == "triton":
        if why_not := why_not_triton(device, dtype):
            raise ValueError(f"the triton attention backend cannot run here: {why_not}")
        return "triton"
    if flash_runs:
        return "flash"
    if name == "auto" and device.type == "cuda" and not why_not_triton(device, dtype):
        return "triton"
    return "torch"
