"""Paged attention in Triton. It runs the step's whole flat batch, prompt chunks and decodes together,
in one launch per layer. It reads every key and value where it sits in the paged KV cache.

The kernel reads the Batch's own arrays (batch.py) as tensors: `query_start_loc`, `seq_lens` and
`block_tables`. No per-request Python runs, and no KV is copied out of the cache. (The torch backend in
attention.py copies. It stays the plain reference the tests compare with.)

Who reads what. The flat batch's N query rows are cut into tiles of BLOCK_Q rows. Each request starts
a new tile, so a tile never mixes two requests. One program owns one (query tile, KV head):

    q rows:        | request 0: 5 queries | 1 | request 2: 7 queries      |    (BLOCK_Q = 4)
    query tiles:   | tile 0     | tile 1  | 2 | tile 3       | tile 4     |    tile 5: spare
    grid:          (N // BLOCK_Q + B, num_kv_heads): enough tiles for any lengths; spare programs exit
    request b's first tile: query_start_loc[b] // BLOCK_Q + b (a binary search finds a tile's request)

    program (tile t of request b, KV head g):
        its rows:  the tile's queries x the query heads that read KV head g (grouped-query attention)
                   = BLOCK_M rows of one [BLOCK_M, head_dim] tile of q
        its keys:  positions 0, 1, ... up to the last one its last query sees, TILE_N at a time;
                   key p is in block block_tables[b, p // block_size] at offset p % block_size
                   (any block_size: each key finds its own block)
        softmax:   online, as flash-attention's: a running max m, sum l and output acc per row,
                   acc / l written at the end; a row that saw no key has l = 0 and writes 0

Causal masks are aligned bottom-right. The request's queries are its last `query_len` tokens.
So query i (0 = its first) sees key j iff j <= i + seq_len - query_len.
With a sliding window of w keys, it also needs j > i + seq_len - query_len - w. A tile then starts
at its first query's first key. It never reads a block the window has passed.

Writing the step's k and v into the cache is not a kernel of this module. The backend's op stores them
as kv_cache.store_kvcache does: two index_copy_ calls, which CUDA graphs capture and which run on any device.

This module imports triton at its top. It is imported only once the triton backend is chosen
(triton_backend.py), because TRITON_INTERPRET is read when a kernel is defined. (TRITON_INTERPRET runs
the kernels in Triton's interpreter, on a CPU.)
"""

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def find_request(query_start_loc_ptr, num_requests, tile, BLOCK_Q: tl.constexpr):
    """The request that owns query tile `tile`.

    Request b's tiles start at tile query_start_loc[b] // BLOCK_Q + b. The + b is there because each
    request starts a tile of its own. That start grows with b. So the owner is the last request starting
    at or before `tile`, found by binary search."""
    lo: tl.int32 = 0  # invariant: request lo starts at or before `tile`, request hi (if any) after it
    hi = num_requests
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid
        else:
            hi = mid
    return lo


# one compiled kernel for every batch size and table width (triton would specialize ints equal to 1 or divisible by 16)
@triton.jit(do_not_specialize=["num_requests", "block_table_stride"])
def paged_attention_kernel(out_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
                           query_start_loc_ptr, seq_lens_ptr, block_tables_ptr, num_requests, scale, softcap,
                           q_token_stride, q_head_stride, out_token_stride, out_head_stride,
                           cache_block_stride, cache_slot_stride, cache_head_stride, block_table_stride, block_size,
                           window, WINDOWED: tl.constexpr,
                           GROUP: tl.constexpr, GROUP_P: tl.constexpr, HEAD_DIM: tl.constexpr,
                           BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr,
                           DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr):
    """One program per (query tile, KV head). The tile's queries attend to their request's keys through
    its block table. Each query comes with the GROUP query heads that read this KV head.
    GROUP_P is GROUP rounded up to a power of two. A tile holds BLOCK_M // GROUP_P queries.
    With SOFTCAP (Gemma 2) the scores become tanh(scores / softcap) * softcap before the mask.
    tanh is written with exp, since triton has no tanh of its own.
    With WINDOWED each query sees only its last `window` keys, its own included (a sliding window)."""
    BLOCK_Q: tl.constexpr = BLOCK_M // GROUP_P
    tile, kv_head = tl.program_id(0), tl.program_id(1)
    b = find_request(query_start_loc_ptr, num_requests, tile, BLOCK_Q)
    q_start, q_end = tl.load(query_start_loc_ptr + b), tl.load(query_start_loc_ptr + b + 1)
    first = q_start + (tile - q_start // BLOCK_Q - b) * BLOCK_Q  # the tile's first row of q
    if first >= q_end:
        return  # a spare program: its request has fewer tiles than the grid allows for
    seq_len = tl.load(seq_lens_ptr + b)
    context_len = seq_len - (q_end - q_start)  # keys before the request's first query: 0 for a new prompt

    # [BLOCK_M] rows: row r is query `first + r // GROUP_P` with query head `kv_head * GROUP + r % GROUP_P`
    rows = tl.arange(0, BLOCK_M)
    token = first + rows // GROUP_P
    head = kv_head * GROUP + rows % GROUP_P
    row_ok = (token < q_end) & (rows % GROUP_P < GROUP)  # past the request's queries, or a padding head
    last_key = context_len + token - q_start  # [BLOCK_M]: the last key each row sees (bottom-right causal)
    dims = tl.arange(0, BLOCK_D)  # head_dim rounded up to a power of two
    dim_ok = dims < HEAD_DIM
    # a [n] vector meets a [m, 1] column as a [1, n] row (triton broadcasts as numpy does): rows are written bare
    q_ok = row_ok[:, None] & dim_ok  # [BLOCK_M, BLOCK_D]: the rows and dims q and out hold
    q = tl.load(q_ptr + token[:, None] * q_token_stride + head[:, None] * q_head_stride + dims,
                mask=q_ok, other=0.0)  # [BLOCK_M, BLOCK_D]

    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of each row's scores
    row_sum = tl.zeros([BLOCK_M], tl.float32)                # running sum of exp(score - row_max)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)           # running sum of exp(score - row_max) * value
    # the keys the tile's last query sees (seq_len where that is the request's last): no program reads past them
    num_keys = context_len + tl.minimum(first + BLOCK_Q, q_end) - q_start
    table = block_tables_ptr + b * block_table_stride
    lowest_key = 0  # the first key any row of the tile sees: with a window, its first query's window start
    if WINDOWED:
        lowest_key = tl.maximum(context_len + first - q_start - window + 1, 0)
    for key_start in range(lowest_key, num_keys, TILE_N):
        keys = key_start + tl.arange(0, TILE_N)  # [TILE_N] positions in the request
        key_ok = keys < num_keys
        block = tl.load(table + keys // block_size, mask=key_ok, other=0).to(tl.int64)  # [TILE_N]
        cache = block * cache_block_stride + (keys % block_size) * cache_slot_stride + kv_head * cache_head_stride
        k = tl.load(k_cache_ptr + cache + dims[:, None],
                    mask=dim_ok[:, None] & key_ok, other=0.0)  # [BLOCK_D, TILE_N]: keys as columns
        v = tl.load(v_cache_ptr + cache[:, None] + dims,
                    mask=key_ok[:, None] & dim_ok, other=0.0)  # [TILE_N, BLOCK_D]
        scores = tl.dot(q, k, input_precision=DOT_PRECISION) * scale  # [BLOCK_M, TILE_N]
        if SOFTCAP:  # tanh(x) = 1 - 2 / (exp(2x) + 1), which is +-1, not NaN, where exp(2x) overflows
            scores = (1.0 - 2.0 / (tl.exp(2.0 * scores / softcap) + 1.0)) * softcap
        seen = key_ok & (keys <= last_key[:, None])  # [BLOCK_M, TILE_N]
        if WINDOWED:
            seen = seen & (keys > last_key[:, None] - window)
        scores = tl.where(seen, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, 1))  # [BLOCK_M]
        # a row that has seen no key yet keeps its max at -inf: subtract 0 instead, so exp gives 0, never NaN
        safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
        p = tl.exp(scores - safe_max[:, None])  # [BLOCK_M, TILE_N]
        alpha = tl.exp(row_max - safe_max)  # [BLOCK_M]: rescales what was summed under the old max
        row_sum = row_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        row_max = new_max
    out = acc / tl.where(row_sum == 0.0, 1.0, row_sum)[:, None]  # [BLOCK_M, BLOCK_D]; 0 where no key was seen
    tl.store(out_ptr + token[:, None] * out_token_stride + head[:, None] * out_head_stride + dims,
             out.to(out_ptr.dtype.element_ty), mask=q_ok)


def paged_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, query_start_loc: Tensor, seq_lens: Tensor,
                    block_tables: Tensor, scale: float, softcap: float = 0.0, window: int | None = None) -> Tensor:
    """q `[N, H, D]` -> `[N, H, D]`. Request b's queries are rows query_start_loc[b]:query_start_loc[b + 1].
    They attend to its first seq_lens[b] keys, in blocks block_tables[b] of the caches. A nonzero softcap
    caps the scores (Gemma 2). With a sliding `window`, each query sees only the last `window` keys.
    The grid depends only on shapes, never on the lengths' values. So a CUDA graph or a compiled step
    can replay it."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, num_requests = k_cache.shape[2], len(seq_lens)
    group = num_heads // num_kv_heads
    group_p = triton.next_power_of_2(group)
    # tl.dot wants at least 16 rows. A decode-only step has one query per request: a short tile wastes least;
    # prompts fill taller tiles, each key then read once for more queries.
    block_m = max(16 if num_tokens == num_requests else 64, group_p)
    out = q.new_zeros(q.shape)  # [N, H, D], contiguous; rows after query_start_loc[-1], if any, stay 0
    assert q.stride(-1) == 1 and k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    grid = (num_tokens // (block_m // group_p) + num_requests, num_kv_heads)
    paged_attention_kernel[grid](
        out, q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, num_requests, scale, softcap,
        *q.stride()[:2], *out.stride()[:2],  # token and head strides
        *k_cache.stride()[:3], block_tables.stride(0), k_cache.shape[1],  # block, slot and head strides
        window or 0, WINDOWED=window is not None,
        GROUP=group, GROUP_P=group_p, HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),  # tl.dot needs 16 or more
        BLOCK_M=block_m, TILE_N=32,
        # float32 on a GPU: exact products, not TF32's, so that float32 stays token-exact with transformers
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,  # None: the default for 16 bits
        SOFTCAP=softcap != 0.0)
    return out
