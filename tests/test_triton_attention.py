"""Tests for the triton attention backend (nanoserve/triton_backend.py) and its kernels
(nanoserve/kernels/triton_attention.py) on a CPU, in Triton's interpreter: the kernels against
tests/flash_reference.py (the plain per-request formulation), the engine against transformers.

Triton reads TRITON_INTERPRET when it defines a kernel, its own library's included, at its first import:
the variable must be set before anything imports triton, and set, it would reach every other test. So
the tests marked `interpreted` run in a subprocess of their own, started by `test_in_the_interpreter`
with TRITON_INTERPRET=1 (run them directly: TRITON_INTERPRET=1 pytest tests/test_triton_attention.py).
Under triton 3.9's interpreter float32 and float16 tl.dot are exact, bfloat16's is garbage: bfloat16
is for the GPU. Shapes are tiny, so that the interpreter runs in seconds.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton", reason="triton cannot be imported here (it has no macOS wheels)")

from test_attention import batch_of, cumsum0  # noqa: E402

import conftest  # noqa: E402
from conftest import greedy  # noqa: E402
from flash_reference import FlashReference  # noqa: E402
from nanoserve import LLM  # noqa: E402
from nanoserve.attention import select_attention  # noqa: E402
from nanoserve.config import cdiv  # noqa: E402
from nanoserve.extensions import cuda_graphs  # noqa: E402
from nanoserve.triton_backend import TritonBackend, interpreting  # noqa: E402

# flash-attn's checks, with float32 allowed and pages of 16 tokens (this kernel's smallest block_size)
REFERENCE = FlashReference(page_multiple=16, allow_float32=True)
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}


# the tests that need the interpreter: skipped here unless it is on, run by test_in_the_interpreter's subprocess
interpreted = pytest.mark.skipif(not interpreting(), reason="runs in test_in_the_interpreter's subprocess")


@pytest.mark.skipif(interpreting(), reason="the interpreter is on: the tests run in this process")
def test_in_the_interpreter():
    """This module's `interpreted` tests, in a pytest subprocess under TRITON_INTERPRET=1: each must pass."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not gpu", __file__]
    result = subprocess.run(command, cwd=Path(__file__).parent.parent, capture_output=True, text=True,
                            env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=900)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed, 1 skipped" in result.stdout, result.stdout[-2000:]  # skipped there: this test alone


@pytest.fixture(scope="module")
def kernels():
    """The kernel module (defined under the interpreter, which is on wherever these tests run)."""
    from nanoserve.kernels import triton_attention
    return triton_attention


def paged_cache(seq_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                seed: int):
    """Random caches `[num_blocks, block_size, Hkv, D]`, each request's blocks shuffled, block 0 (the null
    block) left to padding; and block_tables `[B, max_blocks]` int32 padded with 0."""
    rng = random.Random(seed)
    needed = [-(-n // block_size) for n in seq_lens]
    free = list(range(1, sum(needed) + 3))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in needed]
    width = max(1, *needed)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    shape = (sum(needed) + 3, block_size, num_kv_heads, head_dim)
    return torch.randn(shape).to(dtype), torch.randn(shape).to(dtype), block_tables


def check_against_reference(kernels, q_lens: list[int], k_lens: list[int], block_size: int, dtype: torch.dtype,
                            num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16,
                            seed: int = 0, softcap: float = 0.0, window: int | None = None) -> torch.Tensor:
    """One paged_attention call for the whole batch, compared with the reference; returns the output.
    A sliding `window` of w keys is flash-attn's window_size=(w - 1, 0)."""
    torch.manual_seed(seed)
    k_cache, v_cache, block_tables = paged_cache(k_lens, block_size, num_kv_heads, head_dim, dtype, seed)
    q = torch.randn(sum(q_lens), num_heads, head_dim).to(dtype)
    query_start_loc, seq_lens = cumsum0(q_lens), torch.tensor(k_lens, dtype=torch.int32)
    out = kernels.paged_attention(q, k_cache, v_cache, query_start_loc, seq_lens, block_tables, 0.3, softcap, window)
    window_size = (-1, -1) if window is None else (window - 1, 0)
    expected = REFERENCE.flash_attn_varlen_func(q, k_cache, v_cache, query_start_loc, cumsum0(k_lens), max(q_lens),
                                                max(k_lens), softmax_scale=0.3, causal=True, window_size=window_size,
                                                block_table=block_tables, softcap=softcap)
    torch.testing.assert_close(out.float(), expected.float(), **TOLERANCE[dtype])
    return out


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_chunks_and_decodes_in_one_call(kernels, block_size: int, dtype: torch.dtype):
    """A whole prompt longer than a tile, a chunk after 37 cached keys (crossing blocks), decodes with
    contexts crossing blocks and key tiles, a prompt of one token, more queries than keys (its first
    queries see nothing) and a request with no key at all. Catches a top-left causal mask, a wrong
    block (p // block_size) or offset, a tile of one request reading another's rows, keys lost at a
    tile's or block's edge, NaN for a query without a key."""
    q_lens = [70, 9, 1, 1, 1, 1, 6, 3]
    k_lens = [70, 46, 33, 1, 64, 17, 4, 0]
    out = check_against_reference(kernels, q_lens, k_lens, block_size, dtype, seed=block_size)
    starts = cumsum0(q_lens)
    assert torch.equal(out[starts[6]:starts[6] + 2], torch.zeros_like(out[:2]))  # 6 queries, 4 keys
    assert torch.equal(out[starts[7]:], torch.zeros_like(out[starts[7]:]))     # no key at all


@interpreted
def test_softcapped_scores(kernels):
    """Gemma 2's soft-capping, tanh(scores / 0.8) * 0.8 before the mask, on a prompt, a chunk and decodes, in
    float32 against the reference (which caps as flash-attn does). 0.8 is far below these scores (q and k
    are unit normals over 16 dims, times 0.3). Catches the cap dropped, applied after the mask (a masked
    key's -inf would become -0.8 and be seen) or applied before the scale."""
    check_against_reference(kernels, [20, 5, 1, 1], [20, 40, 33, 7], 16, torch.float32, seed=9, softcap=0.8)


@interpreted
@pytest.mark.parametrize("window", [1, 5, 16, 40])
def test_sliding_window(kernels, window: int):
    """Each query sees only its last `window` keys: prompts and chunks longer than the window, decodes far
    past it, a window wider than some contexts. Catches a window off by one key, a tile starting its keys
    after its first query's window begins, or a window ignored."""
    q_lens = [70, 9, 1, 1, 1, 6]
    k_lens = [70, 46, 33, 1, 64, 4]
    check_against_reference(kernels, q_lens, k_lens, 16, torch.float32, seed=window, window=window)


@interpreted
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_grouped_query_attention(kernels, num_heads: int, num_kv_heads: int):
    """Query head h reads KV head h // (num_heads // num_kv_heads); a group of 3 pads its tile rows to 4.
    Catches a head read from the wrong KV head, a padding head row stored over a real one."""
    check_against_reference(kernels, [5, 1, 1], [21, 40, 7], 16, torch.float32, num_heads, num_kv_heads, seed=3)


@interpreted
def test_decode_only_step_and_head_dim_not_a_power_of_two(kernels):
    """A decode-only step (one query per request: the kernel's short tiles) of 20 requests, head_dim 24
    rounded up to 32 in the tile. Catches a request found wrongly by the binary search over
    query_start_loc, the padded head dims leaking into scores or output."""
    rng = random.Random(5)
    k_lens = [rng.randint(1, 80) for _ in range(20)]
    check_against_reference(kernels, [1] * 20, k_lens, 16, torch.float16, head_dim=24, seed=5)


@interpreted
def test_padding_rows(kernels):
    """A CUDA graph's padded decode step: the real requests, then padding requests of one key in slot 0
    of the null block (their block table all 0), then rows of q past query_start_loc[-1]. The real
    rows must equal the reference, the rows past the last request must be 0. Catches padding that
    changes real rows, or rows past the last request left as garbage."""
    k_lens = [30, 3, 17]
    k_cache, v_cache, block_tables = paged_cache(k_lens, 16, 2, 16, torch.float32, seed=7)
    padded_tables = torch.cat([block_tables, torch.zeros(2, block_tables.shape[1], dtype=torch.int32)])
    q = torch.randn(7, 4, 16)  # 3 real rows, 2 padding requests, 2 rows past query_start_loc[-1]
    seq_lens = torch.tensor(k_lens + [1, 1], dtype=torch.int32)
    out = kernels.paged_attention(q, k_cache, v_cache, cumsum0([1] * 5), seq_lens, padded_tables, 0.3)
    expected = REFERENCE.flash_attn_with_kvcache(q[:3, None], k_cache, v_cache, block_table=block_tables,
                                                 cache_seqlens=torch.tensor(k_lens, dtype=torch.int32),
                                                 softmax_scale=0.3, causal=True)[:, 0]
    torch.testing.assert_close(out[:3], expected)
    assert torch.equal(out[5:], torch.zeros(2, 4, 16))


@interpreted
def test_the_backend_stores_then_attends(kernels):
    """TritonBackend.forward on a prompt chunk after cached keys: the step's own keys are written first
    and then read through the block table. Catches attention run before the store (a query missing
    its own key) or k and v swapped."""
    torch.manual_seed(13)
    k_cache, v_cache, block_tables = paged_cache([20], 16, 2, 16, torch.float32, seed=13)
    kv_cache = torch.stack([k_cache, v_cache])[:, None]  # one layer's: [2, 1, num_blocks, block_size, Hkv, D]
    k_cache, v_cache = kv_cache[:, 0]  # views: what the backend writes, layer 0
    batch = batch_of([4], [20], block_tables)
    positions = torch.arange(16, 20)
    slots = block_tables[0, positions // 16].long() * 16 + positions % 16
    batch = type(batch)(**{**batch.__dict__, "slot_mapping": slots})
    q, k, v = torch.randn(4, 4, 16), torch.randn(4, 2, 16), torch.randn(4, 2, 16)
    backend = TritonBackend(0.3)
    out = backend.forward(q, k, v, kv_cache, 0, backend.prepare(batch, 16, torch.float32))
    assert torch.equal(k_cache.view(-1, 2, 16)[slots], k) and torch.equal(v_cache.view(-1, 2, 16)[slots], v)
    expected = REFERENCE.flash_attn_varlen_func(q, k_cache, v_cache, cumsum0([4]), cumsum0([20]), 4, 20,
                                                softmax_scale=0.3, causal=True, block_table=block_tables)
    torch.testing.assert_close(out, expected)


@interpreted
def test_the_custom_op_passes_opcheck(kernels):
    """torch.library.opcheck on nanoserve::triton_attention: its schema (the KV cache mutated, nothing
    else), its fake implementation (the output's shape and dtype, for torch.compile) and its tracing.
    Catches a mutation not declared, which a compiled step would reorder or drop, or a wrong fake output."""
    torch.manual_seed(17)
    k_cache, v_cache, block_tables = paged_cache([20, 3], 16, 2, 16, torch.float32, seed=17)
    q, k, v = torch.randn(5, 4, 16), torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    slot_mapping = (block_tables[[0, 0, 0, 0, 1], [1, 1, 1, 1, 0]].long() * 16 + torch.tensor([16, 17, 18, 19, 2]) % 16)
    kv_cache = torch.stack([k_cache, v_cache])[:, None]  # one layer's: [2, 1, num_blocks, block_size, Hkv, D]
    args = (q, k, v, kv_cache, 0, slot_mapping, cumsum0([4, 1]), torch.tensor([20, 3], dtype=torch.int32),
            block_tables, 0.3, 1.5, 8)  # softcap 1.5: Gemma 2's capped scores; an 8-key sliding window
    torch.library.opcheck(torch.ops.nanoserve.triton_attention.default, args)


# ----------------------------------------------------------------------------- the engine, end to end

ENGINE_PROMPTS = [[5 + (7 * i + 3 * j) % 250 for j in range(n)] for i, n in enumerate((33, 5, 41, 27, 20, 1))]
ENGINE_PROMPTS[3][:16] = ENGINE_PROMPTS[4][:16] = ENGINE_PROMPTS[0][:16]  # a 16-token block in common with 0
ENGINE_MAX_TOKENS = [12, 20, 7, 15, 9, 18]


@interpreted
def test_engine_matches_transformers(tiny_models):
    """LLM(attention_backend="triton") in float32 is token-exact with transformers' greedy generate,
    through chunked prefill (32-token steps: the 41-token prompt in chunks, beside decodes), preemption
    (4 blocks of 16 for five requests) and a prefix-cache hit (prompt 4 reuses prompt 0's first block). Catches
    anything the kernel tests miss between the Batch and the kernels: a wrong array passed, a stale
    slot after preemption, a prefix hit's cached keys not found."""
    path = tiny_models["gqa"]
    llm = LLM(path, attention_backend="triton", device="cpu", dtype="float32", block_size=16,
              max_num_batched_tokens=32, num_kvcache_blocks=5, max_model_len=64)
    assert isinstance(llm.engine.model_runner.model.model.attention, TritonBackend)
    expected = conftest.reference(path, ENGINE_PROMPTS, ENGINE_MAX_TOKENS)
    [first] = llm.generate(ENGINE_PROMPTS[:1], [greedy(ENGINE_MAX_TOKENS[0])], use_tqdm=False)
    rest = llm.generate(ENGINE_PROMPTS[1:], [greedy(n) for n in ENGINE_MAX_TOKENS[1:]], use_tqdm=False)
    assert [o.token_ids for o in [first, *rest]] == expected
    assert rest[3].num_cached_tokens == 16  # the prefix hit
    assert llm.engine.scheduler.num_preemptions > 0


@interpreted
def test_gemma2_engine_matches_transformers(tmp_path):
    """Gemma 2 (soft-capped scores, query_pre_attn_scalar's scale) through the triton backend is token-exact
    with transformers' eager attention. Catches the backend's softcap not reaching the kernel."""
    from test_gemma import GEMMAS, MAX_TOKENS, PROMPTS
    path = conftest.build_tiny_model(str(tmp_path), **GEMMAS["gemma2"])
    llm = LLM(path, attention_backend="triton", device="cpu", dtype="float32", block_size=16)
    outputs = llm.generate(PROMPTS, [greedy(n) for n in MAX_TOKENS], use_tqdm=False)
    expected = conftest.hf_greedy(path, PROMPTS, MAX_TOKENS, attn_implementation="eager")
    assert [o.token_ids for o in outputs] == expected


@interpreted
def test_engine_with_a_sliding_window_matches_transformers(tmp_path):
    """A tiny Mistral with an 8-token window, prompts and outputs several windows long, in 16-token steps
    (prompts in chunks beside decodes): token-exact with transformers' eager attention. Catches the
    backend dropping the layer's window on its way to the kernel."""
    from test_sliding_window import hf_greedy_eager
    path = conftest.build_tiny_model(str(tmp_path), "mistral", head_dim=8, seed=1, sliding_window=8)
    prompts, max_tokens = ENGINE_PROMPTS[:3], [24, 30, 10]
    llm = LLM(path, attention_backend="triton", device="cpu", dtype="float32", block_size=16,
              max_num_batched_tokens=16)
    outputs = llm.generate(prompts, [greedy(n) for n in max_tokens], use_tqdm=False)
    assert [o.token_ids for o in outputs] == hf_greedy_eager(path, prompts, max_tokens)


@interpreted
def test_decode_graphs_with_the_triton_backend(tiny_models, monkeypatch):
    """Decode graphs (cuda_graphs.py) over the triton backend, in their CPU dry run: `capture` replaced by
    one whose replay runs the captured function again on the same static Batch. Token-exact with
    transformers through graphs of 1, 2, 4 and 8 rows with padding rows. Catches a kernel that reads
    a Python value a graph would freeze, or padding rows (slot 0 of the null block) reaching real ones."""
    monkeypatch.setattr(cuda_graphs, "capture", lambda run, pool: (run, None))
    replays = []
    replay = cuda_graphs.DecodeGraphs.replay

    def recorded(self, batch):
        replays.append((len(batch.seq_lens), next(s for s in self.sizes if s >= len(batch.seq_lens))))
        return replay(self, batch)
    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "replay", recorded)
    path = tiny_models["gqa"]
    llm = LLM(path, attention_backend="triton", device="cpu", dtype="float32", block_size=16, max_num_seqs=8)
    runner = llm.engine.model_runner
    runner.graphs = cuda_graphs.DecodeGraphs(runner.model, runner.kv_cache, 8, cdiv(llm.engine.max_model_len, 16))
    outputs = llm.generate(ENGINE_PROMPTS, [greedy(n) for n in ENGINE_MAX_TOKENS], use_tqdm=False)
    assert [o.token_ids for o in outputs] == conftest.reference(path, ENGINE_PROMPTS, ENGINE_MAX_TOKENS)
    assert any(n < size for n, size in replays) and {1, 2, 4, 8} <= {size for _, size in replays}
    assert runner.kv_cache[:, :, 0, 1:].abs().sum() == 0  # padding writes slot 0 of the null block alone


@interpreted
def test_the_compiled_step_never_recompiles(tiny_models, monkeypatch):
    """enforce_eager=False with the triton backend (compilation.py: the layers compiled, attention between
    them eager), then a run of prompt chunks, decodes and preemption with torch's error_on_recompile on,
    token-exact with transformers. Catches attention metadata that a guard reads as Python values
    (lengths, lists, host arrays), which would recompile as they change."""
    path = tiny_models["gqa"]
    llm = LLM(path, attention_backend="triton", enforce_eager=False, device="cpu", dtype="float32",
              block_size=16, max_num_batched_tokens=32, num_kvcache_blocks=5, max_model_len=64)
    assert llm.engine.model_runner.compiled
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    outputs = llm.generate(ENGINE_PROMPTS, [greedy(n) for n in ENGINE_MAX_TOKENS], use_tqdm=False)
    assert [o.token_ids for o in outputs] == conftest.reference(path, ENGINE_PROMPTS, ENGINE_MAX_TOKENS)
    assert llm.engine.scheduler.num_preemptions > 0


# ----------------------------------------------------------------------------- choosing the backend

def test_triton_forced_on_a_cpu_needs_the_interpreter(monkeypatch):
    """attention_backend="triton" on a CPU is a ValueError naming TRITON_INTERPRET without it, and runs
    with it; "auto" on a CPU stays the torch backend either way; bfloat16 under the interpreter is refused.
    Catches the GPU kernel launched on CPU tensors, or the interpreter picked where nobody asked."""
    cpu = torch.device("cpu")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        select_attention("triton", "auto", cpu, torch.float32, 16)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert select_attention("triton", "auto", cpu, torch.float32, 16) == ("triton", 16)
    assert select_attention("triton", 32, cpu, torch.float16, 16) == ("triton", 32)
    assert select_attention("auto", "auto", cpu, torch.float32, 16) == ("torch", 16)
    with pytest.raises(ValueError, match="bfloat16"):
        select_attention("triton", "auto", cpu, torch.bfloat16, 16)


def test_auto_on_cuda_takes_triton_where_flash_cannot_run(monkeypatch):
    """On CUDA without flash-attn 2, "auto" is the triton backend; where flash runs, flash stays.
    Catches the CPU-tuned torch backend chosen on a GPU, or triton shadowing flash."""
    from nanoserve import attention
    cuda = torch.device("cuda")
    monkeypatch.setattr(attention, "why_not_flash", lambda device, dtype, head_dim: "flash-attn is not importable")
    assert select_attention("auto", "auto", cuda, torch.bfloat16, 128) == ("triton", 16)
    assert select_attention("torch", "auto", cuda, torch.bfloat16, 128) == ("torch", 16)
    monkeypatch.setattr(attention, "why_not_flash", lambda device, dtype, head_dim: None)
    assert select_attention("auto", "auto", cuda, torch.bfloat16, 128) == ("flash", 256)
    assert select_attention("triton", "auto", cuda, torch.bfloat16, 128) == ("triton", 256)
