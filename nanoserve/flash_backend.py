"""The "flash" attention backend: flash-attn 2's kernels (CUDA). They read the paged KV cache through the
Batch's own arrays. `why_not_flash` says where they cannot run. attention.py chooses among the backends
(`select_attention`) and states the invariants every backend keeps.
"""

import inspect

import torch
from torch import Tensor

from nanoserve.batch import Batch
from nanoserve.kv_cache import store_kvcache
from nanoserve.sliding_window import flash_window_size


class FlashBackend:
    """flash-attn's kernels (CUDA, fp16/bf16, block_size a multiple of 256). They read the `Batch`'s
    own arrays, so the step's metadata is the Batch itself."""

    def __init__(self, scale: float, softcap: float = 0.0) -> None:
        # imported only when chosen: it exists only on CUDA machines
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
        self.scale, self.softcap = scale, softcap
        self.varlen_func, self.with_kvcache = flash_attn_varlen_func, flash_attn_with_kvcache

    def prepare(self, batch: Batch, block_size: int, dtype: torch.dtype) -> Batch:
        return batch

    def forward(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor, layer: int, batch: Batch,
                window: int | None = None) -> Tensor:
        """q `[N, H, D]`, k, v `[N, Hkv, D]` -> `[N, H, D]`. With a sliding window, each query sees only the
        last `window` keys. `slot_mapping` goes to the store only. flash-attn finds every key, new ones
        included, through `block_tables`."""
        k_cache, v_cache = kv_cache[:, layer]  # this layer's [num_blocks, block_size, Hkv, D] each
        store_kvcache(k, v, k_cache, v_cache, batch.slot_mapping)
        # what both kernels take alike: request b's keys are in blocks block_tables[b]
        alike = dict(block_table=batch.block_tables, softmax_scale=self.scale, causal=True, softcap=self.softcap,
                     window_size=flash_window_size(window))
        if batch.is_decode_only:  # N == B: one query per request, all keys already in the cache
            # request b's query attends to its first seq_lens[b] cached tokens; q as [B, 1, H, D]
            return self.with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=batch.seq_lens,
                                     **alike).squeeze(1)  # [N, H, D]
        # request b's queries are rows query_start_loc[b]:query_start_loc[b + 1] of q; its keys, the
        # first cu_seqlens_k[b + 1] - cu_seqlens_k[b] (= seq_lens[b]) tokens
        return self.varlen_func(q, k_cache, v_cache, batch.query_start_loc, batch.cu_seqlens_k,
                                batch.max_query_len, batch.max_seq_len, **alike)


def why_not_flash(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """Why flash-attn 2 cannot serve here, or None where it can. It needs all of these:
    - An NVIDIA GPU of compute capability 8.0 to 9.x. Its wheels hold kernels for sm80 and sm90;
      10.x and up need a build for them.
    - fp16 or bf16.
    - head_dim a multiple of 8, up to 256. Any other it pads, copying the whole cache every call.
    - flash-attn 2.5.7 or later, whose flash_attn_varlen_func reads a paged cache (block_table).

    flash-attn 3 and 4 are other packages with other functions. An install of flash-attn 4 alone leaves
    an empty `flash_attn` namespace: its import succeeds, but it holds neither function."""
    if device.type != "cuda" or torch.version.hip:  # ROCm answers to "cuda" too, numbered its own way
        return f"flash-attn 2 needs an NVIDIA GPU (CUDA, not ROCm), got device {device}"
    capability = torch.cuda.get_device_capability(device)
    if not (8, 0) <= capability < (10, 0):
        return f"flash-attn 2 runs on compute capability 8.0 to 9.x, this GPU has {capability[0]}.{capability[1]}"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"flash-attn needs dtype float16 or bfloat16, got {dtype}"
    if head_dim % 8 or head_dim > 256:
        return f"flash-attn needs head_dim a multiple of 8, at most 256; the model's is {head_dim}"
    try:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache  # noqa: F401
    except Exception as error:  # absent, flash-attn 3 or 4 only, or built for another torch
        return f"flash-attn 2 is not importable ({type(error).__name__}: {error})"
    if "block_table" not in inspect.signature(flash_attn_varlen_func).parameters:
        return "flash-attn is older than 2.5.7: its flash_attn_varlen_func takes no block_table"
    return None
