"""A reference of the two flash-attn 2 functions nanoserve's flash backend calls, in plain PyTorch.

Same signatures as flash-attn's `flash_attn_varlen_func` and `flash_attn_with_kvcache`, same
semantics (bottom-right causal mask, grouped-query heads, 0 for a query that sees no key, paged
caches through `block_table`), computed one request at a time in float32 without any of the engine's
code: the plain formulation that nanoserve's attention backends are held to. Options the engine
never sets raise NotImplementedError unless left at flash-attn's default.

On a machine without flash-attn, a test can stand this module in for the package
(`sys.modules["flash_attn"]`) to drive the flash backend's calls on the CPU.
"""
from __future__ import annotations

import torch
from torch import Tensor


def reject_unsupported(**options: object) -> None:
    """Raise NotImplementedError for any flash-attn option set away from its default."""
    defaults = {"dropout_p": 0.0, "window_size": (-1, -1), "softcap": 0.0,
                "return_attn_probs": False, "return_softmax_lse": False}  # the others default to None
    for name, value in options.items():
        if name == "window_size":
            value = tuple(value)  # (-1, -1) or [-1, -1]: an unlimited window either way
        default = defaults.get(name)
        if (value is not None) if default is None else (value != default):
            raise NotImplementedError(f"the flash-attn reference does not support {name}={value!r}")


def attend_one(q: Tensor, k: Tensor, v: Tensor, scale: float, causal: bool) -> Tensor:
    """One request: q `[seqlen_q, H, D]`, k, v `[seqlen_k, Hkv, D]` -> `[seqlen_q, H, D]` in q's dtype."""
    seqlen_q, num_heads, seqlen_k = q.shape[0], q.shape[1], k.shape[0]
    group = num_heads // k.shape[1]  # query head h reads kv head h // group
    k, v = k.float().repeat_interleave(group, dim=1), v.float().repeat_interleave(group, dim=1)  # [seqlen_k, H, D]
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale  # [H, seqlen_q, seqlen_k]
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device)
    if causal:  # bottom-right: query i sees key j iff j <= i + seqlen_k - seqlen_q
        query_pos = torch.arange(seqlen_q, device=q.device)[:, None]
        visible = torch.arange(seqlen_k, device=q.device) <= query_pos + seqlen_k - seqlen_q
    probs = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
    probs = probs.masked_fill(~visible.any(dim=-1)[:, None], 0.0)  # a query without keys: 0, not NaN
    return torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)


def read_paged(cache: Tensor, block_row: Tensor, seqlen: int) -> Tensor:
    """A request's first `seqlen` tokens `[seqlen, Hkv, D]` from a paged cache `[num_blocks, page_size,
    Hkv, D]`: token p lies in block `block_row[p // page_size]` at offset `p % page_size`."""
    pos = torch.arange(seqlen, device=cache.device)
    return cache[block_row.long()[pos // cache.shape[1]], pos % cache.shape[1]]


def flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: float | None = None, causal: bool = False,
                           window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: Tensor | None = None, deterministic: bool = False,
                           return_attn_probs: bool = False, block_table: Tensor | None = None) -> Tensor:
    """q `[total_q, H, D]` -> `[total_q, H, D]`; request b's queries are rows cu_seqlens_q[b]:cu_seqlens_q[b + 1].
    k, v are packed `[total_k, Hkv, D]` (request b's keys at rows cu_seqlens_k[b]:cu_seqlens_k[b + 1]), or
    paged caches when `block_table` is given (its first cu_seqlens_k[b + 1] - cu_seqlens_k[b] tokens)."""
    reject_unsupported(dropout_p=dropout_p, window_size=window_size, softcap=softcap,
                       alibi_slopes=alibi_slopes, return_attn_probs=return_attn_probs)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    q_starts, k_starts = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    out = q.new_zeros(q.shape[0], q.shape[1], v.shape[-1])
    for b in range(len(q_starts) - 1):
        if block_table is None:
            keys, values = k[k_starts[b]:k_starts[b + 1]], v[k_starts[b]:k_starts[b + 1]]
        else:
            seqlen_k = k_starts[b + 1] - k_starts[b]
            keys, values = read_paged(k, block_table[b], seqlen_k), read_paged(v, block_table[b], seqlen_k)
        rows = slice(q_starts[b], q_starts[b + 1])
        out[rows] = attend_one(q[rows], keys, values, scale, causal)
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
    """q `[B, seqlen_q, H, D]` -> `[B, seqlen_q, H, D]`: request b attends to its first cache_seqlens[b]
    cached tokens, plus the new k, v `[B, seqlen_new, Hkv, D]` if given, first written into the cache
    after them (in place). Without `block_table` the cache is contiguous, `[B, seqlen_cache, Hkv, D]`."""
    reject_unsupported(rotary_cos=rotary_cos, rotary_sin=rotary_sin, cache_batch_idx=cache_batch_idx,
                       cache_leftpad=cache_leftpad, window_size=window_size, softcap=softcap,
                       alibi_slopes=alibi_slopes, return_softmax_lse=return_softmax_lse)
    batch_size = q.shape[0]
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    if block_table is None:  # a contiguous cache is a paged one with one page of seqlen_cache tokens per request
        block_table = torch.arange(batch_size, device=q.device)[:, None]
    if cache_seqlens is None:  # the whole cache
        cache_seqlens = block_table.shape[1] * k_cache.shape[1]
    seqlens = [cache_seqlens] * batch_size if isinstance(cache_seqlens, int) else cache_seqlens.tolist()
    out = q.new_zeros(*q.shape[:-1], v_cache.shape[-1])
    for b, seqlen in enumerate(seqlens):
        if k is not None:  # append at positions seqlen, seqlen + 1, ...
            pos = torch.arange(seqlen, seqlen + k.shape[1], device=q.device)
            blocks = block_table[b].long()[pos // k_cache.shape[1]]
            k_cache[blocks, pos % k_cache.shape[1]] = k[b]
            v_cache[blocks, pos % v_cache.shape[1]] = v[b]
            seqlen += k.shape[1]
        keys, values = read_paged(k_cache, block_table[b], seqlen), read_paged(v_cache, block_table[b], seqlen)
        out[b] = attend_one(q[b], keys, values, scale, causal)
    return out
