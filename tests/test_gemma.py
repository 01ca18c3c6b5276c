"""Tests for Gemma's Family rows (models/families.py, run by llama.py): Gemma, Gemma 2 and Gemma 3 (text)
against transformers, on tiny random models built by conftest's builder. Its `randomize_extras` draws
Gemma's norm weights, which transformers starts at zero.

The tiny configs make each difference from Llama change the output. Soft-capping at 1.5 (scores) and 2.0
(logits) is far below the scores and logits these weights give. head_dim 32 is not hidden / heads (16), and
query_pre_attn_scalar 20 is not head_dim. Gemma 3's sliding layers get a RoPE base of 100, its full layer 10^6.

The sliding windows (512) are longer than any context here (256 at most), so they never bite here.
tests/test_sliding_window.py runs Gemma 2 and 3 with an 8-token window.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_llama import PROMPT, assert_same_logits, reference_logits, run_prefill

from conftest import build_tiny_model, greedy, hf_greedy, save_tiny_model
from nanoserve import LLM

GEMMA_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
              "full_attention": {"rope_type": "default", "rope_theta": 1e6}}
GEMMAS = {
    "gemma": dict(family="gemma", head_dim=32),
    "gemma2": dict(family="gemma2", head_dim=32, query_pre_attn_scalar=20, attn_logit_softcapping=1.5,
                   final_logit_softcapping=2.0, sliding_window=512, num_hidden_layers=2),  # sliding, then full
    "gemma3": dict(family="gemma3", head_dim=32, query_pre_attn_scalar=20, sliding_window=512, num_hidden_layers=3,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                   rope_parameters=GEMMA_ROPE),
}
# Gemma 3 with Gemma 2's soft-capping, which its config allows (None by default)
GEMMAS["gemma3_capped"] = dict(GEMMAS["gemma3"], attn_logit_softcapping=1.5, final_logit_softcapping=2.0)
PROMPTS = [[5, 17, 200, 45, 9, 120, 77], [3], [250, 64, 33, 90, 12, 7, 7, 8, 100, 31, 4, 66, 2 + 1]]
MAX_TOKENS = [12, 9, 16]


@pytest.fixture(scope="module")
def gemmas(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("gemmas")
    return {name: build_tiny_model(str(root / name), **kwargs) for name, kwargs in GEMMAS.items()}


@pytest.fixture(scope="module")
def references(gemmas) -> dict[str, list[list[int]]]:
    """transformers' greedy tokens of each model, with its eager attention (which soft-caps)."""
    return {name: hf_greedy(path, PROMPTS, MAX_TOKENS, attn_implementation="eager") for name, path in gemmas.items()}


def generate(path: str, **engine_args) -> list[list[int]]:
    llm = LLM(path, dtype="float32", block_size=4, **engine_args)
    outputs = llm.generate(PROMPTS, [greedy(n) for n in MAX_TOKENS])
    return [output.outputs[0].token_ids for output in outputs]


@pytest.mark.parametrize("name", GEMMAS)
def test_greedy_matches_transformers(gemmas, references, name: str) -> None:
    """Prompts batched together, then decodes, token for token as transformers' generate. Catches Llama's
    norm (weight, not 1 + weight), an unscaled embedding, silu for gelu, scores not capped or capped after
    the mask, head_dim's scale for query_pre_attn_scalar's, a missing post-attention or feedforward norm,
    Gemma 3's q/k norm as Llama's, and the full layers' RoPE base on the sliding ones."""
    assert generate(gemmas[name]) == references[name]


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_chunked_prefill_and_prefix_caching(gemmas, references, name: str) -> None:
    """Prompts cut into chunks of 5 tokens, and run twice: the second time their full blocks come from the
    prefix cache. Catches a chunk attending with the wrong causal offset or softcap under the chunk's mask."""
    llm = LLM(gemmas[name], dtype="float32", block_size=4, max_num_batched_tokens=5, max_num_seqs=2,
              enable_prefix_caching=True)
    for _ in range(2):
        outputs = llm.generate(PROMPTS, [greedy(n) for n in MAX_TOKENS])
        assert [output.outputs[0].token_ids for output in outputs] == references[name]
    assert [output.num_cached_tokens for output in outputs] == [4, 0, 12]  # full blocks of the prompts


@pytest.mark.parametrize("name", ["gemma", "gemma2", "gemma3_capped"])
def test_logits_match_transformers(tmp_path: Path, name: str) -> None:
    """A prefill's logits equal transformers' (eager attention), not only their argmax. Catches the final
    soft-capping dropped: tanh keeps the argmax, so greedy tokens cannot see it."""
    hf_model = save_tiny_model(tmp_path, attn_implementation="eager", **GEMMAS[name])
    assert_same_logits(run_prefill(tmp_path, PROMPT), reference_logits(hf_model, PROMPT))


@pytest.mark.parametrize("family, hidden_act", [("gemma", "silu"), ("gemma2", "relu"), ("llama", "gelu")])
def test_an_unsupported_hidden_act_is_refused(tmp_path: Path, family: str, hidden_act: str) -> None:
    name = "hidden_act" if family in ("gemma", "llama") else "hidden_activation"  # as each config calls it
    save_tiny_model(tmp_path, family=family, head_dim=16, **{name: hidden_act})
    with pytest.raises(ValueError, match=f"unsupported hidden_act '{hidden_act}'"):
        LLM(str(tmp_path), dtype="float32")


def test_softcapped_attention_equals_the_reference() -> None:
    """The torch backend's capped attention (layers/softcap.py) for a prompt and a decode group, against
    tests/flash_reference.py's plain per-request formulation, which caps as flash-attn does."""
    from flash_reference import attend as reference_attend
    from nanoserve.attention import attend
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 7, 4, 16) * 3, torch.randn(1, 7, 2, 16) * 3, torch.randn(1, 7, 2, 16)
    expected, _ = reference_attend(q[0], k[0], v[0], True, 0.25, softcap=1.5)
    torch.testing.assert_close(attend(q, k, v, 0.25, is_causal=True, softcap=1.5)[0], expected)
    bias = torch.zeros(1, 1, 1, 7).masked_fill(torch.arange(7) >= 5, float("-inf"))  # a decode row seeing 5 keys
    expected, _ = reference_attend(q[0, -1:], k[0, :5], v[0, :5], True, 0.25, softcap=1.5)
    torch.testing.assert_close(attend(q[:, -1:], k, v, 0.25, bias, softcap=1.5)[0], expected)
