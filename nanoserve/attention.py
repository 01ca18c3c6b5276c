"""Attention over a paged KV cache. Each step writes its new k, v into their slots. Then every query
attends to all keys of its request, read from the cache.

The KV cache of one layer is two tensors, `k_cache` and `v_cache`, of shape
`[num_blocks, block_size, num_kv_heads, head_dim]` (flash-attn's paged layout). Token `p` of a
request lives in block `block_tables[b][p // block_size]` at offset `p % block_size`. That is the
flat slot `block_id * block_size + offset`. `slot_mapping` names the slot of each new token.

Block 0 is the null block. The block manager never hands it out, so no request's `slot_mapping` entry
points into it. 0 pads the rows of `block_tables`. No request may write block 0, because padding is read:
- The torch backend copies whole rows of a decode group's table, padding included. Then it masks the
  keys past each request's own with -inf.
- A mask removes a key only if what was read is finite (-inf + inf and 0 * inf are NaN).
- Every request's padding reads the same block 0. Kept at the zeros the cache starts with, it is masked
  away harmlessly. One non-finite write there would reach them all.
(The padding rows of a CUDA graph do write its slot 0. That is cuda_graphs.py, with the flash backend
alone, which reads only each request's own keys.)

Invariants both backends keep:
  * Causal masks are aligned bottom-right. With seqlen_q queries and seqlen_k keys, query i sees
    key j iff j <= i + seqlen_k - seqlen_q (a prefill chunk sits at the end of its keys).
  * Query head h reads kv head h // (num_heads // num_kv_heads) (grouped-query attention).
  * A query that sees no key at all gets a zero output, as flash-attn returns.

Two backends share one shape:
- `prepare(batch, block_size, dtype)` runs once per step. It returns what every layer's attention
  shares (its metadata).
- `forward(q, k, v, kv_cache, layer, metadata, window)` runs per layer. It gets the whole cache and the
  layer's index, and takes `kv_cache[0, layer]` and `kv_cache[1, layer]` itself (models/llama.py says why).
  `window` is the layer's sliding window, or None (sliding_window.py).

"flash" calls the flash-attn package's kernels (CUDA, flash_backend.py). "torch" runs anywhere, in plain
PyTorch. Its metadata is an `AttentionPlan`: which requests attend together, the blocks each reads, the masks.
`plan_attention` builds it from the host-side lengths. Decode rows are sorted by context length and
attended in groups of ~8. Each group is padded only to its own longest context. A prompt (chunk) is
attended on its own. Both backends are checked against the plain per-request formulation in
tests/flash_reference.py.
"""

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from nanoserve.batch import Batch
from nanoserve.config import cdiv
from nanoserve.device import upload
from nanoserve.flash_backend import FlashBackend, why_not_flash
from nanoserve.kv_cache import store_kvcache
from nanoserve.layers.softcap import attend_softcapped
from nanoserve.sliding_window import window_bias, window_mask
from nanoserve.triton_backend import TritonBackend, TritonMetadata, choose_backend

# ----------------------------------------------------------------------------- the torch backend

def gather_blocks(cache: Tensor, block_table: Tensor) -> Tensor:
    """Every block of each row of `block_table` `[B, num_blocks]`, copied out of the cache.
    Returns `[B, num_blocks * block_size, Hkv, D]`. Callers cut the table to the blocks they need."""
    # index_select on the block axis copies whole blocks, several times faster on CPU than
    # advanced indexing: [B * num_blocks, block_size, Hkv, D] -> [B, num_blocks * block_size, Hkv, D]
    return cache.index_select(0, block_table.flatten()).view(block_table.shape[0], -1, *cache.shape[2:])


def causal_mask(seqlen_q: int, seqlen_k: int, device: torch.device) -> Tensor:
    """`[seqlen_q, seqlen_k]` bool, bottom-right aligned: query i sees key j iff j <= i + seqlen_k - seqlen_q."""
    return torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=device).tril(seqlen_k - seqlen_q)


def attend(q: Tensor, k: Tensor, v: Tensor, scale: float,
           mask: Tensor | None = None, is_causal: bool = False, softcap: float = 0.0) -> Tensor:
    """q `[B, Sq, H, D]`, k, v `[B, L, Hkv, D]` -> `[B, Sq, H, D]`, one SDPA call for the batch. A nonzero
    softcap caps the scores (Gemma 2), which SDPA cannot: layers/softcap.py writes attention out then."""
    if softcap:
        return attend_softcapped(q, k, v, scale, softcap, mask, is_causal)
    # SDPA wants heads before length: [B, heads, len, D]
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=True)
    return out.transpose(1, 2)  # [B, Sq, H, D]


@dataclass(frozen=True)
class DecodeGroup:
    """Requests with one query each and similar context lengths: one SDPA call for all of them."""
    rows: Tensor         # [R] int64, their rows of q
    block_table: Tensor  # [R, num_blocks]: only the blocks the longest of them needs, padded with block 0
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
    """The torch backend's metadata: what every layer's attention shares in one step.
    `plan_attention` builds it once per step. Requests without a key appear in no group, so their
    output stays 0."""
    slot_mapping: Tensor  # [N] where the step's k, v are written (store_kvcache)
    decode_groups: list[DecodeGroup]
    prefill_requests: list[PrefillRequest]


# How many decode rows attend together. A group is padded to its longest context, and its copied keys
# and values should still be in cache when SDPA reads them: groups of about 8 rows measured fastest on
# CPU in both dtypes (figures: docs/performance.md, "Offline").
DECODE_GROUP_ROWS = 8


def plan_attention(batch: Batch, block_size: int, dtype: torch.dtype) -> AttentionPlan:
    """Group the step's requests for `paged_attention`. It uses the lengths the host holds, so nothing
    is read back from the device."""
    device = batch.block_tables.device
    starts, k_lens = batch.query_start_loc_cpu, batch.seq_lens_cpu  # request b's queries: rows starts[b]:starts[b + 1]
    q_lens = np.diff(starts)
    # decode rows, shortest context first, cut into groups of about equal count
    decode = np.flatnonzero((q_lens == 1) & (k_lens > 0))
    decode = decode[np.argsort(k_lens[decode], kind="stable")]
    groups = []
    for chunk in np.array_split(decode, cdiv(len(decode), DECODE_GROUP_ROWS)) if len(decode) else []:
        # its requests, their rows of q and their key counts: one non_blocking copy to the device
        index = upload(dict(requests=chunk, rows=starts[chunk], seqlens_k=k_lens[chunk]), torch.int64, device)
        num_blocks = cdiv(int(k_lens[chunk[-1]]), block_size)  # the group's longest context
        padding = torch.arange(num_blocks * block_size, device=device) >= index["seqlens_k"][:, None]  # [R, L]
        bias = torch.zeros_like(padding, dtype=dtype).masked_fill(padding, float("-inf"))
        table = batch.block_tables.index_select(0, index["requests"])[:, :num_blocks]  # [R, num_blocks]
        groups.append(DecodeGroup(index["rows"], table, bias[:, None, None]))  # bias as [R, 1, 1, L]
    prefills = []
    for b in np.flatnonzero((q_lens > 1) & (k_lens > 0)).tolist():
        # With seqlen_q >= seqlen_k, the first seqlen_q - seqlen_k queries see no key (output 0).
        # The others form a square, where SDPA's top-left causal mask is the bottom-right one.
        seqlen_k, end = int(k_lens[b]), int(starts[b + 1])
        start = max(int(starts[b]), end - seqlen_k)
        mask = None if end - start == seqlen_k else causal_mask(end - start, seqlen_k, device)
        table = batch.block_tables[b:b + 1, :cdiv(seqlen_k, block_size)]
        prefills.append(PrefillRequest(start, end, table, seqlen_k, mask))
    return AttentionPlan(batch.slot_mapping, groups, prefills)


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, plan: AttentionPlan, scale: float,
                    softcap: float = 0.0, window: int | None = None) -> Tensor:
    """q `[N, H, D]` -> `[N, H, D]`, attending as `plan` says. Each request's keys and values are
    copied out of the cache once (whole blocks) and read once by SDPA. With a sliding window, each query
    sees only the last `window` keys."""
    if q.shape[0] == 1 and plan.decode_groups:  # one request decoding (the latency case): its rows are the output
        return attend_decode_group(q, k_cache, v_cache, plan.decode_groups[0], scale, softcap, window)
    out = q.new_zeros(q.shape)  # [N, H, D]
    for group in plan.decode_groups:
        q_group = q.index_select(0, group.rows)  # [R, H, D]
        out.index_copy_(0, group.rows, attend_decode_group(q_group, k_cache, v_cache, group, scale, softcap, window))
    for r in plan.prefill_requests:
        keys = gather_blocks(k_cache, r.block_table)[:, :r.seqlen_k]  # [1, seqlen_k, Hkv, D]
        values = gather_blocks(v_cache, r.block_table)[:, :r.seqlen_k]
        mask = r.mask if window is None else window_mask(r.end - r.start, r.seqlen_k, window, q.device)
        out[r.start:r.end] = attend(q[None, r.start:r.end], keys, values, scale, mask, mask is None, softcap)[0]
    return out


def attend_decode_group(q_group: Tensor, k_cache: Tensor, v_cache: Tensor, group: DecodeGroup, scale: float,
                        softcap: float, window: int | None) -> Tensor:
    """The group's rows of q `[R, H, D]` -> `[R, H, D]`, one SDPA call over their copied-out blocks."""
    keys = gather_blocks(k_cache, group.block_table)  # [R, num_blocks * block_size, Hkv, D]
    values = gather_blocks(v_cache, group.block_table)
    bias = group.bias if window is None else window_bias(group.bias, window)
    queries = q_group[:, None]  # [R, 1, H, D]
    if q_group.device.type == "cpu":  # upcast the copies it reads: in bfloat16 and float16 at one query
        # per request, SDPA took 1.5-7x float32's time there (docs/performance.md, "Where a decode step's time goes")
        queries, keys, values, bias = queries.float(), keys.float(), values.float(), bias.float()
    return attend(queries, keys, values, scale, bias, softcap=softcap)[:, 0].to(q_group.dtype)


class TorchBackend:
    """Plain PyTorch on any device: SDPA over blocks copied out of the cache, as the step's plan says."""

    def __init__(self, scale: float, softcap: float = 0.0) -> None:
        self.scale, self.softcap = scale, softcap  # softcap: Gemma 2's (attend); 0: none

    prepare = staticmethod(plan_attention)  # (batch, block_size, dtype) -> the step's AttentionPlan

    def forward(self, q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor, layer: int, plan: AttentionPlan,
                window: int | None = None) -> Tensor:
        """q `[N, H, D]`, k, v `[N, Hkv, D]` -> `[N, H, D]`; `window`: the layer's sliding window, if any."""
        k_cache, v_cache = kv_cache[:, layer]  # this layer's [num_blocks, block_size, Hkv, D] each
        store_kvcache(k, v, k_cache, v_cache, plan.slot_mapping)
        return paged_attention(q, k_cache, v_cache, plan, self.scale, self.softcap, window)


AttentionBackend = TorchBackend | FlashBackend | TritonBackend  # triton: our own kernel, triton_backend.py
AttentionMetadata = AttentionPlan | Batch | TritonMetadata  # what each backend's prepare returns
BACKENDS = {"torch": TorchBackend, "flash": FlashBackend, "triton": TritonBackend}


# ----------------------------------------------------------------------------- choosing a backend

def select_attention(name: str, block_size: int | str, device: torch.device, dtype: torch.dtype,
                     head_dim: int) -> tuple[str, int]:
    """Resolve the attention backend ("auto" | "torch" | "flash" | "triton") and block_size (an int or
    "auto") together. A choice that cannot serve fails here, at start-up, not mid-run.

    flash-attn pages its KV cache in whole 256-token blocks. So "auto" takes flash with block_size 256
    wherever flash-attn 2 can run. Elsewhere it takes block_size 16 (vLLM's default). The backend is then
    triton on CUDA where triton is importable (triton_backend.choose_backend), and torch everywhere else
    (CPU, MPS)."""
    if name not in ("auto", *BACKENDS):
        raise ValueError(f"unknown attention backend {name!r}; choose 'auto', 'torch', 'flash' or 'triton'")
    why_not = "attention_backend='torch'" if name == "torch" else why_not_flash(device, dtype, head_dim)
    block_size = (16 if why_not else 256) if block_size == "auto" else block_size
    if block_size % 256:
        why_not = why_not or f"block_size={block_size} is not a multiple of 256 (a flash-attn page)"
    if name == "flash" and why_not:
        raise ValueError(f"the flash attention backend cannot run here: {why_not}")
    # flash where it runs; else the triton kernel on CUDA, the torch backend elsewhere (triton_backend.py)
    return choose_backend(name, device, dtype, flash_runs=why_not is None), block_size
