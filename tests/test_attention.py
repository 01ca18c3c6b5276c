"""Tests for nanoserve/attention.py: its backends against flash-attn's semantics, checked first as
tests/flash_reference.py (the plain per-request formulation) against a naive attention written out
loop by loop, then each backend against that reference."""
from __future__ import annotations

import itertools
import math
import random
import sys

import numpy as np
import pytest
import torch

from conftest import build_tiny_llama
from conftest import reference as hf_reference
from flash_reference import FlashReference, fake_flash_attn_module
from nanoserve import LLMEngine, SamplingParams, attention
from nanoserve.attention import BACKENDS, FlashBackend, paged_attention, plan_attention, select_attention, store_kvcache
from nanoserve.batch import Batch
from nanoserve.config import Config
from nanoserve.triton_backend import why_not_triton

# flash-attn's checks, relaxed for these tests' float32 and pages of 1 to 16 tokens only
RELAXED = FlashReference(page_multiple=1, allow_float32=True)
flash_attn_varlen_func, flash_attn_with_kvcache = RELAXED.flash_attn_varlen_func, RELAXED.flash_attn_with_kvcache

H, HKV, D = 4, 2, 8  # grouped-query attention: query heads 0,1 read kv head 0, heads 2,3 kv head 1


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
              scale: float | None = None) -> torch.Tensor:
    """One request: q [Sq, H, D], k, v [Sk, Hkv, D] -> [Sq, H, D], in float64, bottom-right causal."""
    seqlen_q, num_heads, head_dim = q.shape
    seqlen_k, num_kv_heads = k.shape[:2]
    group = num_heads // num_kv_heads
    scale = 1 / math.sqrt(head_dim) if scale is None else scale
    out = torch.zeros(seqlen_q, num_heads, head_dim, dtype=torch.float64)
    for h in range(num_heads):
        kv_head = h // group
        for i in range(seqlen_q):
            visible = [j for j in range(seqlen_k) if not causal or j <= i + seqlen_k - seqlen_q]
            if not visible:
                continue  # flash-attn returns 0 for a query that sees nothing
            scores = torch.stack([q[i, h].double() @ k[j, kv_head].double() for j in visible])
            probs = torch.softmax(scores * scale, dim=0)
            out[i, h] = sum(p * v[j, kv_head].double() for p, j in zip(probs, visible))
    return out


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual.double(), expected, atol=1e-5, rtol=1e-5)


def cumsum0(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)


def paged_cache(seq_lens: list[int], block_size: int, seed: int = 0):
    """Random caches with each request's blocks scattered in shuffled order (block 0 reserved)."""
    rng = random.Random(seed)
    blocks_needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_needed) + 3
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in blocks_needed]
    max_blocks = max(blocks_needed)
    block_tables = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.int32)
    k_cache = torch.randn(num_blocks, block_size, HKV, D)
    v_cache = torch.randn(num_blocks, block_size, HKV, D)
    # what each request's keys are, read slot by slot
    slots = [[tables[b][p // block_size] * block_size + p % block_size for p in range(n)]
             for b, n in enumerate(seq_lens)]
    keys = [k_cache.view(-1, HKV, D)[s] for s in slots]
    values = [v_cache.view(-1, HKV, D)[s] for s in slots]
    return k_cache, v_cache, block_tables, keys, values


def batch_of(q_lens: list[int], k_lens: list[int], block_tables: torch.Tensor) -> Batch:
    """A step in which request b has q_lens[b] queries and k_lens[b] keys, in blocks block_tables[b],
    all already in the cache (these tests fill it beforehand: slot_mapping is empty)."""
    num_tokens = sum(q_lens)
    zeros = torch.zeros(num_tokens, dtype=torch.int64)  # input_ids and positions: attention reads neither
    return Batch(input_ids=zeros, positions=zeros,
                 slot_mapping=torch.empty(0, dtype=torch.int64), query_start_loc=cumsum0(q_lens),
                 seq_lens=torch.tensor(k_lens, dtype=torch.int32), cu_seqlens_k=cumsum0(k_lens),
                 block_tables=block_tables, logits_indices=cumsum0(q_lens)[1:].long() - 1,
                 next_token_ids=torch.empty(0, dtype=torch.int64),  # no prompt-logprob rows
                 max_query_len=max(q_lens), max_seq_len=max(k_lens),
                 query_start_loc_cpu=cumsum0(q_lens).numpy(), seq_lens_cpu=np.array(k_lens))


# ----------------------------------------------------------------------------- the reference itself

# ----------------------------------------------------------------------------- the reference itself

def test_varlen_packed_matches_reference():
    torch.manual_seed(0)
    lens = [5, 1, 9, 3]
    q, k, v = torch.randn(sum(lens), H, D), torch.randn(sum(lens), HKV, D), torch.randn(sum(lens), HKV, D)
    cu = cumsum0(lens)
    out = flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    assert out.shape == (sum(lens), H, D)
    for b in range(len(lens)):
        s, e = cu[b], cu[b + 1]
        assert_close(out[s:e], reference(q[s:e], k[s:e], v[s:e]))


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_varlen_paged_mixes_prefill_chunks_and_decode(block_size: int):
    torch.manual_seed(block_size)
    # full prefill, chunked-prefill chunk, decode, decode, full prefill, chunk of 1 past a block
    q_lens = [7, 3, 1, 1, 2, 4]
    k_lens = [7, 20, 9, 33, 2, 17]
    k_cache, v_cache, block_tables, keys, values = paged_cache(k_lens, block_size, seed=block_size)
    q = torch.randn(sum(q_lens), H, D)
    cu_q, cu_k = cumsum0(q_lens), cumsum0(k_lens)
    out = flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max(q_lens), max(k_lens),
                                 causal=True, block_table=block_tables)
    for b in range(len(q_lens)):
        s, e = cu_q[b], cu_q[b + 1]
        assert_close(out[s:e], reference(q[s:e], keys[b], values[b]))


@pytest.mark.parametrize("causal", [True, False])
def test_with_kvcache_decode_matches_reference(causal: bool):
    torch.manual_seed(1)
    cache_seqlens = [1, 16, 5, 23, 12]
    k_cache, v_cache, block_tables, keys, values = paged_cache(cache_seqlens, block_size=4, seed=1)
    q = torch.randn(len(cache_seqlens), 1, H, D)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor(cache_seqlens, dtype=torch.int32),
                                  block_table=block_tables, softmax_scale=0.3, causal=causal)
    assert out.shape == q.shape
    for b in range(len(cache_seqlens)):
        assert_close(out[b], reference(q[b], keys[b], values[b], causal=causal, scale=0.3))


def test_with_kvcache_appends_new_tokens_then_attends():
    torch.manual_seed(2)
    cache_seqlens = [3, 8]
    k_cache, v_cache, block_tables, keys, values = paged_cache([6, 11], block_size=4, seed=2)
    q, k, v = torch.randn(2, 3, H, D), torch.randn(2, 3, HKV, D), torch.randn(2, 3, HKV, D)
    out = flash_attn_with_kvcache(q, k_cache, v_cache, k, v, block_table=block_tables, causal=True,
                                  cache_seqlens=torch.tensor(cache_seqlens, dtype=torch.int32))
    for b, n in enumerate(cache_seqlens):
        slots = torch.tensor([int(block_tables[b, p // 4]) * 4 + p % 4 for p in range(n, n + 3)])
        assert torch.equal(k_cache.view(-1, HKV, D)[slots], k[b])
        assert_close(out[b], reference(q[b], torch.cat([keys[b][:n], k[b]]), torch.cat([values[b][:n], v[b]])))


def test_varlen_not_causal_every_query_sees_every_key():
    # more queries than keys: causal would leave the first queries without a key, non-causal must not
    torch.manual_seed(9)
    q_lens, k_lens = [5, 1, 3], [2, 4, 3]
    q = torch.randn(sum(q_lens), H, D)
    k, v = torch.randn(sum(k_lens), HKV, D), torch.randn(sum(k_lens), HKV, D)
    cu_q, cu_k = cumsum0(q_lens), cumsum0(k_lens)
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(q_lens), max(k_lens), causal=False)
    for b in range(len(q_lens)):
        qs, ks = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        assert_close(out[qs], reference(q[qs], k[ks], v[ks], causal=False))


def test_causal_mask_is_bottom_right():
    # seqlen_q=2, seqlen_k=5: query 0 sees keys 0..3 (top-left alignment would give keys 0..0)
    torch.manual_seed(3)
    q, k = torch.randn(2, 1, D), torch.randn(5, 1, D)
    v = torch.eye(5, D).unsqueeze(1)  # value j is the unit vector e_j: the output row is the attention weights
    out = flash_attn_varlen_func(q, k, v, cumsum0([2]), cumsum0([5]), 2, 5, causal=True)
    weights = out[:, 0, :5]
    assert (weights[0, :4] > 0).all() and weights[0, 4] == 0
    assert (weights[1] > 0).all()
    assert_close(out, reference(q, k, v))


def test_query_that_sees_no_key_gets_zero():
    # seqlen_q=5, seqlen_k=2, causal: queries 0..2 see nothing and must give 0, not NaN
    torch.manual_seed(6)
    q, k, v = torch.randn(5, H, D), torch.randn(2, HKV, D), torch.randn(2, HKV, D)
    out = flash_attn_varlen_func(q, k, v, cumsum0([5]), cumsum0([2]), 5, 2, causal=True)
    assert torch.equal(out[:3], torch.zeros(3, H, D))
    assert_close(out, reference(q, k, v))
    # a request with an empty cache, next to one that has keys
    k_cache, v_cache, block_tables, keys, values = paged_cache([1, 6], block_size=4, seed=6)
    q1 = torch.randn(2, 1, H, D)
    out1 = flash_attn_with_kvcache(q1, k_cache, v_cache, cache_seqlens=torch.tensor([0, 6], dtype=torch.int32),
                                   block_table=block_tables)
    assert torch.equal(out1[0], torch.zeros(1, H, D))
    assert_close(out1[1], reference(q1[1], keys[1], values[1], causal=False))


def test_reference_rejects_unsupported_options():
    q, k = torch.randn(2, H, D), torch.randn(2, HKV, D)
    cu = cumsum0([2])
    with pytest.raises(NotImplementedError):
        flash_attn_varlen_func(q, k, k, cu, cu, 2, 2, dropout_p=0.1)
    flash_attn_varlen_func(q, k, k, cu, cu, 2, 2, window_size=[-1, -1])  # the default, as a list


# ----------------------------------------------------------------------------- the torch backend

TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
             torch.float16: dict(atol=2e-3, rtol=2e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_rows, num_groups", [(1, 1), (5, 1), (20, 3), (50, 7)])  # 1: the one-request path
def test_decode_length_groups_match_plain_reference(num_rows: int, num_groups: int, dtype: torch.dtype):
    # contexts of 1..70 tokens in random order: each length group is padded to its own longest,
    # so a group cut to the wrong length drops keys of some row
    rng = random.Random(num_rows)
    k_lens = [rng.randint(1, 70) for _ in range(num_rows)]
    k_cache, v_cache, block_tables, keys, values = paged_cache(k_lens, block_size=4, seed=num_rows)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    q = torch.randn(num_rows, H, D, dtype=dtype)
    plan = plan_attention(batch_of([1] * num_rows, k_lens, block_tables), 4, dtype)
    assert len(plan.decode_groups) == num_groups and not plan.prefill_requests
    assert sorted(torch.cat([g.rows for g in plan.decode_groups]).tolist()) == list(range(num_rows))
    out = paged_attention(q, k_cache, v_cache, plan, D ** -0.5)
    cache_seqlens = torch.tensor(k_lens, dtype=torch.int32)
    expected = flash_attn_with_kvcache(q[:, None], k_cache, v_cache, cache_seqlens=cache_seqlens,
                                       block_table=block_tables, causal=True)[:, 0]
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCE[dtype])
    assert out.dtype == dtype  # a one-request path returning its float32 product would fail the next matmul
    if dtype != torch.float32:  # on a CPU, decode rows are computed in float32 and rounded once, as the reference
        # is; SDPA in bfloat16 or float16 rounds its probabilities too (a fifth to a third of the outputs then differ)
        assert (out != expected).float().mean() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_prefill_and_decode_match_plain_reference(dtype: torch.dtype):
    # 19 decode rows (three length groups) between a full prompt, a prompt chunk, a request with more
    # queries than keys (its first queries see nothing) and one with no key at all
    rng = random.Random(7)
    q_lens = [9, 1, 1, 5, 1, 6, 3] + [1] * 16
    k_lens = [9, 40, 3, 30, 17, 4, 0] + [rng.randint(1, 60) for _ in range(16)]
    k_cache, v_cache, block_tables, keys, values = paged_cache(k_lens, block_size=8, seed=7)
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    q = torch.randn(sum(q_lens), H, D, dtype=dtype)
    cu_q, cu_k = cumsum0(q_lens), cumsum0(k_lens)
    plan = plan_attention(batch_of(q_lens, k_lens, block_tables), 8, dtype)
    assert len(plan.decode_groups) == 3 and len(plan.prefill_requests) == 3  # the one without keys: nowhere
    out = paged_attention(q, k_cache, v_cache, plan, D ** -0.5)
    expected = flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max(q_lens), max(k_lens),
                                      causal=True, block_table=block_tables)
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCE[dtype])
    assert torch.equal(out[cu_q[5]:cu_q[5] + 2], torch.zeros(2, H, D, dtype=dtype))  # 6 queries, 4 keys
    assert torch.equal(out[cu_q[6]:cu_q[7]], torch.zeros(3, H, D, dtype=dtype))      # no key at all


def test_paged_attention_follows_one_plan_for_every_layer():
    # the plan holds no layer's data: two layers' caches (same blocks, other contents) under one plan
    torch.manual_seed(8)
    q_lens, k_lens = [1, 4, 1], [12, 6, 3]
    layers = [paged_cache(k_lens, block_size=4, seed=8) for _ in range(2)]
    plan = plan_attention(batch_of(q_lens, k_lens, layers[0][2]), 4, torch.float32)
    q = torch.randn(sum(q_lens), H, D)
    cu_q, cu_k = cumsum0(q_lens), cumsum0(k_lens)
    for k_cache, v_cache, block_tables, _, _ in layers:
        expected = flash_attn_varlen_func(q, k_cache, v_cache, cu_q, cu_k, max(q_lens), max(k_lens),
                                          softmax_scale=0.5, causal=True, block_table=block_tables)
        torch.testing.assert_close(paged_attention(q, k_cache, v_cache, plan, 0.5), expected)


def test_store_kvcache_writes_only_named_slots():
    k_cache, v_cache = torch.zeros(4, 4, HKV, D), torch.zeros(4, 4, HKV, D)
    slot_mapping = torch.tensor([5, 14, 3], dtype=torch.int64)
    k, v = torch.randn(3, HKV, D), torch.randn(3, HKV, D)
    store_kvcache(k, v, k_cache, v_cache, slot_mapping)
    assert torch.equal(k_cache[1, 1], k[0]) and torch.equal(k_cache[3, 2], k[1]) and torch.equal(k_cache[0, 3], k[2])
    assert torch.equal(v_cache.view(-1, HKV, D)[slot_mapping], v)
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[slot_mapping] = False
    assert k_cache.view(-1, HKV, D)[untouched].abs().sum() == 0
    assert v_cache.view(-1, HKV, D)[untouched].abs().sum() == 0


# ----------------------------------------------------------------------------- both backends, one shape

def walkthrough_prefill_batch() -> Batch:
    """Step 1 of the walkthrough (docs/walkthrough.md): block_size 4, prompts of 5, 7, 3 tokens in
    blocks [1,2], [3,4], [5]."""
    return Batch(
        input_ids=torch.tensor([1, 2, 3, 4, 5, 1, 6, 5, 7, 8, 9, 10, 1, 12, 13]),
        positions=torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2]),
        slot_mapping=torch.tensor([4, 5, 6, 7, 8, 12, 13, 14, 15, 16, 17, 18, 20, 21, 22]),
        query_start_loc=torch.tensor([0, 5, 12, 15], dtype=torch.int32),
        seq_lens=torch.tensor([5, 7, 3], dtype=torch.int32),
        cu_seqlens_k=torch.tensor([0, 5, 12, 15], dtype=torch.int32),
        block_tables=torch.tensor([[1, 2], [3, 4], [5, 0]], dtype=torch.int32),
        logits_indices=torch.tensor([4, 11, 14]),
        next_token_ids=torch.empty(0, dtype=torch.int64),  # no prompt-logprob rows
        max_query_len=7,
        max_seq_len=7,
        query_start_loc_cpu=np.array([0, 5, 12, 15]),
        seq_lens_cpu=np.array([5, 7, 3]),
    )


def walkthrough_decode_batch() -> Batch:
    """Step 2 of the walkthrough: one new token per request, at positions 5, 7, 3."""
    return Batch(
        input_ids=torch.tensor([14, 15, 16]),
        positions=torch.tensor([5, 7, 3]),
        slot_mapping=torch.tensor([9, 19, 23]),
        query_start_loc=torch.tensor([0, 1, 2, 3], dtype=torch.int32),
        seq_lens=torch.tensor([6, 8, 4], dtype=torch.int32),
        cu_seqlens_k=torch.tensor([0, 6, 14, 18], dtype=torch.int32),
        block_tables=torch.tensor([[1, 2], [3, 4], [5, 0]], dtype=torch.int32),
        logits_indices=torch.tensor([0, 1, 2]),
        next_token_ids=torch.empty(0, dtype=torch.int64),  # no prompt-logprob rows
        max_query_len=1,
        max_seq_len=8,
        query_start_loc_cpu=np.array([0, 1, 2, 3]),
        seq_lens_cpu=np.array([6, 8, 4]),
    )


def mixed_step_batch() -> Batch:
    """A step after the walkthrough's step 2: request 0 runs a 3-token chunk after its 6 cached tokens
    (into new block 6), request 2 decodes one (into new block 7). Queries are not keys here:
    query_start_loc [0, 3, 4] but cu_seqlens_k [0, 9, 14]."""
    return Batch(
        input_ids=torch.tensor([17, 18, 19, 20]),
        positions=torch.tensor([6, 7, 8, 4]),
        slot_mapping=torch.tensor([10, 11, 24, 28]),
        query_start_loc=torch.tensor([0, 3, 4], dtype=torch.int32),
        seq_lens=torch.tensor([9, 5], dtype=torch.int32),
        cu_seqlens_k=torch.tensor([0, 9, 14], dtype=torch.int32),
        block_tables=torch.tensor([[1, 2, 6], [5, 7, 0]], dtype=torch.int32),
        logits_indices=torch.tensor([2, 3]),
        next_token_ids=torch.empty(0, dtype=torch.int64),  # no prompt-logprob rows
        max_query_len=3,
        max_seq_len=9,
        query_start_loc_cpu=np.array([0, 3, 4]),
        seq_lens_cpu=np.array([9, 5]),
    )


@pytest.fixture
def flash_attn_is_the_reference(monkeypatch):
    """flash-attn cannot run here: the reference, which has its signatures, stands in for the package."""
    monkeypatch.setitem(sys.modules, "flash_attn", fake_flash_attn_module(RELAXED))


@pytest.mark.parametrize("name", ["torch", "flash"])
def test_backend_walkthrough(name: str, flash_attn_is_the_reference):
    """Both backends, prepare once per step then forward, on the walkthrough's two steps (a prefill of
    three prompts, then a decode: flash_attn_varlen_func, then flash_attn_with_kvcache) and a step
    mixing a prompt chunk after cached tokens with a decode (varlen again). Catches k, v stored in the
    wrong slots or the null block, and for flash any array passed in the wrong place (query_start_loc
    for cu_seqlens_k, seq_lens off by the new token, a wrong block table or scale)."""
    torch.manual_seed(4)
    scale = 0.3  # not flash-attn's default 1 / sqrt(D): a backend must pass its own
    backend = BACKENDS[name](scale)
    kv_cache = torch.zeros(2, 1, 8, 4, HKV, D)  # one layer's: [2 (k and v), 1, num_blocks, block_size, Hkv, D]
    k_cache, v_cache = kv_cache[:, 0]  # views: what the backend writes, layer 0

    prefill = walkthrough_prefill_batch()
    q, k, v = torch.randn(15, H, D), torch.randn(15, HKV, D), torch.randn(15, HKV, D)
    out = backend.forward(q, k, v, kv_cache, 0, backend.prepare(prefill, 4, torch.float32))
    assert out.shape == (15, H, D)
    for s, e in [(0, 5), (5, 12), (12, 15)]:
        assert_close(out[s:e], reference(q[s:e], k[s:e], v[s:e], scale=scale))
    assert torch.equal(k_cache.view(-1, HKV, D)[prefill.slot_mapping], k)
    assert torch.equal(v_cache.view(-1, HKV, D)[prefill.slot_mapping], v)
    assert k_cache[0].abs().sum() == 0  # the null block is never written

    decode = walkthrough_decode_batch()
    q2, k2, v2 = torch.randn(3, H, D), torch.randn(3, HKV, D), torch.randn(3, HKV, D)
    out2 = backend.forward(q2, k2, v2, kv_cache, 0, backend.prepare(decode, 4, torch.float32))
    assert out2.shape == (3, H, D)
    for b, (s, e) in enumerate([(0, 5), (5, 12), (12, 15)]):
        keys, values = torch.cat([k[s:e], k2[b:b + 1]]), torch.cat([v[s:e], v2[b:b + 1]])
        assert_close(out2[b:b + 1], reference(q2[b:b + 1], keys, values, scale=scale))

    mixed = mixed_step_batch()
    q3, k3, v3 = torch.randn(4, H, D), torch.randn(4, HKV, D), torch.randn(4, HKV, D)
    out3 = backend.forward(q3, k3, v3, kv_cache, 0, backend.prepare(mixed, 4, torch.float32))
    keys = torch.cat([k[0:5], k2[0:1], k3[0:3]])  # request 0: its prompt, its decode token, its chunk
    values = torch.cat([v[0:5], v2[0:1], v3[0:3]])
    assert_close(out3[0:3], reference(q3[0:3], keys, values, scale=scale))
    keys, values = torch.cat([k[12:15], k2[2:3], k3[3:4]]), torch.cat([v[12:15], v2[2:3], v3[3:4]])
    assert_close(out3[3:4], reference(q3[3:4], keys, values, scale=scale))
    assert k_cache[0].abs().sum() == 0


# ----------------------------------------------------------------------------- choosing a backend on a GPU

CUDA, BF16 = torch.device("cuda"), torch.bfloat16
# where flash-attn cannot serve on CUDA: our triton kernel, or the torch backend where triton is not installed
CUDA_FALLBACK = "torch" if why_not_triton(CUDA, BF16) else "triton"


def without_block_table(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                        softmax_scale=None, causal=False):
    """flash_attn_varlen_func's signature before flash-attn 2.5.7: no paged KV cache."""


@pytest.fixture
def gpu(monkeypatch):
    """An NVIDIA sm90 GPU with flash-attn 2 installed, as far as select_attention can tell; a test
    changes one condition at a time through the monkeypatch it returns."""
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setitem(sys.modules, "flash_attn", fake_flash_attn_module(FlashReference()))
    return monkeypatch


def test_flash_and_256_by_default_where_flash_attn_2_runs(gpu):
    assert select_attention("auto", "auto", CUDA, BF16, 64) == ("flash", 256)
    assert select_attention("auto", "auto", CUDA, torch.float16, 256) == ("flash", 256)
    assert select_attention("flash", 512, CUDA, BF16, 64) == ("flash", 512)
    # an explicit block_size that is no flash-attn page takes the fallback; the torch backend asked for, torch
    assert select_attention("auto", 16, CUDA, BF16, 64) == (CUDA_FALLBACK, 16)
    assert select_attention("torch", "auto", CUDA, BF16, 64) == ("torch", 16)
    assert select_attention("auto", "auto", torch.device("cpu"), BF16, 64) == ("torch", 16)
    with pytest.raises(ValueError, match="choose 'auto', 'torch', 'flash' or 'triton'"):
        select_attention("flashinfer", "auto", CUDA, BF16, 64)
    with pytest.raises(ValueError, match="block_size=16 is not a multiple of 256"):
        select_attention("flash", 16, CUDA, BF16, 64)


def fa4_only(gpu, tmp_path):
    """flash-attn 4 installs flash_attn/cute/ alone: `import flash_attn` finds a namespace package."""
    (tmp_path / "flash_attn" / "cute").mkdir(parents=True)
    (tmp_path / "flash_attn" / "cute" / "__init__.py").write_text("")
    gpu.delitem(sys.modules, "flash_attn")
    gpu.syspath_prepend(str(tmp_path))


REFUSALS = {  # how the condition is forced -> what the error names
    "sm75 (T4)": (lambda gpu, _: gpu.setattr(torch.cuda, "get_device_capability", lambda d=None: (7, 5)), "7.5"),
    "sm100 (B200)": (lambda gpu, _: gpu.setattr(torch.cuda, "get_device_capability", lambda d=None: (10, 0)), "10.0"),
    "ROCm": (lambda gpu, _: gpu.setattr(torch.version, "hip", "6.2"), "ROCm"),
    "not installed": (lambda gpu, _: gpu.setitem(sys.modules, "flash_attn", None), "not importable"),
    "flash-attn 4 only": (fa4_only, "not importable"),
    "before 2.5.7": (lambda gpu, _: gpu.setattr(sys.modules["flash_attn"], "flash_attn_varlen_func",
                                                without_block_table), "2.5.7"),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_flash_refused_where_it_cannot_run(case, gpu, tmp_path):
    """"auto" falls back to triton (torch without it) with block_size 16; "flash" asked for is a ValueError
    naming why, at start-up. The bug each catches: flash chosen where its first forward fails mid-run."""
    force, reason = REFUSALS[case]
    force(gpu, tmp_path)
    assert select_attention("auto", "auto", CUDA, BF16, 64) == (CUDA_FALLBACK, 16)
    with pytest.raises(ValueError, match=reason):
        select_attention("flash", 256, CUDA, BF16, 64)


@pytest.mark.parametrize("dtype, head_dim, reason", [(torch.float32, 64, "float16 or bfloat16"),
                                                     (BF16, 12, "head_dim"), (BF16, 320, "head_dim")])
def test_flash_refused_for_the_model(gpu, dtype, head_dim, reason):
    assert select_attention("auto", "auto", CUDA, dtype, head_dim) == (CUDA_FALLBACK, 16)
    with pytest.raises(ValueError, match=reason):
        select_attention("flash", 256, CUDA, dtype, head_dim)


def test_an_fa4_only_install_leaves_llm_unaffected(gpu, tmp_path, tiny_models):
    fa4_only(gpu, tmp_path)
    from nanoserve import LLM, SamplingParams
    [out] = LLM(tiny_models["gqa"], device="cpu").generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3))
    assert len(out.outputs[0].token_ids) == 3


flash_attn_ready = torch.cuda.is_available() and not attention.why_not_flash(torch.device("cuda"), BF16, 64)


@pytest.mark.gpu
@pytest.mark.skipif(not flash_attn_ready, reason="needs CUDA and the flash_attn package")
def test_flash_attn_matches_reference():
    import flash_attn

    torch.manual_seed(5)
    block_size, dtype, device = 256, torch.bfloat16, torch.device("cuda")
    q_lens, k_lens = [300, 40, 1, 1], [300, 600, 257, 1000]
    k_cache, v_cache, block_tables, _, _ = paged_cache(k_lens, block_size, seed=5)
    k_cache, v_cache = k_cache.to(device, dtype), v_cache.to(device, dtype)
    block_tables = block_tables.to(device)
    q = torch.randn(sum(q_lens), H, D * 8, device=device, dtype=dtype)  # flash-attn wants head_dim % 8 == 0
    k_cache = k_cache.repeat(1, 1, 1, 8)
    v_cache = v_cache.repeat(1, 1, 1, 8)
    cu_q, cu_k = cumsum0(q_lens).to(device), cumsum0(k_lens).to(device)
    args = (q, k_cache, v_cache, cu_q, cu_k, max(q_lens), max(k_lens))
    expected = flash_attn.flash_attn_varlen_func(*args, causal=True, block_table=block_tables)
    actual = flash_attn_varlen_func(*args, causal=True, block_table=block_tables)
    torch.testing.assert_close(actual.float(), expected.float(), atol=2e-2, rtol=2e-2)

    q1 = torch.randn(len(k_lens), 1, H, D * 8, device=device, dtype=dtype)
    seqlens = torch.tensor(k_lens, dtype=torch.int32, device=device)
    kwargs = dict(cache_seqlens=seqlens, block_table=block_tables, causal=True)
    expected = flash_attn.flash_attn_with_kvcache(q1, k_cache, v_cache, **kwargs)
    actual = flash_attn_with_kvcache(q1, k_cache, v_cache, **kwargs)
    torch.testing.assert_close(actual.float(), expected.float(), atol=2e-2, rtol=2e-2)


# ----------------------------------------------------------------------------- the flash branch, end to end

@pytest.fixture(scope="module")
def long_llama(tmp_path_factory) -> str:
    """A tiny Llama with room for whole 256-token pages and a prefix hit on one."""
    return build_tiny_llama(str(tmp_path_factory.mktemp("long") / "llama"), max_position_embeddings=1024)


def run_flash_engine(path: str, reference_module: object, monkeypatch) -> tuple[dict[str, list[int]], list[list[int]]]:
    """The engine's flash branch on the CPU, flash-attn replaced by `reference_module` and the GPU checks
    passed (as on an sm90 GPU). Two requests first: a 10-token prompt and a 310-token one in chunks of
    at most 128 tokens, so varlen steps mix prefill chunks with decodes. Once the long prompt is done,
    two more: one sharing its first 300 tokens (a prefix hit on its first page, then a chunk after 256
    cached tokens) and a short one. Returns the generated tokens by request id, and the prompts."""
    monkeypatch.setitem(sys.modules, "flash_attn", reference_module)
    monkeypatch.setattr(attention, "why_not_flash", lambda device, dtype, head_dim: None)
    config = Config.from_kwargs(path, device="cpu", dtype="float32", max_num_batched_tokens=128, max_num_seqs=4)
    engine = LLMEngine(config)
    assert engine.block_size == 256 and isinstance(engine.model_runner.model.model.attention, FlashBackend)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 256) for _ in range(n)] for n in (10, 310, 0, 7)]
    prompts[2] = prompts[1][:300] + [rng.randrange(3, 256) for _ in range(20)]
    tokens: dict[str, list[int]] = {}
    for i in (0, 1):
        engine.add_request(prompts[i], SamplingParams(temperature=0, max_tokens=12), request_id=str(i))
    while engine.requests["1"].num_computed_tokens < 310:
        tokens |= {o.request_id: o.outputs[0].token_ids for o in engine.step().outputs}
    for i in (2, 3):
        engine.add_request(prompts[i], SamplingParams(temperature=0, max_tokens=12), request_id=str(i))
    while engine.has_unfinished_requests():
        tokens |= {o.request_id: o.outputs[0].token_ids for o in engine.step().outputs}
    return tokens, prompts


def test_flash_branch_end_to_end_through_the_strict_reference(long_llama, monkeypatch):
    """The flash backend's every call goes through flash_attn_varlen_func / flash_attn_with_kvcache as
    the strict reference checks them (int32 contiguous lengths and block tables, the paged layout,
    256-token pages, max_seqlen bounds), and the tokens equal transformers'. One relaxation, said
    here: float32, which flash-attn refuses, so that greedy tokens can be compared exactly. Catches
    query_start_loc passed for cu_seqlens_k, an int64 or misshapen block table, seq_lens off by
    one, max_query_len for max_seq_len, decode-only steps sent to the wrong function."""
    strict = FlashReference(allow_float32=True)
    tokens, prompts = run_flash_engine(long_llama, fake_flash_attn_module(strict), monkeypatch)
    assert [tokens[str(i)] for i in range(4)] == hf_reference(long_llama, prompts, [12] * 4)
    varlen = [c for c in strict.calls if c["fn"] == "varlen"]
    assert all(c["paged"] and c["causal"] for c in strict.calls)
    # the steps this run must have reached: chunks mixed with decodes, a chunk after a prefix hit
    assert any(1 in c["q_lens"] and max(c["q_lens"]) > 1 for c in varlen)
    assert any(q > 1 and k - q >= 256 for c in varlen for q, k in zip(c["q_lens"], c["k_lens"]))  # the prefix hit
    assert any(c["fn"] == "kvcache" for c in strict.calls)
