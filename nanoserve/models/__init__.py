"""Model implementations: Llama (llama.py), and the families built from its layers. `load_model`
(loader.py) builds the one its checkpoint's config.json names, by `architectures`, from `loader.MODELS`.

Adding a model family: if it is Llama's layers, its row in `MODELS` is LlamaForCausalLM (Mistral), or
with a flag for what differs (Qwen2: `functools.partial(LlamaForCausalLM, qkv_bias=True)`). Otherwise
write models/<family>.py as llama.py is written: a class taking `(config, attention_backend, shard)`
whose `forward(batch, kv_cache)` returns the float32 logits of `batch.logits_indices`, with
`num_layers`, `num_kv_heads`, `head_dim`, `vocab_size` (the KV cache's sizes) and a `checkpoint_modules`
table; read only config values every family has (head_dim: `get_head_dim`). The loader refuses a
checkpoint tensor the model leaves unread. Then the tests: its config class in tests/conftest.py's
FAMILIES (test_llama.py compares logits with transformers' in every linear layout) and a tiny model of
it in MODELS there, added to test_engine.py's greedy token-exact test.
"""
from __future__ import annotations

from transformers import PretrainedConfig


def get_head_dim(config: PretrainedConfig) -> int:
    """Each attention head's size: `head_dim` where the config gives one (it may differ from hidden /
    heads), else hidden_size / num_attention_heads (configs such as Qwen2's have no head_dim)."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
