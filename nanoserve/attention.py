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

The torch backend's fast path is `paged_attention`, which follows an `AttentionPlan`: what is the
same in every layer of a step (which requests attend together, the blocks each reads, the masks),
built once per step from host-side lengths by `plan_attention`. Decode rows are sorted by context
length and attended in groups of ~8, each padded only to its own longest context; a prompt (chunk)
is attended on its own. `attend_each_request` is the plain per-request formulation the tests
hold the fast path to.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from nanoserve.config import cdiv

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


def gather_blocks(cache: Tensor, block_table: Tensor) -> Tensor:
    """Every block of each row of `block_table` `[B, num_blocks]`, copied out of the cache:
    `[B, num_blocks * block_size, Hkv, D]`. Callers cut the table to the blocks they need."""
    # index_select on the block axis copies whole blocks, several times faster on CPU than
    # advanced indexing: [B * num_blocks, block_size, Hkv, D] -> [B, num_blocks * block_size, Hkv, D]
    return cache.index_select(0, block_table.flatten()).view(block_table.shape[0], -1, *cache.shape[2:])


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return max(1, cdiv(num_tokens, block_size))  # at least one block, so the key axis is never empty


def causal_mask(seqlen_q: int, seqlen_k: int, device: torch.device) -> Tensor:
    """`[seqlen_q, seqlen_k]` bool, bottom-right aligned: query i sees key j iff j <= i + seqlen_k - seqlen_q."""
    key_pos = torch.arange(seqlen_k, device=device)
    query_pos = torch.arange(seqlen_q, device=device)[:, None]
    return key_pos <= query_pos + seqlen_k - seqlen_q


def attend(q: Tensor, k: Tensor, v: Tensor, scale: float,
           mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
    """q `[B, Sq, H, D]`, k, v `[B, L, Hkv, D]` -> `[B, Sq, H, D]`, one SDPA call for the batch."""
    # SDPA wants heads before length: [B, heads, len, D]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)  # [B, Sq, H, D]


def attend_each_request(q: Tensor, k_cache: Tensor, v_cache: Tensor, q_lens: list[int], k_lens: list[int],
                        block_table: Tensor, causal: bool, scale: float) -> Tensor:
    """The plain formulation, one request at a time, kept as the reference the tests hold
    `paged_attention` to: q `[sum(q_lens), H, D]` -> `[sum(q_lens), H, D]`."""
    out, start = q.new_zeros(q.shape[0], q.shape[1], v_cache.shape[-1]), 0
    for b, (seqlen_q, seqlen_k) in enumerate(zip(q_lens, k_lens)):
        table = block_table[b:b + 1, :blocks_needed(seqlen_k, k_cache.shape[1])]
        keys = gather_blocks(k_cache, table)[:, :seqlen_k]  # [1, seqlen_k, Hkv, D]
        values = gather_blocks(v_cache, table)[:, :seqlen_k]
        mask = causal_mask(seqlen_q, seqlen_k, q.device) if causal else q.new_ones(seqlen_q, seqlen_k, dtype=torch.bool)
        out_b = attend(q[None, start:start + seqlen_q], keys, values, scale, mask)[0]  # [seqlen_q, H, D]
        out[start:start + seqlen_q] = out_b.masked_fill(~mask.any(-1)[:, None, None], 0.0)  # no key: 0, not NaN
        start += seqlen_q
    return out


# ----------------------------------------------------------------------------- the fast path: a plan per step

@dataclass(frozen=True)
class DecodeGroup:
    """Requests with one query each and similar context lengths: one SDPA call for all of them."""
    rows: Tensor         # [R] int64, their rows of q
    block_table: Tensor  # [R, num_blocks]: only the blocks the longest of them needs
    bias: Tensor         # [R, 1, 1, num_blocks * block_size] q's dtype: 0 for a key, -inf for padding past it


@dataclass(frozen=True)
class PrefillRequest:
    """A request with several queries (a prompt or a prompt chunk): one SDPA call of its own."""
    start: int           # its rows of q are start, ..., end - 1
    end: int
    block_table: Tensor  # [1, num_blocks]: the blocks its keys fill
    seqlen_k: int
    mask: Tensor | None  # [seqlen_q, seqlen_k] bool where bottom-right causal differs from SDPA's is_causal


@dataclass(frozen=True)
class AttentionPlan:
    """What every layer's attention shares in one step, built once per step by `plan_attention`:
    which requests are attended together, the blocks each reads, their masks. Requests without a key
    appear nowhere: their output stays 0."""
    num_rows: int
    causal: bool
    decode_groups: list[DecodeGroup]
    prefill_requests: list[PrefillRequest]


DECODE_GROUP_ROWS = 8


def decode_groups_count(num_rows: int) -> int:
    """How many length groups `num_rows` decode rows split into. A group is padded to its longest
    context, and its copied keys and values should still be in cache when SDPA reads them: groups of
    about 8 rows measured fastest on a 2-core x86 CPU in both dtypes (48 rows, contexts 16-450, one
    thread: 1.2x faster in bfloat16, 4x in float32 than 2 groups of 24), ~50 us overhead per group."""
    return max(1, cdiv(num_rows, DECODE_GROUP_ROWS))


def plan_attention(q_lens: list[int], k_lens: list[int], block_table: Tensor, block_size: int,
                   causal: bool, dtype: torch.dtype) -> AttentionPlan:
    """Group the requests for `paged_attention`: q_lens, k_lens are each request's query and key
    counts (host lists), block_table `[B, max_blocks]` its cache blocks."""
    device = block_table.device
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    # decode rows, shortest context first, cut into groups of about equal count
    decode = sorted((b for b, n in enumerate(q_lens) if n == 1 and k_lens[b] > 0), key=lambda b: k_lens[b])
    per_group, groups = max(1, cdiv(len(decode), decode_groups_count(len(decode)))), []
    for chunk in (decode[i:i + per_group] for i in range(0, len(decode), per_group)):
        num_blocks = blocks_needed(k_lens[chunk[-1]], block_size)  # the group's longest context
        seqlens_k = torch.tensor([k_lens[b] for b in chunk], device=device)
        padding = torch.arange(num_blocks * block_size, device=device) >= seqlens_k[:, None]  # [R, L]
        bias = torch.zeros(padding.shape, dtype=dtype, device=device).masked_fill(padding, float("-inf"))
        table = block_table[torch.tensor(chunk, device=device), :num_blocks]  # [R, num_blocks]
        rows = torch.tensor([starts[b] for b in chunk], device=device)
        groups.append(DecodeGroup(rows, table, bias[:, None, None, :]))
    prefills = []
    for b in (b for b, n in enumerate(q_lens) if n > 1 and k_lens[b] > 0):
        # with seqlen_q >= seqlen_k the first seqlen_q - seqlen_k queries see no key (output 0) and
        # the others form a square, where SDPA's top-left causal mask is the bottom-right one
        start = starts[b] + (max(0, q_lens[b] - k_lens[b]) if causal else 0)
        square = starts[b + 1] - start == k_lens[b]
        mask = causal_mask(starts[b + 1] - start, k_lens[b], device) if causal and not square else None
        table = block_table[b:b + 1, :blocks_needed(k_lens[b], block_size)]
        prefills.append(PrefillRequest(start, starts[b + 1], table, k_lens[b], mask))
    return AttentionPlan(starts[-1], causal, groups, prefills)


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, plan: AttentionPlan, scale: float) -> Tensor:
    """q `[N, H, D]` -> `[N, H, D]`, attending as `plan` says. Each request's keys and values are
    copied out of the cache once (whole blocks) and read once by SDPA."""
    if plan.num_rows == 1 and plan.decode_groups:  # one request decoding (the latency case): its
        return attend_decode_group(q, k_cache, v_cache, plan.decode_groups[0], scale)  # rows are the output
    out = q.new_zeros(plan.num_rows, q.shape[1], v_cache.shape[-1])  # [N, H, D]
    for group in plan.decode_groups:
        q_group = q.index_select(0, group.rows)  # [R, H, D]
        out.index_copy_(0, group.rows, attend_decode_group(q_group, k_cache, v_cache, group, scale))
    for r in plan.prefill_requests:
        keys = gather_blocks(k_cache, r.block_table)[:, :r.seqlen_k]  # [1, seqlen_k, Hkv, D]
        values = gather_blocks(v_cache, r.block_table)[:, :r.seqlen_k]
        is_causal = plan.causal and r.mask is None
        out[r.start:r.end] = attend(q[None, r.start:r.end], keys, values, scale, r.mask, is_causal)[0]
    return out


def attend_decode_group(q_group: Tensor, k_cache: Tensor, v_cache: Tensor, group: DecodeGroup, scale: float) -> Tensor:
    """The group's rows of q `[R, H, D]` -> `[R, H, D]`, one SDPA call over their copied-out blocks."""
    keys = gather_blocks(k_cache, group.block_table)  # [R, num_blocks * block_size, Hkv, D]
    values = gather_blocks(v_cache, group.block_table)
    return attend(q_group[:, None], keys, values, scale, group.bias)[:, 0]  # queries as [R, 1, H, D]


# ----------------------------------------------------------------------------- flash-attn's two entry points

def flash_attn_varlen_func(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float = 0.0,
                           softmax_scale: float | None = None, causal: bool = False,
                           window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
                           alibi_slopes: Tensor | None = None, deterministic: bool = False,
                           return_attn_probs: bool = False, block_table: Tensor | None = None) -> Tensor:
    """flash-attn's varlen attention: q `[total_q, H, D]` -> `[total_q, H, D]`.

    k, v are packed `[total_k, Hkv, D]`, or paged caches when `block_table` is given.
    """
    reject_unsupported(dropout_p=dropout_p, window_size=window_size, softcap=softcap,
                       alibi_slopes=alibi_slopes, return_attn_probs=return_attn_probs)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    q_starts, k_starts = torch.stack((cu_seqlens_q, cu_seqlens_k)).tolist()  # the one host sync
    q_lens = [end - start for start, end in zip(q_starts, q_starts[1:])]
    k_lens = [end - start for start, end in zip(k_starts, k_starts[1:])]
    if block_table is None:
        # Packed k, v are a paged cache of one-token blocks, request b owning blocks k_starts[b], ...
        k, v = k[:, None], v[:, None]  # [total_k, 1, Hkv, D]
        index = torch.tensor(k_starts[:-1], device=q.device)[:, None] + torch.arange(max(1, *k_lens), device=q.device)
        block_table = index.clamp(max=k.shape[0] - 1)  # [B, max_k]; past a request's keys: never read
    plan = plan_attention(q_lens, k_lens, block_table, k.shape[1], causal, q.dtype)
    return paged_attention(q, k, v, plan, scale)


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
    which are first written into the cache after them).
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
    plan = plan_attention([seqlen_q] * batch_size, cache_seqlens.tolist(), block_table, block_size, causal, q.dtype)
    out = paged_attention(q.flatten(0, 1), k_cache, v_cache, plan, scale)  # [B * seqlen_q, H, D]
    return out.view(q.shape[:-1] + v_cache.shape[-1:])


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
        self.backend = backend
        self.varlen, self.with_kvcache = load_backend(backend)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                batch: Batch, plan: AttentionPlan | None = None) -> Tensor:
        """q `[N, H, D]`, k, v `[N, Hkv, D]` -> `[N, H, D]`. The torch backend follows `plan`, built
        once per step by the model (`plan_for_batch`), or here if none is given."""
        store_kvcache(k, v, k_cache, v_cache, batch.slot_mapping)
        if self.backend == "torch":
            plan = plan or plan_for_batch(batch, k_cache.shape[1], q.dtype)
            return paged_attention(q, k_cache, v_cache, plan, self.scale)
        if batch.is_decode_only:  # N == B: one query per request, all keys already in the cache
            out = self.with_kvcache(q.unsqueeze(1), k_cache, v_cache,  # q as [B, 1, H, D]
                                    cache_seqlens=batch.seq_lens, block_table=batch.block_tables,
                                    softmax_scale=self.scale, causal=True)
            return out.squeeze(1)  # [N, H, D]
        return self.varlen(q, k_cache, v_cache, batch.query_start_loc, batch.cu_seqlens_k,
                           batch.max_query_len, batch.max_seq_len, softmax_scale=self.scale,
                           causal=True, block_table=batch.block_tables)


def plan_for_batch(batch: Batch, block_size: int, dtype: torch.dtype) -> AttentionPlan:
    """The torch backend's plan for one step: the same for every layer, so the model builds it once."""
    q_starts = batch.query_start_loc.tolist()
    q_lens = [end - start for start, end in zip(q_starts, q_starts[1:])]
    return plan_attention(q_lens, batch.seq_lens.tolist(), batch.block_tables, block_size, True, dtype)
