"""A strict pure-PyTorch stand-in for flash-attn 2's two paged-KV entry points, for tests on a CPU.

`FlashReference().flash_attn_varlen_func` and `.flash_attn_with_kvcache` take exactly the arguments of
flash-attn 2.8.3's functions of those names (flash_attn/flash_attn_interface.py) and first check them
the way flash-attn does (csrc/flash_attn/flash_api.cpp: mha_varlen_fwd, mha_fwd_kvcache), raising
FlashCheckError where flash-attn raises. Where flash-attn does NOT check but would read out of bounds,
skip keys or leave output rows unwritten, it raises too (the comments say "flash does not check").
Then it computes the answer the plain way, one request at a time:

  * request b's keys are its first seqlen_k tokens: token p of the paged cache
    `[num_blocks, page_block_size, num_heads_k, head_dim]` sits in block `block_table[b, p // page]`
    at offset `p % page`;
  * causal masks are aligned bottom-right: query i sees key j iff j <= i + seqlen_k - seqlen_q;
  * window_size=(left, right) (flash_api.cpp, csrc/flash_attn/src/mask.h): query i, at key position
    p = i + seqlen_k - seqlen_q, sees key j iff p - left <= j <= p + right, a side of -1 unbounded; causal
    sets right to 0, so a window of w keys, the query's own included, is (w - 1, 0);
  * query head h reads key/value head h // (num_heads // num_heads_k) (grouped-query attention);
  * a query that sees no key gets output 0 and softmax_lse +inf, as flash-attn returns.

Two knobs, off by default so that the default is as strict as flash-attn on a GPU:
  page_multiple=256   flash-attn 2 needs page_block_size % 256 == 0; tiny CPU tests may pass e.g. 1
  allow_float32=False flash-attn 2 takes fp16/bf16 only; float32 lets CPU tests be exact
Every call is logged in `calls` (q_lens, k_lens, paged), so a test can assert that an engine run
really reached, say, a varlen step mixing prefill chunks, decodes and prefix hits.
"""
from __future__ import annotations

import types
from dataclasses import dataclass, field

import torch
from torch import Tensor

FLASH_DTYPES = (torch.float16, torch.bfloat16)


class FlashCheckError(RuntimeError):
    """An input flash-attn 2 rejects (RuntimeError, as its TORCH_CHECK raises) or mishandles silently."""


def check(ok: bool, message: str) -> None:
    if not ok:
        raise FlashCheckError(message)


def unsupported(name: str, value: object, default: object) -> None:
    """Options flash-attn has but this reference does not model."""
    if value is not default and value != default:
        raise NotImplementedError(f"the flash-attn reference does not support {name}={value!r}")


@dataclass
class FlashReference:
    page_multiple: int = 256
    allow_float32: bool = False
    calls: list[dict] = field(default_factory=list)

    # ------------------------------------------------------------------ flash_attn_varlen_func

    def flash_attn_varlen_func(self, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                               softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False,
                               block_table=None):
        """q `[total_q, H, D]`; k, v `[total_k, Hkv, D]` packed, or paged caches when block_table is given.
        Returns out `[total_q, H, D]`, or (out, softmax_lse `[H, total_q]`, S_dmask) with return_attn_probs."""
        unsupported("dropout_p", dropout_p, 0.0)
        window = check_window(window_size)
        unsupported("alibi_slopes", alibi_slopes, None)
        paged = block_table is not None
        self.check_dtypes(q, k, v)
        for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
            check_int32_vector(name, t, q.device)
        check(q.dim() == 3, f"q must be [total_q, num_heads, head_dim], got shape {tuple(q.shape)}")
        batch_size, (total_q, num_heads, head_dim) = cu_seqlens_q.numel() - 1, q.shape
        check(batch_size > 0, "batch size must be positive")
        check(cu_seqlens_k.shape == (batch_size + 1,), "cu_seqlens_k must have shape (batch_size + 1)")
        if paged:
            self.check_paged_cache(k, v, block_table, batch_size, head_dim, q.device)
        else:
            check(k.dim() == 3 and k.shape[2] == head_dim and v.shape == k.shape,
                  f"k, v must be [total_k, num_heads_k, head_dim={head_dim}], got {tuple(k.shape)}, {tuple(v.shape)}")
        num_heads_k = k.shape[-2]
        check_heads(num_heads, num_heads_k, head_dim)
        q_starts, k_starts = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()  # the reference may sync
        q_lens, k_lens = lengths("cu_seqlens_q", q_starts), lengths("cu_seqlens_k", k_starts)
        # flash does not check these: rows past cu_seqlens_q[-1] stay unwritten (torch.empty), and
        # max_seqlen_q / max_seqlen_k size the kernel's grid and key splits, so an understated one
        # leaves query rows unwritten or keys unread.
        check(q_starts[-1] == total_q, f"cu_seqlens_q[-1]={q_starts[-1]} must equal total_q={total_q}")
        check_max_seqlen("max_seqlen_q", max_seqlen_q, q_lens)
        check_max_seqlen("max_seqlen_k", max_seqlen_k, k_lens)
        if paged:
            self.check_blocks_cover(block_table, k_lens, k.shape[0], k.shape[1])
            keys = [gather_paged(k, block_table[b], n) for b, n in enumerate(k_lens)]
            values = [gather_paged(v, block_table[b], n) for b, n in enumerate(k_lens)]
        else:
            check(k_starts[-1] <= k.shape[0], f"cu_seqlens_k[-1]={k_starts[-1]} is past total_k={k.shape[0]}")
            keys = [k[start:start + n] for start, n in zip(k_starts, k_lens)]
            values = [v[start:start + n] for start, n in zip(k_starts, k_lens)]
        self.calls.append(dict(fn="varlen", q_lens=q_lens, k_lens=k_lens, paged=paged, causal=causal))
        scale = head_dim ** -0.5 if softmax_scale is None else softmax_scale
        out = q.new_zeros(total_q, num_heads, head_dim)
        lse = torch.full((num_heads, total_q), float("inf"), dtype=torch.float32, device=q.device)
        for b, (start, n) in enumerate(zip(q_starts, q_lens)):
            rows = slice(start, start + n)
            out[rows], lse[:, rows] = attend(q[rows], keys[b], values[b], causal, scale, softcap, window)
        if return_attn_probs:  # S_dmask is only filled with dropout, which is refused above
            return out, lse, torch.empty(0, dtype=q.dtype, device=q.device)
        return out

    # ------------------------------------------------------------------ flash_attn_with_kvcache

    def flash_attn_with_kvcache(self, q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                                cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None, block_table=None,
                                softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                                rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False):
        """q `[B, seqlen_q, H, D]`; request b attends to its first cache_seqlens[b] cached tokens, plus
        the new k, v `[B, seqlen_new, Hkv, D]` if given, which are first written into the cache after them.
        Returns out `[B, seqlen_q, H, D]`, or (out, softmax_lse `[B, H, seqlen_q]`) with return_softmax_lse."""
        paged = block_table is not None
        check(not (paged and cache_batch_idx is not None), "Paged KVcache does not support cache_batch_idx")
        check(not (paged and cache_leftpad is not None),
              "We don't support Paged KV and leftpad_k running at the same time yet")
        for name, value, default in (("rotary_cos", rotary_cos, None), ("rotary_sin", rotary_sin, None),
                                     ("cache_batch_idx", cache_batch_idx, None), ("cache_leftpad", cache_leftpad, None),
                                     ("alibi_slopes", alibi_slopes, None)):
            unsupported(name, value, default)
        window = check_window(window_size)
        check(isinstance(num_splits, int) and num_splits <= 128, f"num_splits > 128 not supported, got {num_splits!r}")
        self.check_dtypes(q, k_cache, v_cache)
        check(q.dim() == 4, f"q must be [batch_size, seqlen_q, num_heads, head_dim], got shape {tuple(q.shape)}")
        batch_size, seqlen_q, num_heads, head_dim = q.shape
        check(batch_size > 0, "batch size must be positive")
        if paged:
            self.check_paged_cache(k_cache, v_cache, block_table, batch_size, head_dim, q.device)
            capacity = block_table.shape[1] * k_cache.shape[1]  # the most tokens a row of block_table holds
        else:  # a contiguous cache [batch_size_cache, seqlen_cache, Hkv, D]: request b owns row b
            check(k_cache.dim() == 4 and k_cache.shape[3] == head_dim and v_cache.shape == k_cache.shape,
                  f"k_cache, v_cache must be [batch, seqlen, num_heads_k, head_dim={head_dim}]")
            check(k_cache.shape[0] >= batch_size, "the cache has fewer rows than q's batch (flash does not check)")
            capacity = k_cache.shape[1]
        check_heads(num_heads, k_cache.shape[2], head_dim)
        seqlens = self.cache_lengths(cache_seqlens, batch_size, capacity, paged, q.device)
        seqlen_new = self.check_new_kv(k, v, q, k_cache, cache_seqlens, capacity)
        k_lens = [n + seqlen_new for n in seqlens]
        # flash-attn <= 2.8.3 does not check this (2.8.4 does): block_table would be read out of bounds
        check(max(k_lens) <= capacity, f"max(cache_seqlens) + seqlen_new = {max(k_lens)} exceeds the {capacity} "
                                       "tokens block_table (or the cache) can hold")
        if paged:
            self.check_blocks_cover(block_table, k_lens, k_cache.shape[0], k_cache.shape[1])
            table = block_table
        else:  # a contiguous cache is a paged one whose block b, of capacity tokens, is request b's
            table = torch.arange(batch_size, device=q.device)[:, None]
        if k is not None:
            append_new_kv(k, v, k_cache, v_cache, table, seqlens)
        self.calls.append(dict(fn="kvcache", q_lens=[seqlen_q] * batch_size, k_lens=k_lens, paged=paged, causal=causal))
        scale = head_dim ** -0.5 if softmax_scale is None else softmax_scale
        out = q.new_zeros(batch_size, seqlen_q, num_heads, head_dim)
        lse = torch.full((batch_size, num_heads, seqlen_q), float("inf"), dtype=torch.float32, device=q.device)
        for b, n in enumerate(k_lens):
            keys, values = gather_paged(k_cache, table[b], n), gather_paged(v_cache, table[b], n)
            out[b], lse[b] = attend(q[b], keys, values, causal, scale, softcap, window)
        return (out, lse) if return_softmax_lse else out

    # ------------------------------------------------------------------ checks shared by both

    def check_dtypes(self, q: Tensor, k: Tensor, v: Tensor) -> None:
        allowed = FLASH_DTYPES + ((torch.float32,) if self.allow_float32 else ())
        check(q.dtype in allowed, f"FlashAttention only support fp16 and bf16 data type, got {q.dtype}")
        check(k.dtype == q.dtype, "query and key must have the same dtype")
        check(v.dtype == q.dtype, "query and value must have the same dtype")
        check(k.device == q.device and v.device == q.device, "q, k and v must be on the same device")

    def check_paged_cache(self, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, batch_size: int,
                          head_dim: int, device: torch.device) -> None:
        """flash-attn's paged layout: caches [num_blocks, page_block_size, Hkv, D], block_table [B, max_blocks]."""
        check(block_table.device == device, "block_table must be on q's device")
        check(block_table.dtype == torch.int32, f"block_table must have dtype torch.int32, got {block_table.dtype}")
        check(block_table.dim() == 2 and block_table.shape[0] == batch_size,
              f"block_table must be [batch_size={batch_size}, max_num_blocks_per_seq], got {tuple(block_table.shape)}")
        # only the last dimension: flash reads rows through block_table.stride(0)
        check(block_table.stride(-1) == 1, "block_table must have contiguous last dimension")
        check(k_cache.dim() == 4 and k_cache.shape[3] == head_dim and v_cache.shape == k_cache.shape,
              f"k_cache, v_cache must be [num_blocks, page_block_size, num_heads_k, head_dim={head_dim}], "
              f"got {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
        # flash_attn_with_kvcache asserts this; varlen would silently copy the whole cache instead
        check(k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1,
              "k_cache, v_cache must have contiguous last dimension")
        check(k_cache.shape[1] % self.page_multiple == 0,
              f"Paged KV cache block size must be divisible by {self.page_multiple}, got {k_cache.shape[1]}")

    def cache_lengths(self, cache_seqlens: Tensor | int | None, batch_size: int, capacity: int, paged: bool,
                      device: torch.device) -> list[int]:
        """Each request's cached token count (before any new k, v) as a host list."""
        if cache_seqlens is None:  # the whole cache
            return [capacity] * batch_size
        if isinstance(cache_seqlens, int):
            # flash-attn <= 2.8.3 builds torch.full((k_cache.shape[0],), ...): num_blocks rows with a paged cache
            check(not paged, "an int cache_seqlens with block_table fails in flash-attn <= 2.8.3; pass a tensor")
            return [cache_seqlens] * batch_size
        check_int32_vector("cache_seqlens", cache_seqlens, device)
        check(cache_seqlens.shape == (batch_size,), f"cache_seqlens must have shape (batch_size={batch_size})")
        seqlens = cache_seqlens.tolist()
        check(min(seqlens) >= 0, f"cache_seqlens must be >= 0, got {seqlens}")
        return seqlens

    def check_new_kv(self, k: Tensor | None, v: Tensor | None, q: Tensor, k_cache: Tensor,
                     cache_seqlens: Tensor | int | None, capacity: int) -> int:
        """The new tokens' count (0 without k, v) after flash-attn's checks on them."""
        if k is None:
            check(v is None, "v was given without k")
            return 0
        check(v is not None, "If key is supplied, value must also be passed in")
        check(cache_seqlens is not None, "If key is supplied, seqlens_k must also be passed in")
        check(q.shape[1] <= capacity, "If key is supplied, it must have seqlen <= the seqlen of the KV cache")
        check(k.dtype == q.dtype and v.dtype == q.dtype, "Key and value must have the same dtype as query")
        expected = (q.shape[0], k.shape[1], k_cache.shape[2], q.shape[3])
        check(k.shape == expected and v.shape == expected, f"k, v must have shape {expected}")
        return k.shape[1]

    def check_blocks_cover(self, block_table: Tensor, k_lens: list[int], num_blocks: int, page: int) -> None:
        """flash does not check: a block id it reads outside [0, num_blocks) is an out-of-bounds read."""
        check(max(k_lens) <= block_table.shape[1] * page,
              f"a request has {max(k_lens)} keys but block_table rows hold only {block_table.shape[1] * page}")
        for b, n in enumerate(k_lens):
            used = block_table[b, :-(-n // page)]  # the blocks holding its n keys
            check(bool(((used >= 0) & (used < num_blocks)).all()),
                  f"block_table row {b} reads blocks {used.tolist()}, outside [0, {num_blocks})")


def check_int32_vector(name: str, t: Tensor, device: torch.device) -> None:
    check(isinstance(t, Tensor), f"{name} must be a tensor, got {type(t).__name__}")
    check(t.dtype == torch.int32, f"{name} must have dtype int32, got {t.dtype}")
    check(t.device == device, f"{name} must be on q's device {device}, got {t.device}")
    check(t.dim() == 1, f"{name} must be 1-D, got shape {tuple(t.shape)}")
    check(t.is_contiguous(), f"{name} must be contiguous")


def check_heads(num_heads: int, num_heads_k: int, head_dim: int) -> None:
    check(head_dim <= 256, f"FlashAttention forward only supports head dimension at most 256, got {head_dim}")
    # flash-attn pads other head dims to a multiple of 8, copying the whole paged cache on every call
    check(head_dim % 8 == 0, f"head_dim must be a multiple of 8 for flash-attn's paged path, got {head_dim}")
    check(num_heads % num_heads_k == 0, "Number of heads in key/value must divide number of heads in query")


def lengths(name: str, starts: list[int]) -> list[int]:
    """Per-request lengths from cumulative starts [0, ...]."""
    check(starts[0] == 0, f"{name} must start at 0, got {starts[0]}")
    lens = [end - start for start, end in zip(starts, starts[1:])]
    check(min(lens) >= 0, f"{name} must be non-decreasing, got {starts}")
    return lens


def check_max_seqlen(name: str, value: object, lens: list[int]) -> None:
    check(isinstance(value, int) and not isinstance(value, bool), f"{name} must be an int, got {value!r}")
    check(value >= max(lens), f"{name}={value} is below the longest sequence ({max(lens)}); flash does not check")


def gather_paged(cache: Tensor, table_row: Tensor, n: int) -> Tensor:
    """The first n tokens of a request from a paged cache [num_blocks, page, Hkv, D] -> [n, Hkv, D]."""
    page = cache.shape[1]
    positions = torch.arange(n, device=cache.device)
    blocks = table_row.long()[positions // page]  # [n]: the block of each token
    return cache[blocks, positions % page]


def append_new_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, table: Tensor, seqlens: list[int]) -> None:
    """Write request b's new k, v `[seqlen_new, Hkv, D]` at its positions seqlens[b], seqlens[b] + 1, ..."""
    page = k_cache.shape[1]
    for b, start in enumerate(seqlens):
        positions = torch.arange(start, start + k.shape[1], device=k.device)
        blocks = table[b].long()[positions // page]
        k_cache[blocks, positions % page] = k[b]
        v_cache[blocks, positions % page] = v[b]


def check_window(window_size: object) -> tuple[int, int]:
    """flash-attn's window_size as (left, right): two ints, each -1 (unbounded) or >= 0."""
    check(isinstance(window_size, (tuple, list)) and len(window_size) == 2
          and all(isinstance(side, int) and side >= -1 for side in window_size),
          f"window_size must be two ints, each -1 or >= 0, got {window_size!r}")
    return tuple(window_size)


def attend(q: Tensor, keys: Tensor, values: Tensor, causal: bool, scale: float, softcap: float = 0.0,
           window: tuple[int, int] = (-1, -1)) -> tuple[Tensor, Tensor]:
    """One request, computed in float32 like flash-attn's accumulators: q `[Sq, H, D]`, keys, values
    `[Sk, Hkv, D]` -> out `[Sq, H, D]` in q's dtype, softmax_lse `[H, Sq]` (+inf where no key is seen).
    A nonzero softcap caps the scores as flash-attn does: tanh(scores / softcap) * softcap, before the mask."""
    seqlen_q, num_heads, _ = q.shape
    seqlen_k, num_heads_k, _ = keys.shape
    group = num_heads // num_heads_k
    k = keys.float().repeat_interleave(group, dim=1)  # [Sk, H, D]: query head h reads kv head h // group
    v = values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k) * scale  # [H, Sq, Sk]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    key_pos = torch.arange(seqlen_k, device=q.device)
    # [Sq, 1]: each query's own key position (bottom-right alignment)
    query_pos = torch.arange(seqlen_q, device=q.device)[:, None] + seqlen_k - seqlen_q
    left, right = window[0], 0 if causal else window[1]
    seen = torch.ones_like(key_pos <= query_pos)  # [Sq, Sk]
    if right >= 0:
        seen &= key_pos <= query_pos + right
    if left >= 0:
        seen &= key_pos >= query_pos - left
    scores = scores.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, Sq]: -inf for a query that sees nothing
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # such a row is all NaN: make it 0
    out = torch.einsum("hqk,khd->qhd", probs, v)  # [Sq, H, D]
    return out.to(q.dtype), lse.masked_fill(~seen.any(-1), float("inf"))


def fake_flash_attn_module(reference: FlashReference, version: str = "2.8.3") -> types.ModuleType:
    """A stand-in `flash_attn` module (for sys.modules) whose two functions are `reference`'s."""
    module = types.ModuleType("flash_attn")
    module.__version__ = version
    module.flash_attn_varlen_func = reference.flash_attn_varlen_func
    module.flash_attn_with_kvcache = reference.flash_attn_with_kvcache
    return module


STRICT = FlashReference()
flash_attn_varlen_func = STRICT.flash_attn_varlen_func
flash_attn_with_kvcache = STRICT.flash_attn_with_kvcache
