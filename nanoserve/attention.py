"""Attention over a paged KV cache, with a pure-PyTorch stand-in for flash-attn.

The KV cache of one layer is two tensors `k_cache`, `v_cache` of shape
`[num_blocks, block_size, num_kv_heads, head_dim]` (flash-attn's paged layout). Token `p` of a
request lives in block `block_tables[b][p // block_size]` at offset `p % block_size`, i.e. at the
flat slot `block_id * block_size + offset`. Block 0 is the null block: it pads `block_tables`
and never holds a real request's keys.

Each step, `Attention.forward` first writes the step's new k, v into their slots
(`store_kvcache`), then attends every query to all keys of its request, reading them from the
cache. Invariants the backends rely on:
  * causal masks are aligned bottom-right: with seqlen_q queries and seqlen_k keys, query i sees
    key j iff j <= i + seqlen_k - seqlen_q (a prefill chunk sits at the end of its keys);
  * query head h reads kv head h // (num_heads // num_kv_heads) (grouped-query attention);
  * a query that sees no key at all gets a zero output, as flash-attn returns.

Two backends provide the same two entry points: "flash" (the flash-attn package, CUDA only)
and "torch" (this module's `flash_attn_varlen_func` / `flash_attn_with_kvcache`: same
signatures and semantics, built on `scaled_dot_product_attention`, used on CPU and in tests).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

if TYPE_CHECKING:
    from nanoserve.batch import Batch

BACKENDS = ("torch", "flash")


def store_kvcache(k: Tensor, v: Tensor, k_cache: Tensor,
                  v_cache: Tensor, slot_mapping: Tensor) -> None:
    """Write token i's k, v (`[N, num_kv_heads, head_dim]`) into flat slot `slot_mapping[i]`."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    # [num_blocks * block_size, num_kv_heads, head_dim]: one row per slot, a view, so writes land in the cache
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


# ----------------------------------------------------------------------------- torch backend

def reject_unsupported(**options: object) -> None:
    """Raise NotImplementedError for any flash-attn option set away from its default."""
    defaults = {"dropout_p": 0.0, "window_size": (-1, -1), "softcap": 0.0,
                "return_attn_probs": False, "return_softmax_lse": False}  # the others default to None
    for name, value in options.items():
        if name == "window_size":
            value = tuple(value)  # (-1, -1) or [-1, -1]: an unlimited window either way
        default = defaults.get(name)
        if (value is not None) if default is None else (value != default):
            raise NotImplementedError(f"the torch attention backend does not support {name}={value!r}")


def gather_blocks(cache: Tensor, block_table: Tensor, max_len: int) -> Tensor:
    """The first `max_len` (rounded up to whole blocks) cached tokens of each row of `block_table`."""
    block_size = cache.shape[1]
    num_blocks = max(1, -(-max_len // block_size))  # at least one block, so the key axis is never empty
    table = block_table[:, :num_blocks]
    # index_select on the block axis copies whole blocks, several times faster on CPU than
    # advanced indexing: [B * num_blocks, block_size, Hkv, D] -> [B, num_blocks * block_size, Hkv, D]
    return cache.index_select(0, table.flatten()).view(table.shape[0], -1, *cache.shape[2:])


def build_mask(seqlen_q: int, seqlens_k: Tensor, max_len: int, causal: bool) -> Tensor:
    """Boolean mask `[B, 1, seqlen_q, max_len]`: key j is real (j < seqlen_k) and, if causal, visible."""
    key_pos = torch.arange(max_len, device=seqlens_k.device)                # [L]
    query_pos = torch.arange(seqlen_q, device=seqlens_k.device)[:, None]   # [Sq, 1]
    seqlens_k = seqlens_k.view(-1, 1, 1, 1)                                # [B, 1, 1, 1]
    mask = key_pos < seqlens_k                                             # [B, 1, 1, L]
    if causal:  # bottom-right: the last query is at position seqlen_k - 1
        mask = mask & (key_pos <= query_pos + seqlens_k - seqlen_q)        # [B, 1, Sq, L]
    return mask


def attend(q: Tensor, k: Tensor, v: Tensor, scale: float,
           mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
    """q `[B, Sq, H, D]`, k, v `[B, L, Hkv, D]` -> `[B, Sq, H, D]`, one SDPA call for the batch."""
    # SDPA wants heads before length: [B, heads, len, D]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=True)
    if mask is not None:  # a query with no visible key must give 0 (flash-attn), never NaN
        out = out.masked_fill(~mask.any(-1, keepdim=True), 0.0)
    return out.transpose(1, 2)  # [B, Sq, H, D]


def flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: float | None = None, causal: bool = False,
                           window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: Tensor | None = None, deterministic: bool = False,
                           return_attn_probs: bool = False, block_table: Tensor | None = None) -> Tensor:
    """flash-attn's varlen attention: q `[total_q, H, D]` -> `[total_q, H, D]`.

    k, v are packed `[total_k, Hkv, D]`, or paged caches when `block_table` is given. Requests
    with one query token are attended together in one batched call; longer ones (prefill chunks,
    compute-bound) one at a time.
    """
    reject_unsupported(dropout_p=dropout_p, window_size=window_size, softcap=softcap,
                       alibi_slopes=alibi_slopes, return_attn_probs=return_attn_probs)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    q_starts, k_starts = torch.stack((cu_seqlens_q, cu_seqlens_k)).tolist()  # the one host sync
    q_lens = [end - start for start, end in zip(q_starts, q_starts[1:])]
    k_lens = [end - start for start, end in zip(k_starts, k_starts[1:])]
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])  # [total_q, H, D]

    def gather_kv(rows: list[int], max_len: int) -> tuple[Tensor, Tensor]:
        """Keys and values of requests `rows`, padded: `[len(rows), >= max_len, Hkv, D]`."""
        if block_table is not None:
            table = block_table[torch.tensor(rows, device=q.device)]
            return gather_blocks(k, table, max_len), gather_blocks(v, table, max_len)
        starts = torch.tensor([k_starts[b] for b in rows], device=q.device)
        index = starts[:, None] + torch.arange(max(1, max_len), device=q.device)  # [R, L]
        index = index.clamp(max=k.shape[0] - 1)  # padding past the last key; masked out below
        return k[index], v[index]

    decode_rows = [b for b, n in enumerate(q_lens) if n == 1]
    if decode_rows:  # with one query, causal or not, it sees every key of its request
        max_len = max(k_lens[b] for b in decode_rows)
        keys, values = gather_kv(decode_rows, max_len)
        seqlens_k = torch.tensor([k_lens[b] for b in decode_rows], device=q.device)
        rows_q = torch.tensor([q_starts[b] for b in decode_rows], device=q.device)
        mask = build_mask(1, seqlens_k, keys.shape[1], causal)
        out[rows_q] = attend(q[rows_q].unsqueeze(1), keys, values, scale, mask).squeeze(1)

    for b in (b for b, n in enumerate(q_lens) if n > 1 and k_lens[b] > 0):  # no keys: output stays 0
        keys, values = gather_kv([b], k_lens[b])
        keys, values = keys[:, :k_lens[b]], values[:, :k_lens[b]]  # [1, seqlen_k, Hkv, D]
        q_b = q[q_starts[b]:q_starts[b + 1]].unsqueeze(0)          # [1, seqlen_q, H, D]
        if q_lens[b] == k_lens[b] or not causal:  # SDPA's top-left causal is right here
            out_b = attend(q_b, keys, values, scale, is_causal=causal)
        else:
            mask = build_mask(q_lens[b], torch.tensor([k_lens[b]], device=q.device), k_lens[b], causal)
            out_b = attend(q_b, keys, values, scale, mask)
        out[q_starts[b]:q_starts[b + 1]] = out_b.squeeze(0)
    return out


def flash_attn_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Tensor | None = None,
                            v: Tensor | None = None, rotary_cos: Tensor | None = None,
                            rotary_sin: Tensor | None = None, cache_seqlens: Tensor | int | None = None,
                            cache_batch_idx: Tensor | None = None, cache_leftpad: Tensor | None = None,
                            block_table: Tensor | None = None, softmax_scale: float | None = None,
                            causal: bool = False, window_size: tuple[int, int] = (-1, -1),
                            softcap: float = 0.0, rotary_interleaved: bool = True,
                            alibi_slopes: Tensor | None = None, num_splits: int = 0,
                            return_softmax_lse: bool = False) -> Tensor:
    """flash-attn's attention against a KV cache: q `[B, seqlen_q, H, D]` -> `[B, seqlen_q, H, D]`.

    Request b attends to its first `cache_seqlens[b]` cached tokens (plus the new k, v, if given,
    which are first written into the cache after them). Two batched SDPA calls at most, no per-request loop.
    """
    reject_unsupported(rotary_cos=rotary_cos, rotary_sin=rotary_sin, cache_batch_idx=cache_batch_idx,
                       cache_leftpad=cache_leftpad, window_size=window_size, softcap=softcap,
                       alibi_slopes=alibi_slopes, return_softmax_lse=return_softmax_lse)
    batch_size, seqlen_q = q.shape[:2]
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    if block_table is None:
        # A contiguous cache [batch_size_cache, seqlen_cache, Hkv, D] is a paged one whose blocks
        # hold seqlen_cache tokens, request b owning the single block b.
        block_table = torch.arange(batch_size, device=q.device)[:, None]  # [B, 1]
    block_size = k_cache.shape[1]
    if not isinstance(cache_seqlens, Tensor):  # None means the whole cache, an int all alike
        seqlen = block_table.shape[1] * block_size if cache_seqlens is None else cache_seqlens
        cache_seqlens = torch.full((batch_size,), seqlen, dtype=torch.int32, device=q.device)
    if k is not None:  # append the new tokens at positions cache_seqlens[b], cache_seqlens[b] + 1, ...
        pos = cache_seqlens[:, None].long() + torch.arange(k.shape[1], device=q.device)  # [B, seqlen_new]
        slots = block_table.gather(1, pos // block_size).long() * block_size + pos % block_size
        # [B * seqlen_new, Hkv, D] rows into [B * seqlen_new] slots
        store_kvcache(k.flatten(0, 1), v.flatten(0, 1), k_cache, v_cache, slots.flatten())
        cache_seqlens = cache_seqlens + k.shape[1]
    # Each group of requests is padded to its longest context. Two groups, the shorter and the
    # longer half, cut the padding when contexts vary (a fixed count: no per-request loop).
    out = torch.empty_like(q)
    for rows in cache_seqlens.argsort().chunk(2 if batch_size >= 16 else 1):
        max_len = int(cache_seqlens[rows].max())  # host sync: gather only the blocks these rows need
        table = block_table[rows]
        keys, values = gather_blocks(k_cache, table, max_len), gather_blocks(v_cache, table, max_len)
        mask = build_mask(seqlen_q, cache_seqlens[rows], keys.shape[1], causal)
        out[rows] = attend(q[rows], keys, values, scale, mask)
    return out


# ----------------------------------------------------------------------------- choosing a backend

def select_backend(name: str, device: torch.device, block_size: int, dtype: torch.dtype) -> str:
    """Resolve "auto" | "torch" | "flash", failing at start-up, not mid-run, on a choice that cannot
    serve: flash-attn needs CUDA, fp16 or bf16, and whole 256-token pages for its paged KV cache.
    "auto" takes flash only where it fits, and the torch backend everywhere else."""
    if name not in ("auto", *BACKENDS):
        raise ValueError(f"unknown attention backend {name!r}; choose 'auto', 'torch' or 'flash'")
    is_cuda = torch.device(device).type == "cuda"
    flash_fits = block_size % 256 == 0 and dtype in (torch.float16, torch.bfloat16)
    if name == "auto":
        return "flash" if is_cuda and flash_fits and flash_attn_importable() else "torch"
    if name == "flash" and not is_cuda:
        raise ValueError(f"the flash attention backend needs a CUDA device, got {device}")
    if name == "flash" and not flash_fits:
        raise ValueError(f"the flash attention backend needs block_size a multiple of 256 and dtype float16 "
                         f"or bfloat16, got block_size={block_size}, dtype={dtype}")
    return name


def flash_attn_importable() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def load_backend(backend: str) -> tuple[Callable[..., Tensor], Callable[..., Tensor]]:
    """The backend's (flash_attn_varlen_func, flash_attn_with_kvcache)."""
    if backend == "flash":
        import flash_attn  # imported only when chosen: it exists only on CUDA machines
        return flash_attn.flash_attn_varlen_func, flash_attn.flash_attn_with_kvcache
    return flash_attn_varlen_func, flash_attn_with_kvcache


class Attention(torch.nn.Module):
    """One layer's attention: store the step's k, v in the paged cache, attend to the cache."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, backend: str) -> None:
        super().__init__()
        assert num_heads % num_kv_heads == 0, "query heads must split evenly over kv heads"
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.varlen, self.with_kvcache = load_backend(backend)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor,
                v_cache: Tensor, batch: Batch) -> Tensor:
        """q `[N, H, D]`, k, v `[N, Hkv, D]` -> `[N, H, D]`."""
        store_kvcache(k, v, k_cache, v_cache, batch.slot_mapping)
        if batch.is_decode_only:  # N == B: one query per request, all keys already in the cache
            out = self.with_kvcache(q.unsqueeze(1), k_cache, v_cache,  # q as [B, 1, H, D]
                                    cache_seqlens=batch.seq_lens, block_table=batch.block_tables,
                                    softmax_scale=self.scale, causal=True)
            return out.squeeze(1)  # [N, H, D]
        return self.varlen(q, k_cache, v_cache, batch.query_start_loc, batch.cu_seqlens_k,
                           batch.max_query_len, batch.max_seq_len, softmax_scale=self.scale,
                           causal=True, block_table=batch.block_tables)
