"""Sliding-window attention (nanoserve/sliding_window.py): a tiny random Mistral whose window (8 tokens) is far
shorter than its prompts and outputs, token-exact with transformers' greedy generate (eager attention, float32)
under every engine setup that changes which keys a step reads: blocks of one and of four tokens, chunked
prefill, prefix-cache hits, preemption. A window that is off by one key, or ignored, changes the tokens."""
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import build_tiny_model, greedy
from nanoserve import LLM

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
    "preemption": dict(block_size=4, num_kvcache_blocks=21, max_model_len=80),
}


@pytest.fixture(scope="module")
def mistral(tmp_path_factory) -> str:
    """A tiny Mistral with an 8-token window; 512 positions, so that requests run many windows long."""
    return build_tiny_model(str(tmp_path_factory.mktemp("mistral")), "mistral", head_dim=8, seed=1,
                            sliding_window=WINDOW, max_position_embeddings=512)


def hf_greedy_eager(path: str, prompts: list[list[int]], max_tokens: list[int], **overrides) -> list[list[int]]:
    """transformers' greedy generate with its eager attention (the plainest mask), one prompt at a time."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                 **overrides).eval()
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
    if setup == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    block_manager = llm.engine.scheduler.block_manager
    assert block_manager.num_free_blocks == llm.engine.model_runner.num_blocks - 1


def test_prefix_cache_hits_past_the_window(mistral, expected):
    """Prompt 3 reuses prompt 0's cached PREFIX blocks, which hold keys both inside and before its window."""
    llm = LLM(mistral, block_size=4)
    llm.generate([PROMPTS[0]], [greedy(MAX_TOKENS[0])], use_tqdm=False)
    later = llm.generate([PROMPTS[3]], [greedy(MAX_TOKENS[3])], use_tqdm=False)[0]
    assert later.num_cached_tokens == 28
    assert later.token_ids == expected[3]
