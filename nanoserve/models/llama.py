"""Llama, assembled from layers/ and attention.py. The families that share its layers run on it too.
Each is described by a `Family` (families.py): Qwen2's bias on q, k and v, Qwen3's q/k norm, head_dim,
Gemma's norm class, activation and scaled embeddings, Gemma 2's and 3's sandwich norms, ...

The model sees one step's `Batch`: every scheduled request's new tokens laid end to end. So there is no
batch dimension anywhere, only N tokens. Each layer projects them to q, k, v. It rotates q and k by their
own `positions` (RoPE), and hands them to the attention backend. The backend writes k, v into the paged
KV cache at `slot_mapping`, and attends over each request's cached context. The model never knows which
request a token belongs to, nor which attention backend runs. The backend's per-step metadata, prepared
once from the `Batch`, carries all of that.

Invariants:
- `model(batch, kv_cache)` returns float32 logits `[S, vocab]` for the rows `batch.logits_indices` only.
  The final norm and lm_head skip every prompt token that does not sample now. (lm_head is the largest
  matmul for a small model.)
- Layer i reads and writes only `kv_cache[0, i]` (keys) and `kv_cache[1, i]` (values). Yet it hands the
  backend the whole cache and its index i, not those two views. The compiled step (compilation.py) calls
  attention as one op. An op that writes into views of a compiled graph's input loses its writes.
- q, k, v are one fused matmul (`qkv_proj`), and gate and up another (`gate_up_proj`). The loader
  (loader.py) stacks the checkpoint's separate tensors on the output dim, as `CHECKPOINT_MODULES` says.
  It stacks weights, and biases where there are any. So the math is unchanged.
- With tensor parallelism (distributed.py) a model holds one rank's shard. That is 1/size of the heads,
  of the MLP units and of the vocabulary. `all_reduce` after o_proj and down_proj sums the ranks' parts.
"""

from torch import Tensor, nn
from transformers import PretrainedConfig

from nanoserve.attention import BACKENDS, AttentionBackend, AttentionMetadata
from nanoserve.batch import Batch
from nanoserve.distributed import Shard, all_reduce, embed, gather_on_rank0
from nanoserve.layers.layernorm import norm_heads
from nanoserve.layers.rotary_embedding import RotaryEmbedding, apply_rope
from nanoserve.layers.softcap import softcap
from nanoserve.models.families import ACTIVATIONS, Family

# How the checkpoint's modules become ours, one row per checkpoint module (Hugging Face's name):
# (our module, the dim tensor parallelism splits its weight on). Several checkpoint modules naming
# one of ours are stacked on the output dim (dim 0) in this order: qkv_proj is [q; k; v].
# Split dim 0 of the `[out_features, in_features]` weight (column-parallel, distributed.py): a rank
# holds its heads, hidden units or vocabulary range. Split dim 1 (row-parallel): each rank's product
# is a partial sum, added up by all_reduce. A bias `[out_features]` (Qwen2's q, k, v: column-parallel
# only, the loader refuses others) is stacked and split on dim 0 with its weight.
# Modules not listed (the norms) keep their name and are whole on every rank.
CHECKPOINT_MODULES = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 0), "v_proj": ("qkv_proj", 0),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 0),
    "o_proj": ("o_proj", 1), "down_proj": ("down_proj", 1),
    "embed_tokens": ("embed_tokens", 0), "lm_head": ("lm_head", 0),
}


class LlamaAttention(nn.Module):
    """Fused qkv projection, q/k norm, RoPE, paged attention (attention.py), output projection.
    The projection has a bias where `family.qkv_bias`. The q/k norm is there where `family.qk_norm`.

    Split over `shard.size` ranks (distributed.py), each rank has its 1/size of the heads.
    The q/k norms' weights are per head dim, so every rank holds them whole."""

    def __init__(self, config: PretrainedConfig, family: Family, attention: AttentionBackend, shard: Shard):
        super().__init__()
        self.shard, self.family = shard, family
        self.num_heads = config.num_attention_heads // shard.size
        self.num_kv_heads = config.num_key_value_heads // shard.size
        head_dim, eps = family.head_dim, config.rms_norm_eps
        qkv_size = (self.num_heads + 2 * self.num_kv_heads) * head_dim  # [q; k; v] of this rank's heads
        self.qkv_proj = nn.Linear(config.hidden_size, qkv_size, bias=family.qkv_bias)
        if family.qk_norm:  # the checkpoint's q_norm and k_norm: a `[head_dim]` weight each, shared by all heads
            self.q_norm, self.k_norm = family.norm(head_dim, eps), family.norm(head_dim, eps)
        self.o_proj = nn.Linear(self.num_heads * head_dim, config.hidden_size, bias=False)  # this rank's heads in
        self.attention = attention  # the model's one backend, shared by every layer

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: Tensor, layer: int,
                metadata: AttentionMetadata) -> Tensor:
        H, Hkv = self.num_heads, self.num_kv_heads
        # [N, H + 2 * Hkv, D] -> [N, H + Hkv, D], [N, Hkv, D]
        qk, v = self.qkv_proj(x).view(-1, H + 2 * Hkv, self.family.head_dim).split([H + Hkv, Hkv], dim=1)
        if self.family.qk_norm:  # Qwen3: RMSNorm over each head, q's heads by q_norm, k's by k_norm
            qk = norm_heads(qk, H, self.q_norm, self.k_norm)
        # q and k heads side by side get the same rotation: one pass over both, not two
        q, k = apply_rope(qk, cos, sin).split([H, Hkv], dim=1)  # [N, H, D], [N, Hkv, D]
        # the layer's sliding window, or None (a full-attention layer of Gemma 2 and 3, or of Qwen's layer_types)
        out = self.attention.forward(q, k, v, kv_cache, layer, metadata, self.family.layer_window(layer))  # [N, H, D]
        # [N, H * D] -> [N, hidden]: the sum over every rank's heads
        return all_reduce(self.o_proj(out.flatten(1)), self.shard)


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up as one matmul. Gemma's GeGLU has gelu for silu
    (`family.hidden_act`)."""

    def __init__(self, config: PretrainedConfig, family: Family, shard: Shard):
        super().__init__()
        self.shard = shard
        self.act = ACTIVATIONS[family.hidden_act]
        intermediate = config.intermediate_size // shard.size  # this rank's hidden units
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [N, intermediate] each
        return all_reduce(self.down_proj(self.act(gate) * up), self.shard)  # the sum over every rank's units


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, family: Family, attention: AttentionBackend, shard: Shard):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = family.norm(hidden, eps)
        self.self_attn = LlamaAttention(config, family, attention, shard)
        self.post_attention_layernorm = family.norm(hidden, eps)
        self.mlp = LlamaMLP(config, family, shard)
        self.sandwich_norms = family.sandwich_norms
        if family.sandwich_norms:  # Gemma 2 and 3: post_attention_layernorm then normalizes attention's output
            self.pre_feedforward_layernorm = family.norm(hidden, eps)
            self.post_feedforward_layernorm = family.norm(hidden, eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, kv_cache: Tensor, layer: int,
                metadata: AttentionMetadata) -> Tensor:
        attended = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, layer, metadata)
        if not self.sandwich_norms:
            x = x + attended
            return x + self.mlp(self.post_attention_layernorm(x))
        # Gemma 2 and 3: a norm on each sublayer's output too
        x = x + self.post_attention_layernorm(attended)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm: HF's `model.*` half of the checkpoint."""

    def __init__(self, config: PretrainedConfig, family: Family, attention_backend: str, shard: Shard):
        super().__init__()
        self.shard = shard
        self.embed_tokens = nn.Embedding(config.vocab_size // shard.size, config.hidden_size)  # a vocab range
        # Scores are q . k / sqrt(head_dim); Gemma 2 and 3 divide by sqrt(query_pre_attn_scalar) instead.
        # Gemma 2 caps them too (0: not capped).
        self.attention = BACKENDS[attention_backend](scale=(family.query_pre_attn_scalar or family.head_dim) ** -0.5,
                                                     softcap=family.attn_logit_softcapping or 0.0)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, family, self.attention, shard)
                                    for _ in range(config.num_hidden_layers))
        self.norm = family.norm(config.hidden_size, config.rms_norm_eps)
        # Gemma: the embeddings times sqrt(hidden_size), rounded to the model's dtype first, as HF does
        self.embedding_scale = config.hidden_size ** 0.5 if family.scale_embeddings else None
        # Each layer's RoPE. Gemma 3's rope_parameters map a layer type to its own (the sliding layers' base
        # is lower); every other family has one for all.
        self.layer_types = family.layer_types or ("full_attention",) * config.num_hidden_layers
        rope = config.rope_parameters
        self.rotary = nn.ModuleDict({kind: RotaryEmbedding(family.head_dim, rope.get(kind, rope))
                                     for kind in sorted(set(self.layer_types))})

    def forward(self, batch: Batch, kv_cache: Tensor) -> Tensor:
        """Final hidden states `[S, hidden]` of the rows `batch.logits_indices`."""
        # What attention needs from the batch is the same in every layer: prepared once per step
        # (for the torch backend, which requests attend together, their blocks and masks).
        metadata = self.attention.prepare(batch, block_size=kv_cache.shape[3], dtype=kv_cache.dtype)
        return self.run_layers(batch.input_ids, batch.positions, batch.logits_indices, kv_cache, metadata)

    def run_layers(self, input_ids: Tensor, positions: Tensor, logits_indices: Tensor, kv_cache: Tensor,
                   metadata: AttentionMetadata) -> Tensor:
        """The step's tensor work, embeddings to the final norm: what the compiled step compiles whole."""
        x = embed(input_ids, self.embed_tokens.weight, self.shard)  # [N, hidden]
        if self.embedding_scale:  # None for the families that do not scale
            x = x * x.new_tensor(self.embedding_scale)
        # (cos, sin), [N, 1, D] each, per layer type: shared by every layer of that type
        ropes = {kind: rotary(positions, x.dtype) for kind, rotary in self.rotary.items()}
        for i, layer in enumerate(self.layers):
            x = layer(x, *ropes[self.layer_types[i]], kv_cache, i, metadata)
        # Only sampling rows need the final norm (and lm_head after it): all rows' k and v are
        # already in the cache, which is all later steps need from the others.
        return self.norm(x[logits_indices])  # [S, hidden]


class LlamaForCausalLM(nn.Module):
    """The model: `model.*` and `lm_head`, as the checkpoint names them. `family` (families.py) says what
    this checkpoint's layers differ in from Llama's."""
    checkpoint_modules = CHECKPOINT_MODULES  # how the checkpoint's modules become ours (loader.py reads it)

    def __init__(self, config: PretrainedConfig, family: Family, attention_backend: str, shard: Shard):
        super().__init__()
        self.shard = shard
        self.head_dim = family.head_dim
        self.num_layers = config.num_hidden_layers
        self.vocab_size = config.vocab_size
        self.model = LlamaModel(config, family, attention_backend, shard)
        self.num_kv_heads = config.num_key_value_heads // shard.size  # in this rank's KV cache: its layers'
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size // shard.size, bias=False)  # a vocab range
        # Gemma 2 caps its logits (layers/softcap.py), None for the others; the decode graphs read it too
        self.final_logit_softcapping = family.final_logit_softcapping

    def forward(self, batch: Batch, kv_cache: Tensor) -> Tensor | None:
        """Logits `[S, vocab]` float32, or None on a tensor-parallel worker (rank 0 samples).
        kv_cache is `[2, num_layers, num_blocks, block_size, Hkv, D]`."""
        logits = gather_on_rank0(self.lm_head(self.model(batch, kv_cache)), self.shard)
        return None if logits is None else softcap(logits.float(), self.final_logit_softcapping)
