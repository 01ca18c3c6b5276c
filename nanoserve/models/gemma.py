"""Gemma, Gemma 2 and Gemma 3: Llama's layers (llama.py) with Gemma's differences, each one a `Family` field
read from config.json (families.py).

What every Gemma changes:
- RMSNorm scales by (1 + weight), in float32 (layers/layernorm.py's `GemmaRMSNorm`), q/k norm included.
  llama.py builds every norm as `family.norm`.
- the MLP is GeGLU: gelu with the tanh approximation where Llama has silu (`family.hidden_act`, in llama.py);
- the embeddings are multiplied by sqrt(hidden_size), rounded to the model's dtype first (`GemmaModel`);
- the lm_head is tied to the embeddings.
Gemma 2 and 3 add a norm after attention and one around the MLP (`sandwich_norms`, in llama.py). Their
attention scale is `query_pre_attn_scalar ** -0.5`. Gemma 2 soft-caps its scores (in the attention backend) and
its logits: x becomes tanh(x / cap) * cap (layers/softcap.py). Gemma 2's and 3's `layer_types` mix
sliding-window layers with full ones. Gemma 3 has q/k norm, and its own rope_parameters per layer type (the
sliding layers' base is lower).

Each layer's attention gets its own window, as every family's does (`Family.layer_window`, in llama.py).
A full-attention layer's is None.
"""

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig

from nanoserve.attention import AttentionMetadata
from nanoserve.distributed import Shard, embed
from nanoserve.layers.rotary_embedding import RotaryEmbedding
from nanoserve.models.families import Family
from nanoserve.models.llama import LlamaForCausalLM, LlamaModel


class GemmaModel(LlamaModel):
    """Llama's model, with embeddings scaled by sqrt(hidden) and a RoPE per layer type. Its
    `forward` is Llama's: attention's metadata once per step, then `run_layers`."""

    def __init__(self, config: PretrainedConfig, family: Family, attention_backend: str, shard: Shard):
        super().__init__(config, family, attention_backend, shard)
        self.normalizer = config.hidden_size ** 0.5
        # each layer's RoPE: Gemma 3's rope_parameters map a layer type to its own, the others' are one for all
        self.layer_types = family.layer_types or ("full_attention",) * config.num_hidden_layers
        rope = config.rope_parameters
        self.rotary = nn.ModuleDict({kind: RotaryEmbedding(family.head_dim, rope.get(kind, rope))
                                     for kind in sorted(set(self.layer_types))})

    def run_layers(self, input_ids: Tensor, positions: Tensor, logits_indices: Tensor, kv_cache: Tensor,
                   metadata: AttentionMetadata) -> Tensor:
        """The step's tensor work, embeddings to the final norm: what the compiled step compiles whole."""
        x = embed(input_ids, self.embed_tokens.weight, self.shard)  # [N, hidden]
        x = x * torch.tensor(self.normalizer, dtype=x.dtype)  # sqrt(hidden) rounded to the dtype, as HF does
        ropes = {kind: rotary(positions, x.dtype) for kind, rotary in self.rotary.items()}  # (cos, sin) each
        for i, layer in enumerate(self.layers):
            x = layer(x, *ropes[self.layer_types[i]], kv_cache, i, metadata)
        return self.norm(x[logits_indices])  # [S, hidden]


class GemmaForCausalLM(LlamaForCausalLM):
    """Llama's `model.*` and `lm_head`, with Gemma's model. Llama's `forward` caps the logits (Gemma 2)."""
    model_class = GemmaModel
