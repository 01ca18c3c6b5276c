"""Sliding-window attention (nanoserve/sliding_window.py): a tiny random Mistral whose window (8 tokens) is far
shorter than its prompts and outputs, token-exact with transformers' greedy generate (eager attention, float32)
under every engine setup that changes which keys a step reads: blocks of one and of four tokens, chunked
prefill, prefix-cache hits, preemption. A window that is off by one key, or ignored, changes the tokens."""
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import build_tiny_model, greedy
from nanoserve import LLM, SamplingParams

WINDOW = 8
rng = random.Random(1)
PREFIX = [rng.randrange(3, 256) for _ in range(28)]
# several windows long; prompt 3 shares PREFIX with prompt 0, prompt 2 is shorter than the window
PROMPTS = [PREFIX + [rng.randrange(3, 256) for _ in range(9)],
           [rng.randrange(3, 256) for _ in range(45)],
           [rng.randrange(3, 256) for _ in range(5)],
           PREFIX + [rng.randrange(3, 256) for _ in range(3)]]
MAX_TOKENS = [30, 20, 26, 24]
SETUPS = {
    "block_size_1": dict(block_size=1),
    "block_size_4": dict(block_size=4),
    "chunked_prefill": dict(block_size=4, max_num_batched_tokens=6),  # chunks shorter than the window
}


@pytest.fixture(scope="module")
def mistral(tmp_path_factory) -> str:
    """A tiny Mistral with an 8-token window; 512 positions, so that requests run many windows long."""
    return build_tiny_model(str(tmp_path_factory.mktemp("mistral")), "mistral", head_dim=8, seed=1,
                            sliding_window=WINDOW, max_position_embeddings=512)


def hf_greedy_eager(path: str, prompts: list[list[int]], max_tokens: list[int], ignore_eos: bool = False,
                    **overrides) -> list[list[int]]:
    """transformers' greedy generate with its eager attention (the plainest mask), one prompt at a time."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                 **overrides).eval()
    if ignore_eos:
        model.generation_config.eos_token_id = None
    outputs = []
    with torch.no_grad():
        for prompt, n in zip(prompts, max_tokens):
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                                 pad_token_id=0)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


@pytest.fixture(scope="module")
def expected(mistral) -> list[list[int]]:
    return hf_greedy_eager(mistral, PROMPTS, MAX_TOKENS)


def test_the_window_changes_the_reference(mistral, expected):
    """Without its window the same weights answer otherwise: the tests below can tell a window ignored."""
    assert hf_greedy_eager(mistral, PROMPTS, MAX_TOKENS, sliding_window=None) != expected


@pytest.mark.parametrize("setup", SETUPS)
def test_greedy_matches_transformers_past_the_window(mistral, expected, setup):
    llm = LLM(mistral, **SETUPS[setup])
    outputs = llm.generate(PROMPTS, [greedy(n) for n in MAX_TOKENS], use_tqdm=False)
    assert [o.token_ids for o in outputs] == expected
    block_manager = llm.engine.scheduler.block_manager
    assert block_manager.num_free_blocks == llm.engine.model_runner.num_blocks - 1


def test_preemption_past_the_window(mistral, expected):
    """Blocks a window returned keep their requests from running out of blocks, so preemption is forced: every
    running request is preempted once it is several windows long, its table full of null blocks. It is then
    recomputed from its first token. Catches a null entry freed as a block, a stale table after preemption."""
    engine = LLM(mistral, block_size=4).engine
    ids = [engine.add_request(prompt, greedy(n)) for prompt, n in zip(PROMPTS, MAX_TOKENS)]
    outputs, steps = {}, 0
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step().outputs)
        steps += 1
        if steps == 12:
            assert any(0 in seq.block_table for seq in engine.scheduler.running)
            for seq in reversed(list(engine.scheduler.running)):
                engine.scheduler.preempt(seq)
        engine.scheduler.assert_invariants()
    assert engine.scheduler.num_preemptions == 4
    assert [outputs[i].token_ids for i in ids] == expected
    assert engine.scheduler.block_manager.num_free_blocks == engine.model_runner.num_blocks - 1


def test_prefix_cache_hits_past_the_window(mistral, expected):
    """Prompt 3 reuses prompt 0's cached PREFIX blocks, which hold keys both inside and before its window."""
    llm = LLM(mistral, block_size=4)
    llm.generate([PROMPTS[0]], [greedy(MAX_TOKENS[0])], use_tqdm=False)
    later = llm.generate([PROMPTS[3]], [greedy(MAX_TOKENS[3])], use_tqdm=False)[0]
    assert later.num_cached_tokens == 28
    assert later.token_ids == expected[3]


def test_blocks_the_window_passed_go_back_while_the_request_runs(tmp_path):
    """A 300-token request (10 prompt tokens, 290 generated) under a 16-token window, blocks of 4: at every
    step it holds at most 5 blocks, the most its window's keys [p - 15, p] can span, and every block comes
    back at the end. Still token-exact. Catches a block kept one step too long (6 held), a block returned
    one step too early (its keys are still read: the tokens change), a block returned twice or never."""
    path = build_tiny_model(str(tmp_path), "mistral", head_dim=8, seed=1, sliding_window=16,
                            max_position_embeddings=512)
    prompt = PROMPTS[1][:10]
    engine = LLM(path, block_size=4).engine
    scheduler = engine.scheduler
    usable = engine.model_runner.num_blocks - 1
    request = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=290, ignore_eos=True))
    held, outputs = [], {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step().outputs)
        held.append(usable - scheduler.block_manager.num_free_blocks)
        scheduler.assert_invariants()
    assert max(held) == 5 and held[-1] == 0 and len(held) == 290
    assert outputs[request].token_ids == hf_greedy_eager(path, [prompt], [290], ignore_eos=True)[0]


def test_a_model_with_a_global_layer_keeps_every_block(tmp_path):
    """A model whose config.json lists a layer of full attention among sliding ones (`layer_types`): that layer
    reads every key, so no block may go back early. Catches a window read from the sliding layers alone."""
    from transformers import Qwen2Config

    from nanoserve.sliding_window import blocks_window
    mixed = Qwen2Config(use_sliding_window=True, sliding_window=16, max_window_layers=1, num_hidden_layers=3)
    assert mixed.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    assert blocks_window(mixed) is None
    everywhere = Qwen2Config(use_sliding_window=True, sliding_window=16, max_window_layers=0, num_hidden_layers=3)
    assert blocks_window(everywhere) == 16


# Gemma 2 and 3 (and Qwen2, where told) mix windowed layers with full ones, each layer its own (Family.layer_window)
MIXED_WINDOWS = {
    "gemma2": dict(family="gemma2", head_dim=32, query_pre_attn_scalar=20, attn_logit_softcapping=1.5,
                   final_logit_softcapping=2.0, sliding_window=WINDOW, num_hidden_layers=2),  # sliding, then full
    "gemma3": dict(family="gemma3", head_dim=32, query_pre_attn_scalar=20, sliding_window=WINDOW, num_hidden_layers=3,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    # Qwen2 windows the layers from max_window_layers on: full, then sliding
    "qwen2": dict(family="qwen2", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                  num_hidden_layers=2),
}


@pytest.mark.parametrize("name", MIXED_WINDOWS)
def test_windows_per_layer_match_transformers(tmp_path, name):
    """Gemma 2, Gemma 3 and Qwen2 with an 8-token window on some layers only, prompts and outputs several windows long.
    Chunks of 6 tokens, a prefix-cache hit, and every running request preempted at step 12: token-exact
    with transformers. A global layer reads every key, so no block goes back early (no null entry).
    Catches the window applied to every layer (or to none), and a mixed model returning blocks."""
    path = build_tiny_model(str(tmp_path), max_position_embeddings=512, **MIXED_WINDOWS[name])
    expected = hf_greedy_eager(path, PROMPTS, MAX_TOKENS)
    engine = LLM(path, dtype="float32", block_size=4, max_num_batched_tokens=6).engine
    assert engine.scheduler.block_manager.sliding_window is None
    ids = [engine.add_request(prompt, greedy(n)) for prompt, n in zip(PROMPTS, MAX_TOKENS)]
    outputs, steps = {}, 0
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step().outputs)
        steps += 1
        assert not any(0 in seq.block_table for seq in engine.scheduler.running)
        if steps == 12:
            for seq in reversed(list(engine.scheduler.running)):
                engine.scheduler.preempt(seq)
        engine.scheduler.assert_invariants()
    assert engine.scheduler.num_preemptions > 0
    assert [outputs[i].token_ids for i in ids] == expected
    later = engine.add_request(PROMPTS[3], greedy(MAX_TOKENS[3]))  # its PREFIX's 7 blocks are cached
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step().outputs)
    assert outputs[later].num_cached_tokens == 28 and outputs[later].token_ids == expected[3]


def test_only_a_model_windowed_everywhere_returns_blocks():
    """An 8-token window frees blocks for Mistral (every layer has it), never for Gemma 2 or 3 (global layers).
    Catches a window read from config.json's sliding_window alone."""
    from transformers import Gemma2Config, Gemma3TextConfig, MistralConfig

    from nanoserve.sliding_window import blocks_window
    assert blocks_window(MistralConfig(sliding_window=8)) == 8
    assert blocks_window(Gemma2Config(sliding_window=8)) is None
    assert blocks_window(Gemma3TextConfig(sliding_window=8)) is None


def test_int8_gemma2_with_a_window_matches_transformers_on_dequantized_weights(tmp_path):
    """Gemma 2 with an 8-token window, its linears in int8: token-exact with transformers' eager attention on
    the weights dequantized by hand (test_quantization.py's rule). Catches the quantized model losing its
    per-layer window or its soft-capping."""
    from test_quantization import quantize_by_hand, save_dequantized
    path = build_tiny_model(str(tmp_path / "gemma2"), max_position_embeddings=512, **MIXED_WINDOWS["gemma2"])
    llm = LLM(path, quantization="int8", dtype="float32", block_size=4, max_num_batched_tokens=6)
    outputs = llm.generate(PROMPTS, [greedy(n) for n in MAX_TOKENS], use_tqdm=False)
    assert not any(isinstance(m, torch.nn.Linear) for m in llm.engine.model_runner.model.modules())
    # the tied embedding's row 0 (padding) is zero: its scale is 0, and the rule's 0 / 0 is the zero row again
    dequantized = save_dequantized(path, str(tmp_path / "dequantized"),
                                   quantize=lambda weight: quantize_by_hand(weight).nan_to_num(0.0))
    assert [o.token_ids for o in outputs] == hf_greedy_eager(dequantized, PROMPTS, MAX_TOKENS)


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_tensor_parallel_gemma_with_a_window_matches_transformers(tmp_path, name):
    """Gemma 2 and 3 with an 8-token window on some layers, over 2 ranks: token-exact with transformers.
    Each rank holds half the heads, so each must still apply its layer's window and soft-capping.
    Catches a rank's layers built without the Family's windows, or Gemma's GeGLU MLP not reduced."""
    path = build_tiny_model(str(tmp_path), max_position_embeddings=512, **MIXED_WINDOWS[name])
    with LLM(path, tensor_parallel_size=2, dtype="float32", block_size=4) as llm:
        outputs = llm.generate(PROMPTS, [greedy(n) for n in MAX_TOKENS], use_tqdm=False)
    assert [o.token_ids for o in outputs] == hf_greedy_eager(path, PROMPTS, MAX_TOKENS)
