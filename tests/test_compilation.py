"""The compiled step (nanoserve/extensions/compilation.py): token-exact with transformers as the eager step is,
compiled in the warm-up and never again while serving, and eager after one log line where compiling
fails. Compiling costs seconds per model and process (later engines of the same model reuse it), so
these tests keep to two tiny models."""
import logging
import platform
import random

import pytest
import torch
from test_engine import MAX_TOKENS, PROMPTS, SETUPS
from test_sliding_window import MIXED_WINDOWS, hf_greedy_eager
from test_sliding_window import PROMPTS as WINDOW_PROMPTS
from torch._dynamo.utils import counters
from torch._inductor import freezing

from conftest import build_tiny_model, greedy, reference
from nanoserve import LLM, SamplingParams
from nanoserve.attention import plan_attention
from nanoserve.batch import build_batch
from nanoserve.config import cdiv
from nanoserve.device import X86
from nanoserve.extensions import compilation
from nanoserve.layers import linear
from nanoserve.sequence import Sequence


def run_without_recompiles(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """Generate; any recompilation after the warm-up is an error (torch's own check), and the number
    of graphs compiled stays what the warm-up left. The option is set through torch's own `patch`, which
    restores it: pytest's monkeypatch would delete it from torch's config module on undo (pytest >= 9.1)."""
    graphs = counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):
        outputs = llm.generate(prompts, [greedy(n) for n in max_tokens], use_tqdm=False)
    assert counters["stats"]["unique_graphs"] == graphs
    return [o.token_ids for o in outputs]


@pytest.mark.parametrize("setup", ["block_size_4", "chunked_prefill", "preemption"])
@pytest.mark.parametrize("model", ["gqa", "qwen2", "qwen3"])
def test_compiled_step_matches_transformers(tiny_models, model, setup):
    """test_engine.py's parity test (eager) with enforce_eager=False: mixed batches, prompt chunks beside
    decodes, preemption; Qwen2 for its q, k, v biases."""
    llm = LLM(tiny_models[model], enforce_eager=False, **SETUPS[setup])
    assert llm.engine.model_runner.compiled
    assert run_without_recompiles(llm, PROMPTS, MAX_TOKENS) == reference(tiny_models[model],
                                                                                      PROMPTS, MAX_TOKENS)
    if setup == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("model", ["mistral", "gemma2"])
def test_the_compiled_step_keeps_a_sliding_window(tmp_path, model):
    """A tiny Mistral (every layer) and a Gemma 2 (every other layer) with an 8-token window, compiled: each
    layer's window reaches the attention op, token-exact with transformers' eager attention through prompt
    chunks and decodes past the window. Gemma 2 also sends its softcap through the op."""
    if model == "mistral":
        path = build_tiny_model(str(tmp_path), "mistral", head_dim=8, seed=1, sliding_window=8)
    else:
        path = build_tiny_model(str(tmp_path), max_position_embeddings=512, **MIXED_WINDOWS["gemma2"])
    llm = LLM(path, enforce_eager=False, dtype="float32", block_size=4, max_num_batched_tokens=16)
    assert llm.engine.model_runner.compiled
    assert run_without_recompiles(llm, WINDOW_PROMPTS, [20] * 4) == hf_greedy_eager(path, WINDOW_PROMPTS, [20] * 4)


def test_a_long_mixed_run_never_recompiles(tiny_models):
    """Prompt chunks, decodes of 1 to 8 rows, one-token prompts, preemption, all in one run: each step's N
    differs, and the warm-up's graphs serve them all."""
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 256) for _ in range(rng.choice([1, 2, 3, 9, 17, 30]))] for _ in range(16)]
    max_tokens = [rng.randint(1, 30) for _ in prompts]
    llm = LLM(tiny_models["gqa"], enforce_eager=False, block_size=4, num_kvcache_blocks=24, max_model_len=64,
              max_num_batched_tokens=16, max_num_seqs=8)
    assert run_without_recompiles(llm, prompts, max_tokens) == reference(tiny_models["gqa"], prompts,
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


def test_one_request_engines_autotune_their_linears_and_stay_exact(tiny_models):
    """float32 at max_num_seqs=1: the linears are plain nn.Linear (layers/linear.py), which inductor's
    `max_autotune` gives its C++ GEMM templates where they time faster (at one row, on x86 they do), the
    prompt's graph and the one-row decode graph each their own. Catches a template or its choice that
    computes another product, or one that cannot take a prompt's N rows after being timed at 2, and
    packed weights (eager's, opaque to inductor) given to this engine."""
    llm = LLM(tiny_models["gqa"], enforce_eager=False, block_size=4, max_num_seqs=1)
    assert llm.engine.model_runner.compiled
    model = llm.engine.model_runner.model
    assert not any(isinstance(m, linear.PackedLinear) for m in model.modules())  # plain: inductor's to lay out
    assert run_without_recompiles(llm, PROMPTS, MAX_TOKENS) == reference(tiny_models["gqa"], PROMPTS, MAX_TOKENS)


def test_every_engine_of_a_process_compiles_its_own_graphs(tiny_models):
    """dynamo keeps a few graphs per code object (`recompile_limit`, 8): engines sharing the class's
    run_layers would, from the fifth on, run eager while saying compiled. With the limit at one engine's
    two graphs, the next engine still compiles both of its own."""
    with torch._dynamo.config.patch(recompile_limit=2):
        graphs = []
        for _ in range(2):
            LLM(tiny_models["gqa"], enforce_eager=False, block_size=4)
            graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1] - graphs[0] == 2


def test_the_weights_are_frozen_into_the_graph(tiny_models, monkeypatch):
    """On a CPU the compiled step freezes: inductor turns the model's weights into the graph's constants
    (torch's freezing.py, which this spies on), which it folds and lays out for this CPU. Catches freezing
    asked for where dynamo does not read it (`torch.compile(options={"freezing": True})` alone), which
    compiles every weight as a graph input and freezes nothing, silently."""
    frozen = []
    replace = freezing.replace_node_with_constant
    monkeypatch.setattr(freezing, "replace_node_with_constant",
                        lambda gm, node, tensor, *rest: frozen.append(tensor) or replace(gm, node, tensor, *rest))
    with torch._inductor.config.patch(force_disable_caches=True):  # a cached graph was frozen before, unseen
        llm = LLM(tiny_models["gqa"], enforce_eager=False, block_size=4)
    assert llm.engine.model_runner.compiled
    weights = {id(p) for p in llm.engine.model_runner.model.model.parameters()}
    assert weights <= {id(tensor) for tensor in frozen}


def test_where_compiling_is_not_tried():
    assert "mps" in compilation.why_not_compile(torch.device("mps"), 1)
    assert "tensor parallelism" in compilation.why_not_compile(torch.device("cpu"), 2)
    assert compilation.why_not_compile(torch.device("cpu"), 1) is None



@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_compiled_step_keeps_packed_linears(tiny_models, monkeypatch, dtype):
    """The compiled step runs oneDNN's packed weights (PackedLinear, through its own op), as eager does,
    so bfloat16 compiles where `choose_linear` packs it (every CPU with oneDNN bf16 kernels). The layout
    is forced to "packed" so that a machine that would not pick it takes the path too (float32 packs on
    any x86; bfloat16 packing needs AVX-512, so it is skipped on AVX2). Catches a packed linear that
    inductor cannot lower (the compile falls back: compiled is False) and a compiled model laid out
    otherwise than eager. Its logprobs are eager's within rounding (bfloat16: fused ops round apart)."""
    if platform.machine().lower() not in X86 or (dtype == "bfloat16" and not linear.has_onednn(torch.bfloat16)):
        pytest.skip("oneDNN cannot pack this dtype on this CPU")
    monkeypatch.setattr(linear, "choose_linear", lambda dtype, compiled_one_row: "packed")
    compiled = LLM(tiny_models["gqa"], dtype=dtype, enforce_eager=False, block_size=4)
    eager = LLM(tiny_models["gqa"], dtype=dtype, enforce_eager=True, block_size=4)
    assert compiled.engine.model_runner.compiled
    model = compiled.engine.model_runner.model
    assert sum(isinstance(m, linear.PackedLinear) for m in model.modules()) == 2 * 4 + 1  # 4 per layer + lm_head
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    first, second = (llm.generate(PROMPTS, params, use_tqdm=False) for llm in (compiled, eager))
    for a, b in zip(first, second):
        top_a, top_b = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        shared = top_a.keys() & top_b.keys()
        assert len(shared) >= 3
        assert max(abs(top_a[t].logprob - top_b[t].logprob) for t in shared) < (0.1 if dtype == "bfloat16" else 1e-3)


def mixed_step(block_size: int = 4):
    """A step of 10 decodes of different lengths (two decode groups of the torch backend's plan) and two
    prompt chunks, one after 5 cached tokens (its mask is not SDPA's is_causal), one a whole prompt."""
    scheduled, next_block = [], 1
    for i, (num_tokens, num_new) in enumerate([(3 + 2 * i, 1) for i in range(10)] + [(9, 4), (6, 6)]):
        seq = Sequence(str(i), None, list(range(3, 3 + num_tokens)), SamplingParams())
        seq.num_computed_tokens = num_tokens - num_new
        num_blocks = cdiv(num_tokens, block_size)
        seq.block_table = list(range(next_block, next_block + num_blocks))
        next_block += num_blocks
        scheduled.append((seq, num_new))
    return build_batch(scheduled, block_size, torch.device("cpu")), next_block


def test_the_plan_goes_through_the_op_as_it_was_built():
    """The torch backend's plan, made flat tensors (`flatten_plan`) and read back in the op (`unflatten_plan`),
    is the plan eager attention uses: every group's rows, block table and bias, every chunk's bounds,
    table and mask. Catches a group cut at the wrong row, a table or bias split at another width, or a
    chunk's bottom-right mask lost."""
    batch, _ = mixed_step()
    plan = plan_attention(batch, 4, torch.float32)
    assert len(plan.decode_groups) == 2 and len(plan.prefill_requests) == 2
    tensors = compilation.flatten_plan(plan, torch.float32)
    again = compilation.unflatten_plan(*tensors, block_size=4)
    assert torch.equal(again.slot_mapping, plan.slot_mapping)
    for ours, theirs in zip(again.decode_groups, plan.decode_groups, strict=True):
        for name in ("rows", "block_table", "bias"):
            assert torch.equal(getattr(ours, name), getattr(theirs, name)), name
    for ours, theirs in zip(again.prefill_requests, plan.prefill_requests, strict=True):
        assert (ours.start, ours.end, ours.seqlen_k) == (theirs.start, theirs.end, theirs.seqlen_k)
        assert torch.equal(ours.block_table, theirs.block_table)
        assert (ours.mask is None) == (theirs.mask is None)
        assert ours.mask is None or torch.equal(ours.mask, theirs.mask)
    assert sum(r.mask is not None for r in plan.prefill_requests) == 1


def test_the_torch_attention_op_passes_opcheck():
    """torch.library.opcheck on nanoserve::paged_attention over the mixed step: its schema (the KV cache
    mutated, nothing else), its fake implementation and its tracing. Catches a mutation not declared,
    which the compiled step would reorder or drop, or a fake output of another shape or layout."""
    batch, num_blocks = mixed_step()
    torch.manual_seed(0)
    num_tokens = batch.input_ids.shape[0]
    q, k, v = torch.randn(num_tokens, 4, 8), torch.randn(num_tokens, 2, 8), torch.randn(num_tokens, 2, 8)
    kv_cache = torch.randn(2, 3, num_blocks, 4, 2, 8)  # [2, layers, blocks, block_size, Hkv, D]
    plan = compilation.flatten_plan(plan_attention(batch, 4, torch.float32), torch.float32)
    for softcap, window in ((0.0, None), (1.5, 3)):  # a plain layer, and one capped (Gemma 2) with a sliding window
        torch.library.opcheck(torch.ops.nanoserve.paged_attention.default,
                              (q, k, v, kv_cache, 1, list(plan), 0.3, softcap, window))
