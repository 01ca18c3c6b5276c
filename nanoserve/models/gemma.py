"""Gemma, Gemma 2 and Gemma 3: Llama's layers (llama.py) with Gemma's differences, each one a `Family` field
read from config.json (families.py).

What every Gemma changes:
- RMSNorm scales by (1 + weight), in float32 (layers/layernorm.py's `GemmaRMSNorm`), q/k norm included;
- the embeddings are multiplied by sqrt(hidden_size), rounded to the model's dtype first;
- the MLP is GeGLU: gelu with the tanh approximation where Llama has silu;
- the lm_head is tied to the embeddings.
Gemma 2 and 3 add a norm after attention and one around the MLP (`sandwich_norms`). Their attention scale is
`query_pre_attn_scalar ** -0.5`. Gemma 2 soft-caps its scores (in the attention backend) and its logits: x
becomes tanh(x / cap) * cap (layers/softcap.py). Gemma 2's and 3's `layer_types` mix sliding-window layers
with full ones. Gemma 3 has q/k norm, and its own rope_parameters per layer type (the sliding layers' base is
lower).

Each layer's attention gets its own window, as every family's does (`Family.layer_window`, in llama.py).
A full-attention layer's is None.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PretrainedConfig

from nanoserve.attention import BACKENDS, AttentionBackend, AttentionMetadata
from nanoserve.batch import Batch
from nanoserve.distributed import Shard, all_reduce, embed
from nanoserve.layers.layernorm import GemmaRMSNorm
from nanoserve.layers.rotary_embedding import RotaryEmbedding
from nanoserve.layers.softcap import softcap
from nanoserve.models.families import Family
from nanoserve.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel


class GemmaAttention(LlamaAttention):
    """Llama's attention, with Gemma's q/k norm (Gemma 3)."""

    def __init__(self, config: PretrainedConfig, family: Family, attention: AttentionBackend, shard: Shard):
        super().__init__(config, family, attention, shard)
        if family.qk_norm:
            self.q_norm = GemmaRMSNorm(family.head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(family.head_dim, config.rms_norm_eps)


class GemmaMLP(LlamaMLP):
    """GeGLU: down(gelu_tanh(gate(x)) * up(x))."""

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [N, intermediate] each
        return all_reduce(self.down_proj(F.gelu(gate, approximate="tanh") * up), self.shard)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, family: Family, attention: AttentionBackend, shard: Shard):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = GemmaAttention(config, family, attention, shard)
        # Gemma: the norm before the MLP, as Llama's. Gemma 2 and 3: the norm of attention's output.
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = GemmaMLP(config, shard)
        self.sandwich_norms = family.sandwich_norms
        if family.sandwich_norms:
            self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
            self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: Tensor, layer: int,
                metadata: AttentionMetadata) -> Tensor:
        attended = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, layer, metadata)
        if not self.sandwich_norms:  # Gemma: Llama's layer
            x = x + attended
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(attended)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaModel(LlamaModel):
    """Embedding (scaled), decoder layers, final norm: HF's `model.*` half of the checkpoint. Its `forward` is
    Llama's: attention's metadata once per step, then `run_layers`."""

    def __init__(self, config: PretrainedConfig, family: Family, attention_backend: str, shard: Shard):
        nn.Module.__init__(self)  # its own modules, none of Llama's
        self.shard = shard
        self.normalizer = config.hidden_size ** 0.5
        self.embed_tokens = nn.Embedding(config.vocab_size // shard.size, config.hidden_size)  # a vocab range
        scale = (family.query_pre_attn_scalar or family.head_dim) ** -0.5
        self.attention = BACKENDS[attention_backend](scale=scale, softcap=family.attn_logit_softcapping or 0.0)
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, family, self.attention, shard)
                                    for _ in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        # each layer's RoPE: Gemma 3's rope_parameters map a layer type to its own, the others' are one for all
        self.layer_types = family.layer_types or ("full_attention",) * config.num_hidden_layers
        rope = family.rope_parameters
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
    """Llama's `model.*` and `lm_head`, with Gemma's model and its final soft-capping of the logits."""
    model_class = GemmaModel

    def __init__(self, config: PretrainedConfig, family: Family, attention_backend: str, shard: Shard):
        super().__init__(config, family, attention_backend, shard)
        self.final_logit_softcapping = family.final_logit_softcapping

    def forward(self, batch: Batch, kv_cache: Tensor) -> Tensor | None:
        """Llama's logits, capped (Gemma 2); the decode graphs (extensions/cuda_graphs.py) cap theirs too."""
        logits = super().forward(batch, kv_cache)  # [S, vocab] float32
        cap = self.final_logit_softcapping
        return logits if logits is None or cap is None else softcap(logits, cap)
