"""The compiled step (nanoserve/compilation.py): token-exact with transformers as the eager step is,
compiled in the warm-up and never again while serving, and eager after one log line where compiling
fails. Compiling costs seconds per model and process (later engines of the same model reuse it), so
these tests keep to two tiny models."""
import logging
import random

import pytest
import torch
from test_engine import MAX_TOKENS, PROMPTS, SETUPS
from torch._dynamo.utils import counters

from conftest import greedy, reference
from nanoserve import LLM, SamplingParams, compilation
from nanoserve.layers import linear


def run_without_recompiles(llm: LLM, prompts: list[list[int]], max_tokens: list[int],
                           monkeypatch) -> list[list[int]]:
    """Generate; any recompilation after the warm-up is an error (torch's own check), and the number
    of graphs compiled stays what the warm-up left."""
    graphs = counters["stats"]["unique_graphs"]
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    outputs = llm.generate(prompts, [greedy(n) for n in max_tokens], use_tqdm=False)
    assert counters["stats"]["unique_graphs"] == graphs
    return [o.token_ids for o in outputs]


@pytest.mark.parametrize("setup", ["block_size_4", "chunked_prefill", "preemption"])
@pytest.mark.parametrize("model", ["gqa", "qwen2"])
def test_compiled_step_matches_transformers(tiny_models, model, setup, monkeypatch):
    """test_engine.py's parity test (eager) with enforce_eager=False: mixed batches, prompt chunks beside
    decodes, preemption; Qwen2 for its q, k, v biases."""
    llm = LLM(tiny_models[model], enforce_eager=False, **SETUPS[setup])
    assert llm.engine.model_runner.compiled
    assert run_without_recompiles(llm, PROMPTS, MAX_TOKENS, monkeypatch) == reference(tiny_models[model],
                                                                                      PROMPTS, MAX_TOKENS)
    if setup == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0


def test_a_long_mixed_run_never_recompiles(tiny_models, monkeypatch):
    """Prompt chunks, decodes of 1 to 8 rows, one-token prompts, preemption, all in one run: each step's N
    differs, and the warm-up's graphs serve them all."""
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.choice([1, 2, 3, 9, 17, 30]))] for _ in range(16)]
    max_tokens = [rng.randint(1, 30) for _ in prompts]
    llm = LLM(tiny_models["gqa"], enforce_eager=False, block_size=4, num_kvcache_blocks=24, max_model_len=64,
              max_num_batched_tokens=16, max_num_seqs=8)
    assert run_without_recompiles(llm, prompts, max_tokens, monkeypatch) == reference(tiny_models["gqa"], prompts,
                                                                                      max_tokens)
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("failing", ["torch.compile", "warm-up"])
def test_a_failing_compile_falls_back_to_eager_with_one_log_line(tiny_models, monkeypatch, caplog, failing):
    """Compiling fails (forced: as with no C++ compiler, or an op inductor cannot lower): LLM() still
    starts, eager, with its linears laid out as an enforce_eager=True engine's, and says why once."""
    def fail(*args, **kwargs):
        raise RuntimeError("planted: no working C++ compiler")
    monkeypatch.setattr(*((torch, "compile") if failing == "torch.compile" else (compilation, "warm_up")), fail)
    with caplog.at_level(logging.WARNING):
        llm = LLM(tiny_models["gqa"], enforce_eager=False, block_size=4)
    assert [r.getMessage() for r in caplog.records] == [
        "enforce_eager=False, but the model runs eager: RuntimeError: planted: no working C++ compiler"]
    model = llm.engine.model_runner.model
    assert not llm.engine.model_runner.compiled
    assert all(layer._compiled_call_impl is None for layer in model.model.layers)
    assert "forward" not in vars(model.model.attention)  # the class's own, not the compiled wrapper
    eager = LLM(tiny_models["gqa"], enforce_eager=True, block_size=4).engine.model_runner.model
    assert [type(m) for m in model.modules()] == [type(m) for m in eager.modules()]
    outputs = llm.generate(PROMPTS, [greedy(n) for n in MAX_TOKENS], use_tqdm=False)
    assert [o.token_ids for o in outputs] == reference(tiny_models["gqa"], PROMPTS, MAX_TOKENS)


def test_where_compiling_is_not_tried():
    assert "mps" in compilation.why_not_compile(torch.device("mps"), 1)
    assert "tensor parallelism" in compilation.why_not_compile(torch.device("cpu"), 2)
    assert compilation.why_not_compile(torch.device("cpu"), 1) is None


def test_bfloat16_compiles_whatever_layout_this_cpu_would_pick(tiny_models, monkeypatch):
    """bfloat16 compiles, on any CPU: the compiled model keeps nn.Linear (inductor lays the weights out),
    so it never meets PackedLinear, which inductor cannot lower. The layout choice is forced to "packed",
    as on a CPU with oneDNN's bf16 kernels, so an AVX2 machine takes that path too; a compiled step that
    still packed its linears would fall back here. Its logits are eager bfloat16's within bf16 rounding."""
    monkeypatch.setattr(linear, "choose_linear", lambda dtype, max_num_seqs: "packed")
    compiled = LLM(tiny_models["gqa"], dtype="bfloat16", enforce_eager=False, block_size=4)
    assert compiled.engine.model_runner.compiled
    model = compiled.engine.model_runner.model
    assert not any(isinstance(m, linear.PackedLinear) for m in model.modules())
    monkeypatch.undo()  # eager gets this CPU's own layout
    eager = LLM(tiny_models["gqa"], dtype="bfloat16", enforce_eager=True, block_size=4)
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    first, second = (llm.generate(PROMPTS, params, use_tqdm=False) for llm in (compiled, eager))
    for a, b in zip(first, second):
        top_a, top_b = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        shared = top_a.keys() & top_b.keys()
        assert len(shared) >= 3
        assert max(abs(top_a[t].logprob - top_b[t].logprob) for t in shared) < 0.1
