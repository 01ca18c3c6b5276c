"""Model implementations: Llama (llama.py), which runs every family nanoserve serves, Gemma's included.
`load_model` (loader.py) builds a model with
the `Family` (families.py) that the checkpoint's config.json describes. The Family says what its
architecture (a row in `families.MODELS`) and config.json change from Llama's layers.

docs/models.md, "Adding a family", says how to add a model family. In short:
- Add a row in `families.MODELS`. A new kind of difference also needs a `Family` field, used where
  llama.py builds that layer.
- Add its config class to tests/conftest.py's FAMILIES, and its tiny models to MODELS there.
- Add those to the parametrizations of the parity tests.
Only values every family's config has are read as such (head_dim: `get_head_dim`). The loader refuses
a checkpoint tensor the model leaves unread.
"""

from transformers import PretrainedConfig


def get_head_dim(config: PretrainedConfig) -> int:
    """Each attention head's size. This is the one place head_dim is derived.

    It is `head_dim` where the config gives one. That may differ from hidden / heads: Qwen3Config gives 128
    unless told otherwise, whatever hidden / heads is. Else it is hidden_size / num_attention_heads
    (configs such as Qwen2's have no head_dim)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
