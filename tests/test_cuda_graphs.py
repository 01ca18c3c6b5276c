"""CUDA graphs for decode steps (nanoserve/extensions/cuda_graphs.py), checked on the CPU: a graph cannot be captured
here, so `capture` is replaced by one whose replay runs the captured function again. It reads the same
static tensors a CUDA graph would, so what is checked is everything around the capture: which graph a
step picks, the rows copied in, the padding rows, lm_head on the rows that sample. The flash backend runs
through tests/flash_reference.py (float32, pages of 4 tokens), as the graphs run only with it.
scripts/gpu_check.py captures real graphs on a GPU."""
import logging
import sys
from types import SimpleNamespace

import pytest
import torch
from test_engine import MAX_TOKENS, PROMPTS
from test_gemma import GEMMAS

from conftest import build_tiny_model, greedy, reference
from flash_reference import FlashReference, fake_flash_attn_module
from nanoserve import LLM, SamplingParams, model_runner
from nanoserve.batch import build_batch
from nanoserve.config import Config, cdiv
from nanoserve.extensions import cuda_graphs
from nanoserve.sequence import Sequence


def replay_by_running_again(run, pool):
    return run, None


@pytest.fixture
def graphs_on_cpu(monkeypatch):
    """LLM(...) with the flash backend (the reference standing in for flash-attn) and decode graphs
    attached as on CUDA; every replay is recorded as (requests, graph size, the rows lm_head takes)."""
    monkeypatch.setitem(sys.modules, "flash_attn", fake_flash_attn_module(FlashReference(1, allow_float32=True)))
    monkeypatch.setattr(model_runner, "select_attention", lambda name, block_size, *args: ("flash", block_size))
    monkeypatch.setattr(cuda_graphs, "capture", replay_by_running_again)
    replays = []
    replay = cuda_graphs.DecodeGraphs.replay

    def recorded(self, batch):
        n = len(batch.seq_lens)
        replays.append((n, next(s for s in self.sizes if s >= n), batch.logits_indices.tolist()))
        return replay(self, batch)
    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "replay", recorded)

    def make(path: str, **options) -> LLM:
        llm = LLM(path, block_size=4, **options)
        runner = llm.engine.model_runner
        runner.graphs = cuda_graphs.DecodeGraphs(runner.model, runner.kv_cache, llm.engine.config.max_num_seqs,
                                                 cdiv(llm.engine.max_model_len, runner.block_size))
        return llm
    return make, replays


@pytest.mark.parametrize("setup", [dict(), dict(num_kvcache_blocks=18, max_model_len=64)])
def test_decode_graphs_match_transformers(tiny_models, graphs_on_cpu, setup):
    """Greedy through the graphs is token-exact with transformers: decodes of 1 to 6 requests padded to
    graphs of 1, 2, 4 and 8 rows, a step of fewer requests after one of more in the same graph (the
    padding rows must be reset, or a request that left writes its old slot, which a new owner may hold),
    and with preemption (blocks freed and handed to others). Catches a wrong graph size (rows cut off),
    requests' arrays copied to the wrong rows, stale block tables, and lm_head on the wrong rows."""
    make, replays = graphs_on_cpu
    llm = make(tiny_models["gqa"], max_num_seqs=8, **setup)
    outputs = llm.generate(PROMPTS, [greedy(n) for n in MAX_TOKENS], use_tqdm=False)
    assert [o.token_ids for o in outputs] == reference(tiny_models["gqa"], PROMPTS, MAX_TOKENS)
    assert llm.engine.model_runner.graphs.sizes == [1, 2, 4, 8]
    assert any(n < size for n, size, _ in replays) and {1, 2, 4} <= {size for _, size, _ in replays}
    assert any(later < earlier <= size for (earlier, size, _), (later, _, _) in zip(replays, replays[1:]))
    if setup:
        assert llm.engine.scheduler.num_preemptions > 0
    null_block = llm.engine.model_runner.kv_cache[:, :, 0]  # [2, layers, block_size, Hkv, D]
    assert null_block[:, :, 1:].abs().sum() == 0  # padding writes slot 0 alone


def test_decode_graphs_serve_prompt_chunks_of_one_token_and_their_logprobs(tiny_models, graphs_on_cpu):
    """A step of one-token rows is decode-only even where a row is a prompt's middle token, which samples
    nothing, or gives a prompt logprob. lm_head must take the rows logits_indices names, not the first
    ones: the same tokens, logprobs and prompt logprobs as the eager engine."""
    make, replays = graphs_on_cpu
    params = [SamplingParams(temperature=0, max_tokens=6, logprobs=2, prompt_logprobs=1 if i % 2 else None)
              for i in range(5)]
    options = dict(max_num_seqs=4, max_num_batched_tokens=2)  # a prompt beside a decode gets 1 token a step
    graphs = make(tiny_models["gqa"], **options).generate(PROMPTS[:5], params, use_tqdm=False)
    eager = LLM(tiny_models["gqa"], block_size=4, **options).generate(PROMPTS[:5], params, use_tqdm=False)
    assert any(rows != list(range(n)) for n, _, rows in replays)  # e.g. [1]: the decode after a prompt's token
    assert [o.outputs[0].token_ids for o in graphs] == [o.outputs[0].token_ids for o in eager]
    for ours, theirs in zip(graphs, eager):
        for got, want in zip((ours.prompt_logprobs or [None])[1:] + ours.outputs[0].logprobs,
                             (theirs.prompt_logprobs or [None])[1:] + theirs.outputs[0].logprobs):
            assert got.keys() == want.keys()
            assert all(got[t].logprob == pytest.approx(want[t].logprob, abs=1e-4) for t in got)


@pytest.mark.parametrize("model", ["gqa", "gemma2"])
def test_a_replay_returns_what_the_model_returns(tiny_models, graphs_on_cpu, tmp_path, model):
    """replay(batch) against model(batch) on decode-only batches built by hand: a prompt's middle token
    (with a prompt logprob) before a decode, so the rows lm_head takes are [1, 0], not the first ones;
    then the decode alone. Gemma 2 (test_gemma.py's): catches the replay's logits left uncapped, and flash-attn
    not given the softcap."""
    make, _ = graphs_on_cpu
    path = tiny_models[model] if model == "gqa" else build_tiny_model(str(tmp_path), **GEMMAS[model])
    runner = make(path, max_num_seqs=2).engine.model_runner
    prompt = Sequence("prompt", None, list(range(3, 9)), SamplingParams(prompt_logprobs=1))  # 6 tokens
    prompt.num_computed_tokens, prompt.block_table = 3, [1, 2]
    decode = Sequence("decode", None, list(range(20, 25)), SamplingParams())  # 4 prompt tokens, 1 generated
    decode.num_prompt_tokens, decode.num_computed_tokens, decode.block_table = 4, 4, [3, 4]
    for scheduled, rows in (([(prompt, 1), (decode, 1)], [1, 0]), ([(decode, 1)], [0])):
        batch = build_batch(scheduled, runner.block_size, runner.device)
        assert batch.is_decode_only and batch.logits_indices.tolist() == rows
        with torch.inference_mode():  # as ModelRunner.run
            expected = runner.model(batch, runner.kv_cache)  # writes the same k, v to the same slots
            torch.testing.assert_close(runner.graphs.replay(batch), expected)


def test_where_graphs_are_not_captured(tiny_models, monkeypatch, caplog):
    """Only enforce_eager=False on CUDA tries; without the flash backend, with tensor parallelism, or where
    capturing fails, decode steps run without graphs after one log line naming why."""
    config = Config(tiny_models["gqa"], enforce_eager=False)
    cpu = SimpleNamespace(device=torch.device("cpu"), backend="flash")
    assert cuda_graphs.capture_graphs(cpu, config, 64) is None
    cuda = SimpleNamespace(device=torch.device("cuda"), backend="torch", block_size=4, model=None, kv_cache=None)
    assert cuda_graphs.capture_graphs(cuda, Config(tiny_models["gqa"]), 64) is None  # enforce_eager: silent
    assert not caplog.records

    def fail(run, pool):
        raise RuntimeError("planted: operation not permitted when stream is capturing")
    monkeypatch.setattr(cuda_graphs, "capture", fail)
    llm = LLM(tiny_models["gqa"], block_size=4)
    flash = SimpleNamespace(device=torch.device("cuda"), backend="flash", block_size=4,
                            model=llm.engine.model_runner.model, kv_cache=llm.engine.model_runner.kv_cache)
    tensor_parallel = Config(tiny_models["gqa"], enforce_eager=False, tensor_parallel_size=2)
    with caplog.at_level(logging.WARNING):
        for runner, asked in ((cuda, config), (flash, tensor_parallel), (flash, config)):
            assert cuda_graphs.capture_graphs(runner, asked, 64) is None
    prefix = "enforce_eager=False, but decode steps run without CUDA graphs: "
    assert [r.getMessage() for r in caplog.records] == [
        prefix + "they need the flash or triton attention backend", prefix + "not with tensor parallelism",
        prefix + "RuntimeError: planted: operation not permitted when stream is capturing"]
