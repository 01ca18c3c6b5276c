"""The "triton" attention backend: nanoserve's own paged-attention kernel (kernels/triton_attention.py),
one launch per layer for the whole flat batch, reading the cache through `block_tables`.

It has the shape of attention.py's backends: `prepare(batch, block_size, dtype)` once per step returns
the Batch itself (the kernels read its arrays, as flash-attn does), `forward(q, k, v, k_cache, v_cache,
batch)` per layer. It is what "auto" picks on CUDA where flash-attn 2 cannot serve
(attention.select_attention). On a CPU it runs only when asked for and TRITON_INTERPRET=1 is set:
Triton's interpreter then runs the kernels in numpy, slowly, to debug the GPU path on a laptop.
"""
from __future__ import annotations

import os

import torch
from torch import Tensor

from nanoserve.batch import Batch


class TritonBackend:
    """Triton kernels on CUDA (or under TRITON_INTERPRET=1): one store, one attention launch per layer."""

    def __init__(self, scale: float) -> None:
        # imported only when chosen: triton reads TRITON_INTERPRET as the kernels are defined
        from nanoserve.kernels import triton_attention
        self.scale, self.kernels = scale, triton_attention

    def prepare(self, batch: Batch, block_size: int, dtype: torch.dtype) -> Batch:
        return batch

    def forward(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, batch: Batch) -> Tensor:
        """q `[N, H, D]`, k, v `[N, Hkv, D]` -> `[N, H, D]`: the step's k, v written into their slots
        first, so that each query finds its own token's key through the block table like any other."""
        self.kernels.store_kvcache(k, v, k_cache, v_cache, batch.slot_mapping)
        return self.kernels.paged_attention(q, k_cache, v_cache, batch.query_start_loc, batch.seq_lens,
                                            batch.block_tables, self.scale)


def interpreting() -> bool:
    """TRITON_INTERPRET is set as triton reads it: its kernels run in the interpreter, on the CPU."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "yes", "on")


def why_not_triton(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the triton backend cannot serve here, or None where it can: CUDA (or the CPU under the
    interpreter, where a bfloat16 tl.dot returns garbage) and triton importable."""
    device = torch.device(device)
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


def uses_triton(name: str, device: torch.device, dtype: torch.dtype, flash_runs: bool) -> bool:
    """Whether select_attention takes the triton backend: when asked for ("triton"; a ValueError naming
    why where it cannot run), or under "auto" on CUDA where flash-attn does not run and triton does.
    Any block_size serves: each key finds its own block."""
    if name == "triton":
        why_not = why_not_triton(device, dtype)
        if why_not:
            raise ValueError(f"the triton attention backend cannot run here: {why_not}")
        return True
    on_cuda = torch.device(device).type == "cuda"
    return name == "auto" and not flash_runs and on_cuda and not why_not_triton(device, dtype)
