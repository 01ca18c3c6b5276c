"""Self-test of flash_reference.py: its answers against a naive dense attention written out in float64,
its signatures against flash-attn 2.8.3's, and every refusal forced one at a time.

Runs on the CPU in a few seconds.
"""
from __future__ import annotations

import inspect
import math
import random
import subprocess
import sys
import textwrap

import pytest
import torch

from flash_reference import FlashCheckError, FlashReference, fake_flash_attn_module

H, HKV, D = 8, 2, 64  # grouped-query attention: query heads 0-3 read kv head 0, heads 4-7 kv head 1
PAGE = 256

# flash-attn 2.8.3, flash_attn/flash_attn_interface.py:1370-1387 and 1464-1484: (name, default) in order
VARLEN_SIGNATURE = [("q", None), ("k", None), ("v", None), ("cu_seqlens_q", None), ("cu_seqlens_k", None),
                    ("max_seqlen_q", None), ("max_seqlen_k", None), ("dropout_p", 0.0), ("softmax_scale", None),
                    ("causal", False), ("window_size", (-1, -1)), ("softcap", 0.0), ("alibi_slopes", None),
                    ("deterministic", False), ("return_attn_probs", False), ("block_table", None)]
KVCACHE_SIGNATURE = [("q", None), ("k_cache", None), ("v_cache", None), ("k", None), ("v", None),
                     ("rotary_cos", None), ("rotary_sin", None), ("cache_seqlens", None), ("cache_batch_idx", None),
                     ("cache_leftpad", None), ("block_table", None), ("softmax_scale", None), ("causal", False),
                     ("window_size", (-1, -1)), ("softcap", 0.0), ("rotary_interleaved", True),
                     ("alibi_slopes", None), ("num_splits", 0), ("return_softmax_lse", False)]

# (seqlen_q, seqlen_k) per request: a long decode, a whole prompt, a prompt chunk after 260 cached
# tokens (a prefix hit spanning two pages), more queries than keys, a one-token prompt, no key at all
REQUESTS = [(1, 300), (5, 5), (40, 300), (7, 3), (1, 1), (2, 0)]


def naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
          window: int | None = None) -> torch.Tensor:
    """One request in float64, loop by loop: q [Sq, H, D], k, v [Sk, Hkv, D] -> [Sq, H, D]. Query i sits
    at absolute position Sk - Sq + i (the chunk is the end of the sequence) and sees keys at or before it,
    and with a `window` only the last `window` of them, its own included."""
    seqlen_q, seqlen_k = q.shape[0], k.shape[0]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i in range(seqlen_q):
        position = seqlen_k - seqlen_q + i
        visible = [j for j in range(seqlen_k) if (not causal or j <= position)
                   and (window is None or j > position - window)]
        for h in range(q.shape[1]):
            if not visible:
                continue  # flash-attn's answer for a query that sees nothing: 0
            kv = h * k.shape[1] // q.shape[1]
            scores = torch.tensor([float(q[i, h].double() @ k[j, kv].double()) * scale for j in visible])
            probs = torch.softmax(scores, dim=0)
            out[i, h] = sum(p * v[j, kv].double() for p, j in zip(probs, visible))
    return out


def paged(requests_k: list[torch.Tensor], page: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A paged cache [num_blocks, page, Hkv, D] holding each request's keys in shuffled blocks, and the
    int32 block_table [B, max_blocks] (unused entries point at block 0, never read)."""
    rng = random.Random(seed)
    needed = [max(1, -(-len(k) // page)) for k in requests_k]
    num_blocks = sum(needed) + 2
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in needed]
    cache = torch.randn(num_blocks, page, *requests_k[0].shape[1:]).to(requests_k[0].dtype)  # junk elsewhere
    for keys, table in zip(requests_k, tables):
        for p in range(len(keys)):
            cache[table[p // page], p % page] = keys[p]
    width = max(needed)
    return cache, torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)


def scenario(dtype: torch.dtype, seed: int = 0, requests: list[tuple[int, int]] = REQUESTS, page: int = PAGE):
    torch.manual_seed(seed)
    qs = [torch.randn(sq, H, D).to(dtype) for sq, _ in requests]
    ks = [torch.randn(sk, HKV, D).to(dtype) for _, sk in requests]
    vs = [torch.randn(sk, HKV, D).to(dtype) for _, sk in requests]
    k_cache, block_table = paged(ks, page, seed)
    v_cache, _ = paged(vs, page, seed)  # same seed: the same block tables
    cu = lambda lens: torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)  # noqa: E731
    return dict(q=torch.cat(qs), qs=qs, ks=ks, vs=vs, k_cache=k_cache, v_cache=v_cache, block_table=block_table,
                cu_q=cu([sq for sq, _ in requests]), cu_k=cu([sk for _, sk in requests]),
                max_q=max(sq for sq, _ in requests), max_k=max(sk for _, sk in requests))


def expected(s: dict, causal: bool = True) -> torch.Tensor:
    return torch.cat([naive(q, k, v, causal, D ** -0.5) for q, k, v in zip(s["qs"], s["ks"], s["vs"])])


def varlen(ref: FlashReference, s: dict, **overrides):
    args = dict(q=s["q"], k=s["k_cache"], v=s["v_cache"], cu_seqlens_q=s["cu_q"], cu_seqlens_k=s["cu_k"],
                max_seqlen_q=s["max_q"], max_seqlen_k=s["max_k"], causal=True, block_table=s["block_table"])
    return ref.flash_attn_varlen_func(**{**args, **overrides})


def decode_args(s: dict, rows: list[int]) -> dict:
    """with_kvcache arguments for the decode requests `rows` (one query each) of scenario s."""
    return dict(q=torch.stack([s["qs"][b] for b in rows]), k_cache=s["k_cache"], v_cache=s["v_cache"],
                cache_seqlens=torch.tensor([len(s["ks"][b]) for b in rows], dtype=torch.int32),
                block_table=s["block_table"][rows].contiguous(), causal=True)


# ---------------------------------------------------------------------------------------------- signatures

@pytest.mark.parametrize("name, spec", [("flash_attn_varlen_func", VARLEN_SIGNATURE),
                                        ("flash_attn_with_kvcache", KVCACHE_SIGNATURE)])
def test_signatures_are_flash_attn_2_8_3s(name, spec):
    params = inspect.signature(getattr(FlashReference(), name)).parameters.values()
    assert [(p.name, None if p.default is inspect.Parameter.empty else p.default) for p in params] == spec


# ---------------------------------------------------------------------------------------------- answers

@pytest.mark.parametrize("causal", [True, False])
def test_varlen_paged_matches_naive_in_float32(causal):
    s = scenario(torch.float32)
    ref = FlashReference(allow_float32=True)
    torch.testing.assert_close(varlen(ref, s, causal=causal).double(), expected(s, causal), atol=1e-5, rtol=1e-5)
    assert ref.calls == [dict(fn="varlen", q_lens=[1, 5, 40, 7, 1, 2], k_lens=[300, 5, 300, 3, 1, 0],
                              paged=True, causal=causal)]


def test_varlen_paged_matches_naive_in_bfloat16_with_strict_defaults():
    s = scenario(torch.bfloat16, seed=1)
    out = varlen(FlashReference(), s)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), expected(s), atol=2e-2, rtol=2e-2)


def test_rows_that_see_no_key_are_zero_with_lse_inf():
    s = scenario(torch.float32)
    out, lse, s_dmask = varlen(FlashReference(allow_float32=True), s, return_attn_probs=True)
    start_7_3, start_no_keys = int(s["cu_q"][3]), int(s["cu_q"][5])
    # 7 queries, 3 keys, bottom-right: the first 4 queries see nothing; the last request has no key
    for rows in (slice(start_7_3, start_7_3 + 4), slice(start_no_keys, start_no_keys + 2)):
        assert (out[rows] == 0).all() and torch.isinf(lse[:, rows]).all() and (lse[:, rows] > 0).all()
    assert s_dmask.numel() == 0 and lse.shape == (H, s["q"].shape[0])


def test_lse_is_the_log_of_the_softmax_denominator():
    s = scenario(torch.float32)
    _, lse, _ = varlen(FlashReference(allow_float32=True), s, return_attn_probs=True)
    q, k = s["qs"][2].double(), s["ks"][2].double()  # the chunk: 40 queries after 260 cached keys
    scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(H // HKV, dim=1)) * D ** -0.5
    visible = torch.arange(300) <= torch.arange(40)[:, None] + 260
    start = int(s["cu_q"][2])
    torch.testing.assert_close(lse[:, start:start + 40].double(),
                               scores.masked_fill(~visible, -math.inf).logsumexp(-1), atol=1e-4, rtol=1e-5)


def test_varlen_packed_without_block_table_matches_naive():
    s = scenario(torch.float32)
    out = varlen(FlashReference(allow_float32=True), s, k=torch.cat(s["ks"]), v=torch.cat(s["vs"]), block_table=None)
    torch.testing.assert_close(out.double(), expected(s), atol=1e-5, rtol=1e-5)


def test_with_kvcache_decode_matches_naive():
    s = scenario(torch.float32, requests=[(1, 300), (1, 1), (1, 512), (1, 257)])
    ref = FlashReference(allow_float32=True)
    out = ref.flash_attn_with_kvcache(**decode_args(s, [0, 1, 2, 3]))
    assert out.shape == (4, 1, H, D)
    torch.testing.assert_close(out[:, 0].double(), expected(s), atol=1e-5, rtol=1e-5)
    assert ref.calls[-1]["k_lens"] == [300, 1, 512, 257]


def test_with_kvcache_appends_new_kv_then_attends_to_it():
    s = scenario(torch.float32, requests=[(3, 300), (3, 3)])  # 3 new tokens after 297 and after 0 cached
    ref = FlashReference(allow_float32=True)
    args = decode_args(s, [0, 1])
    new_k = torch.stack([s["ks"][b][-3:] for b in (0, 1)])  # [B, 3, Hkv, D]
    new_v = torch.stack([s["vs"][b][-3:] for b in (0, 1)])
    for cache in (args["k_cache"], args["v_cache"]):
        cache.zero_()  # nothing cached yet: the old tokens are written back below, the new ones by the call
    for b in (0, 1):
        for p in range(len(s["ks"][b]) - 3):
            block = int(s["block_table"][b, p // PAGE])
            args["k_cache"][block, p % PAGE], args["v_cache"][block, p % PAGE] = s["ks"][b][p], s["vs"][b][p]
    args.update(q=torch.stack(s["qs"]), k=new_k, v=new_v, cache_seqlens=torch.tensor([297, 0], dtype=torch.int32))
    out = ref.flash_attn_with_kvcache(**args)
    torch.testing.assert_close(out.flatten(0, 1).double(), expected(s), atol=1e-5, rtol=1e-5)
    block = int(s["block_table"][0, 298 // PAGE])
    assert torch.equal(args["k_cache"][block, 298 % PAGE], s["ks"][0][298])  # written in place


def test_with_kvcache_contiguous_cache_and_lse():
    torch.manual_seed(3)
    q, k_cache, v_cache = torch.randn(2, 1, H, D), torch.randn(3, 40, HKV, D), torch.randn(3, 40, HKV, D)
    seqlens = torch.tensor([40, 17], dtype=torch.int32)
    out, lse = FlashReference(allow_float32=True).flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=seqlens, causal=True, return_softmax_lse=True)
    for b, n in enumerate((40, 17)):
        torch.testing.assert_close(out[b].double(), naive(q[b], k_cache[b, :n], v_cache[b, :n], True, D ** -0.5),
                                   atol=1e-5, rtol=1e-5)
    assert lse.shape == (2, H, 1) and torch.isfinite(lse).all()


def test_small_pages_only_when_relaxed():
    s = scenario(torch.float32, page=4)
    with pytest.raises(FlashCheckError, match="divisible by 256"):
        varlen(FlashReference(allow_float32=True), s)
    out = varlen(FlashReference(allow_float32=True, page_multiple=4), s)
    torch.testing.assert_close(out.double(), expected(s), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------- refusals

def strided_int32(values: list[int]) -> torch.Tensor:
    return torch.tensor([x for v in values for x in (v, -1)], dtype=torch.int32)[::2]  # same values, not contiguous


VARLEN_REFUSALS = {
    "float32 without opt-in": (dict(dtype=torch.float32, strict=True), "fp16 and bf16"),
    "k dtype differs": (dict(k="fp16"), "query and key must have the same dtype"),
    "cu_seqlens_q int64": (dict(cu_seqlens_q="int64"), "cu_seqlens_q must have dtype int32"),
    "cu_seqlens_k not contiguous": (dict(cu_seqlens_k="strided"), "cu_seqlens_k must be contiguous"),
    "block_table int64": (dict(block_table="int64"), "block_table must have dtype torch.int32"),
    "block_table column-major": (dict(block_table="column_major"), "block_table must have contiguous last dimension"),
    "block_table too narrow": (dict(block_table="narrow"), "block_table rows hold only"),
    "block id out of range": (dict(block_table="out_of_range"), "outside"),
    "max_seqlen_q understated": (dict(max_seqlen_q=39), "max_seqlen_q=39 is below"),
    "max_seqlen_k understated": (dict(max_seqlen_k=299), "max_seqlen_k=299 is below"),
    "max_seqlen_k a tensor": (dict(max_seqlen_k="tensor"), "max_seqlen_k must be an int"),
    "total_q past cu_seqlens_q": (dict(q="extra_row"), "must equal total_q"),
    "cache not [blocks, page, Hkv, D]": (dict(k="three_dims"), "k_cache, v_cache must be"),
}


@pytest.mark.parametrize("case", list(VARLEN_REFUSALS))
def test_varlen_refuses(case):
    change, match = VARLEN_REFUSALS[case]
    s = scenario(torch.bfloat16)
    ref = FlashReference()
    overrides = {}
    if change.get("dtype") == torch.float32:
        s = scenario(torch.float32)
    for name, how in change.items():
        if how == "fp16":
            overrides[name] = s["k_cache"].half()
        elif how == "int64":
            overrides[name] = (s["cu_q"] if name == "cu_seqlens_q" else s["block_table"]).long()
        elif how == "strided":
            overrides[name] = strided_int32(s["cu_k"].tolist())
        elif how == "column_major":
            overrides[name] = s["block_table"].t().contiguous().t()
        elif how == "narrow":
            overrides[name] = s["block_table"][:, :1].contiguous()
        elif how == "out_of_range":
            table = s["block_table"].clone()
            table[0, 1] = s["k_cache"].shape[0]
            overrides[name] = table
        elif how == "tensor":
            overrides[name] = torch.tensor(s["max_k"])
        elif how == "extra_row":
            overrides[name] = torch.cat([s["q"], s["q"][:1]])
        elif how == "three_dims":
            overrides.update(k=s["k_cache"].flatten(0, 1), v=s["v_cache"].flatten(0, 1))
        elif name not in ("dtype", "strict"):
            overrides[name] = how
    with pytest.raises(FlashCheckError, match=match):
        varlen(ref, s, **overrides)


@pytest.mark.parametrize("head_dim, heads, match", [(12, (4, 2), "multiple of 8"), (264, (4, 2), "at most 256"),
                                                    (64, (6, 4), "must divide")])
def test_head_rules_refused(head_dim, heads, match):
    q = torch.randn(3, heads[0], head_dim, dtype=torch.bfloat16)
    cache = torch.zeros(2, PAGE, heads[1], head_dim, dtype=torch.bfloat16)
    cu = torch.tensor([0, 3], dtype=torch.int32)
    with pytest.raises(FlashCheckError, match=match):
        FlashReference().flash_attn_varlen_func(q, cache, cache, cu, cu, 3, 3, causal=True,
                                                block_table=torch.tensor([[1]], dtype=torch.int32))


@pytest.mark.parametrize("option, value", [("dropout_p", 0.1), ("alibi_slopes", torch.zeros(H))])
def test_varlen_unsupported_options_raise(option, value):
    with pytest.raises(NotImplementedError, match=option):
        varlen(FlashReference(), scenario(torch.bfloat16), **{option: value})


KVCACHE_REFUSALS = {
    "cache_seqlens int64": (lambda a: a.update(cache_seqlens=a["cache_seqlens"].long()), "must have dtype int32"),
    "cache_seqlens not contiguous": (lambda a: a.update(cache_seqlens=strided_int32(a["cache_seqlens"].tolist())),
                                     "cache_seqlens must be contiguous"),
    "cache_seqlens wrong length": (lambda a: a.update(cache_seqlens=a["cache_seqlens"][:1]), "shape"),
    "int cache_seqlens with pages": (lambda a: a.update(cache_seqlens=5), "int cache_seqlens"),
    "longer than block_table": (lambda a: a.update(cache_seqlens=a["cache_seqlens"] + 300), "exceeds"),
    "cache_batch_idx with pages": (lambda a: a.update(cache_batch_idx=torch.zeros(2, dtype=torch.int32)),
                                   "does not support cache_batch_idx"),
    "cache last dim strided": (lambda a: a.update(k_cache=a["k_cache"].transpose(2, 3).contiguous().transpose(2, 3)),
                               "contiguous last dimension"),
    "num_splits > 128": (lambda a: a.update(num_splits=129), "num_splits > 128"),
    "k without cache_seqlens": (lambda a: a.update(k=torch.zeros(2, 1, HKV, D, dtype=torch.bfloat16),
                                                   v=torch.zeros(2, 1, HKV, D, dtype=torch.bfloat16),
                                                   cache_seqlens=None), "seqlens_k must also be passed"),
}


@pytest.mark.parametrize("case", list(KVCACHE_REFUSALS))
def test_with_kvcache_refuses(case):
    change, match = KVCACHE_REFUSALS[case]
    args = decode_args(scenario(torch.bfloat16, requests=[(1, 300), (1, 7)]), [0, 1])
    change(args)
    with pytest.raises(FlashCheckError, match=match):
        FlashReference().flash_attn_with_kvcache(**args)


@pytest.mark.parametrize("option, value", [("rotary_cos", torch.zeros(8, 8)), ("cache_leftpad", None)])
def test_with_kvcache_unsupported_options_raise(option, value):
    args = decode_args(scenario(torch.bfloat16, requests=[(1, 300)]), [0])
    if option == "cache_leftpad":  # with a paged cache flash-attn itself refuses it
        args.update(cache_leftpad=torch.zeros(1, dtype=torch.int32))
        with pytest.raises(FlashCheckError, match="leftpad"):
            FlashReference().flash_attn_with_kvcache(**args)
        return
    with pytest.raises(NotImplementedError, match=option):
        FlashReference().flash_attn_with_kvcache(**args, **{option: value})


# ---------------------------------------------------------------------------------------------- installs

def test_fa4_only_install_imports_as_a_namespace_package_without_the_functions(tmp_path):
    """flash-attn-4 installs only flash_attn/cute/: `import flash_attn` succeeds, the FA2 names do not."""
    (tmp_path / "flash_attn" / "cute").mkdir(parents=True)
    (tmp_path / "flash_attn" / "cute" / "__init__.py").write_text("")
    probe = textwrap.dedent("""
        import flash_attn
        print(flash_attn.__file__, getattr(flash_attn, "__version__", None),
              hasattr(flash_attn, "flash_attn_varlen_func"))
        try:
            from flash_attn import flash_attn_varlen_func
        except ImportError as error:
            print("ImportError")
    """)
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["None", "None", "False", "ImportError"]


def test_fake_module_carries_version_and_functions():
    ref = FlashReference(page_multiple=4, allow_float32=True)
    module = fake_flash_attn_module(ref, version="2.5.7")
    assert module.__version__ == "2.5.7" and module.flash_attn_varlen_func.__self__ is ref


@pytest.mark.parametrize("window", [1, 4, 17])
def test_window_size_keeps_the_last_keys(window):
    """window_size=(w - 1, 0) with causal: each query sees its own key and the w - 1 before it, in both
    entry points, as the loop-by-loop `naive` counts them. Catches a window one key too wide or too narrow."""
    s = scenario(torch.float32)
    ref = FlashReference(allow_float32=True)
    want = torch.cat([naive(q, k, v, True, D ** -0.5, window) for q, k, v in zip(s["qs"], s["ks"], s["vs"])])
    torch.testing.assert_close(varlen(ref, s, window_size=(window - 1, 0)), want.float(), atol=1e-5, rtol=1e-5)
    rows = [b for b, (sq, sk) in enumerate(REQUESTS) if sq == 1]
    got = ref.flash_attn_with_kvcache(**decode_args(s, rows), window_size=(window - 1, 0))[:, 0]
    torch.testing.assert_close(got, torch.cat([want[s["cu_q"][b]:s["cu_q"][b] + 1] for b in rows]).float(),
                               atol=1e-5, rtol=1e-5)
