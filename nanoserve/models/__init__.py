"""Model implementations: Llama (llama.py), which runs every family nanoserve serves but Gemma's. Gemma,
Gemma 2 and Gemma 3 (gemma.py) reuse Llama's layers. `load_model`
(loader.py) builds it with the `Family` (families.py) that the checkpoint's config.json describes: what
its architecture (a row in `families.MODELS`) and config.json change from Llama's layers.

Adding a model family: docs/models.md, "Adding a family". In short: a row in `families.MODELS` (and,
for a new kind of difference, a `Family` field and its use where llama.py builds that layer); its
config class in tests/conftest.py's FAMILIES and its tiny models in MODELS there, added to the
parametrizations of the parity tests. Only values every family's config has are read as such (head_dim:
`get_head_dim`); the loader refuses a checkpoint tensor the model leaves unread.
"""
from __future__ import annotations

from transformers import PretrainedConfig


def get_head_dim(config: PretrainedConfig) -> int:
    """Each attention head's size: `head_dim` where the config gives one (it may differ from hidden /
    heads: Qwen3Config gives 128 unless told otherwise, whatever hidden / heads is), else hidden_size /
    num_attention_heads (configs such as Qwen2's have no head_dim). The one place head_dim is derived."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
