"""What each model family differs in from Llama, as data: one frozen `Family` per checkpoint, read from its
config.json once (`describe`) and passed to the model as one object. `MODELS` names the architectures
nanoserve runs (config.json's `architectures`) and what each one always differs in; `describe` adds what
the checkpoint's config.json says (head_dim, tied head, RoPE, sliding window).

A family that differs from Llama only in these fields is one row in `MODELS`; a new kind of difference is
a new field here, read where llama.py builds the layer it changes (docs/models.md, "Adding a family").
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from transformers import PretrainedConfig

from nanoserve.models import get_head_dim


@dataclass(frozen=True)
class Family:
    """A MODELS row sets the first three fields, which are the same for every checkpoint of the
    architecture; `describe` fills in the rest from one checkpoint's config.json."""
    architecture: str  # config.json's `architectures` entry, e.g. "Qwen3ForCausalLM"
    qkv_bias: bool = False  # q, k and v projections have a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and of k, before RoPE (Qwen3)
    head_dim: int = 0  # each attention head's size (`get_head_dim`)
    tie_word_embeddings: bool = False  # lm_head is the embedding matrix (not stored in the checkpoint)
    # rope_type ("default" or "llama3"), rope_theta and llama3's scaling (layers/rotary_embedding.py)
    rope_parameters: dict = field(default_factory=dict, hash=False)
    sliding_window: int | None = None  # attention sees only the last this-many tokens; None: the whole context


# The architectures nanoserve runs, as in vLLM's registry: all are Llama's layers, with these differences.
MODELS: dict[str, Family] = {
    "LlamaForCausalLM": Family("LlamaForCausalLM"),
    "MistralForCausalLM": Family("MistralForCausalLM"),  # a sliding window, if any, is `describe`'s
    "Qwen2ForCausalLM": Family("Qwen2ForCausalLM", qkv_bias=True),
    "Qwen3ForCausalLM": Family("Qwen3ForCausalLM", qk_norm=True),
}


def describe(config: PretrainedConfig) -> Family:
    """The Family of a checkpoint: its architecture's row in MODELS, completed from its config.json.
    A ValueError names the supported architectures if its own is not one of them."""
    architectures = config.architectures or []  # PretrainedConfig always has it (None by default)
    known = [name for name in architectures if name in MODELS]
    if not known:
        raise ValueError(f"unsupported architectures {architectures} (model_type {config.model_type!r}): "
                         f"nanoserve runs {', '.join(MODELS)}")
    # Qwen2's and Qwen3's configs set sliding_window to None where use_sliding_window is false
    return dataclasses.replace(MODELS[known[0]], head_dim=get_head_dim(config),
                               tie_word_embeddings=config.tie_word_embeddings,
                               rope_parameters=dict(config.rope_parameters),
                               sliding_window=getattr(config, "sliding_window", None))


def check_max_model_len(config: PretrainedConfig, max_model_len: int) -> None:
    """Refuse a context longer than the checkpoint's positions. A sliding window shorter than the context is
    fine: attention sees only the window's keys (sliding_window.py)."""
    if max_model_len > config.max_position_embeddings:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                         f"max_position_embeddings={config.max_position_embeddings}")
