"""Llama: the one model family nanoserve runs, and how a Hugging Face checkpoint becomes it.

The model sees one step's `Batch`: every scheduled request's new tokens laid end to end, so there
is no batch dimension anywhere, only N tokens. Each layer projects them to q, k, v, rotates q and k
by their own `positions` (RoPE), and hands them to the attention backend, which writes k, v into the
paged KV cache at `slot_mapping` and attends over each request's cached context. The model never
knows which request a token belongs to, nor which attention backend runs: the backend's per-step
metadata, prepared once from the `Batch`, carries all of that.

Invariants:
- `model(batch, kv_cache)` returns float32 logits `[S, vocab]` for the rows `batch.logits_indices`
  only: the final norm and lm_head (the largest matmul for a small model) skip every prompt token
  that does not sample now.
- Layer i reads and writes only `kv_cache[0, i]` (keys) and `kv_cache[1, i]` (values).
- q, k, v are one fused matmul (`qkv_proj`), gate and up another (`gate_up_proj`); the loader stacks
  the checkpoint's separate tensors on the output dim in that order, so the math is unchanged.
- With tensor parallelism (parallel.py) a model holds one rank's shard: 1/size of the heads, of the
  MLP units and of the vocabulary; `all_reduce` after o_proj and down_proj sums the ranks' parts.
- Every parameter comes from the checkpoint: the model is built on the meta device (no memory, no
  random init) and `load_model` assigns real tensors, or raises a `ValueError` naming what is wrong.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from nanoserve.attention import BACKENDS, AttentionBackend, AttentionMetadata
from nanoserve.batch import Batch
from nanoserve.distributed import Shard, all_reduce, embed, gather_on_rank0

# Our fused parameter -> the checkpoint tensors stacked (dim 0, in this order) into it.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


# ---------------------------------------------------------------------------------------------
# RoPE


def compute_inv_freq(config: PretrainedConfig, head_dim: int) -> torch.Tensor:
    """One rotation frequency per pair of dims, `[head_dim // 2]`, for rope_type default or llama3."""
    params = config.rope_parameters
    rope_type = params.get("rope_type", "default")
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"unsupported rope_type {rope_type!r}: nanoserve implements 'default' and 'llama3'")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1.0 is not supported")
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim
    inv_freq = 1.0 / (params["rope_theta"] ** exponents)  # [head_dim // 2]
    if rope_type == "default":
        return inv_freq
    return scale_llama3(inv_freq, params)


def scale_llama3(inv_freq: torch.Tensor, params: dict) -> torch.Tensor:
    """Llama 3.1's long-context RoPE: slow down low frequencies by `factor`, keep high ones.

    Wavelengths shorter than `original_max_position_embeddings / high_freq_factor` (local detail)
    are kept; those longer than `original / low_freq_factor` (position over the whole context) are
    stretched by `factor`, so the longer context maps onto angles seen in training; in between
    the two are blended linearly in `original / wavelength`.
    """
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    original = params["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # smooth is 1 at the high-frequency edge (keep) and 0 at the low-frequency edge (scale)
    smooth = ((original / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


class RotaryEmbedding(nn.Module):
    """cos/sin of each token's rotation angles, from its position, every step: N x D/2 products,
    cheaper than a table for all max_position_embeddings positions (131k for Llama 3.1)."""

    def __init__(self, config: PretrainedConfig, head_dim: int):
        super().__init__()
        # Built on CPU explicitly (the model is built on the meta device, see load_model) and kept
        # float32: angles at large positions need the precision.
        self.register_buffer("inv_freq", compute_inv_freq(config, head_dim), persistent=False)  # [D/2]

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq  # [N, D/2]
        # HF's "rotate_half" layout: dim j pairs with dim j + D/2, so both halves share a frequency.
        freqs = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [N, 1, D]: broadcast over heads
        # cast like HF does, so q * cos runs in the model's dtype
        return freqs.cos().to(dtype), freqs.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (j, j + D/2) pair of `x` `[N, heads, D]` by its token's angle (cos, sin `[N, 1, D]`)."""
    x1, x2 = x.chunk(2, dim=-1)  # [N, heads, D/2] each
    rotated = torch.cat((-x2, x1), dim=-1)  # [N, heads, D]
    return x * cos + rotated * sin


# ---------------------------------------------------------------------------------------------
# The model


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # float32 for the mean of squares (bf16 would lose it); cast back before the weight, as HF does
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class LlamaAttention(nn.Module):
    """Fused qkv projection, RoPE, paged attention (attention.py), output projection.
    Split over `shard.size` ranks (parallel.py), each has its 1/size of the heads."""

    def __init__(self, config: PretrainedConfig, head_dim: int, attention: AttentionBackend, shard: Shard):
        super().__init__()
        self.shard = shard
        self.num_heads = config.num_attention_heads // shard.size
        self.num_kv_heads = config.num_key_value_heads // shard.size
        assert self.num_heads % self.num_kv_heads == 0, "query heads must split evenly over kv heads"
        self.head_dim = head_dim
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)  # this rank's heads in
        self.attention = attention  # the model's one backend, shared by every layer

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(x)  # [N, q_size + 2 * kv_size]
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # q and k heads side by side get the same rotation: one pass over both, not two
        qk = apply_rope(qk.view(-1, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin)  # [N, H + Hkv, D]
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # [N, H, D], [N, Hkv, D]
        v = v.view(-1, self.num_kv_heads, self.head_dim)  # [N, Hkv, D]
        out = self.attention.forward(q, k, v, k_cache, v_cache, metadata)  # [N, H, D]
        out = self.o_proj(out.reshape(-1, self.q_size))  # [N, H * D] -> [N, hidden]
        return all_reduce(out, self.shard)  # the sum over every rank's heads


class LlamaMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up as one matmul."""

    def __init__(self, config: PretrainedConfig, shard: Shard):
        super().__init__()
        self.shard = shard
        intermediate = config.intermediate_size // shard.size  # this rank's hidden units
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [N, intermediate] each
        return all_reduce(self.down_proj(F.silu(gate) * up), self.shard)  # the sum over every rank's units


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, head_dim: int, attention: AttentionBackend, shard: Shard):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, head_dim, attention, shard)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, shard)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, k_cache, v_cache, metadata)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm: HF's `model.*` half of the checkpoint."""

    def __init__(self, config: PretrainedConfig, head_dim: int, attention_backend: str, shard: Shard):
        super().__init__()
        self.shard = shard
        self.embed_tokens = nn.Embedding(config.vocab_size // shard.size, config.hidden_size)  # a vocab range
        self.attention = BACKENDS[attention_backend](scale=head_dim ** -0.5)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, head_dim, self.attention, shard) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config, head_dim)

    def forward(self, batch: Batch, kv_cache: torch.Tensor) -> torch.Tensor:
        """Final hidden states `[S, hidden]` of the rows `batch.logits_indices`."""
        x = embed(batch.input_ids, self.embed_tokens.weight, self.shard)  # [N, hidden]
        cos, sin = self.rotary(batch.positions, x.dtype)  # [N, 1, D] each, shared by every layer
        # What attention needs from the batch is the same in every layer too: prepared once per step
        # (for the torch backend, which requests attend together, their blocks and masks).
        metadata = self.attention.prepare(batch, block_size=kv_cache.shape[3], dtype=x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, kv_cache[0, i], kv_cache[1, i], metadata)
        # Only sampling rows need the final norm (and lm_head after it): all rows' k and v are
        # already in the cache, which is all later steps need from the others.
        return self.norm(x[batch.logits_indices])  # [S, hidden]


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: PretrainedConfig, attention_backend: str, shard: Shard = Shard()):
        super().__init__()
        self.config = config
        self.shard = shard
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = config.num_key_value_heads // shard.size  # in this rank's KV cache
        self.vocab_size = config.vocab_size
        self.model = LlamaModel(config, self.head_dim, attention_backend, shard)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size // shard.size, bias=False)  # a vocab range

    def forward(self, batch: Batch, kv_cache: torch.Tensor) -> torch.Tensor | None:
        """Logits `[S, vocab]` float32 (None on a tensor-parallel worker: rank 0 samples);
        kv_cache is `[2, num_layers, num_blocks, block_size, Hkv, D]`."""
        logits = gather_on_rank0(self.lm_head(self.model(batch, kv_cache)), self.shard)
        return None if logits is None else logits.float()


# ---------------------------------------------------------------------------------------------
# Loading a Hugging Face checkpoint


def load_model(path: str, dtype: torch.dtype, device: torch.device, attention_backend: str,
               shard: Shard = Shard()) -> LlamaForCausalLM:
    """Build a Llama from a Hugging Face folder (config.json + *.safetensors) on `device` in `dtype`;
    with tensor parallelism, only `shard`'s part of it: every tensor is sliced as it is read."""
    config = read_config(path)
    with torch.device("meta"):  # shapes only: every parameter is replaced by a checkpoint tensor
        model = LlamaForCausalLM(config, attention_backend, shard)
    files = index_checkpoint(Path(path))
    check_shapes(files, expected_shapes(config, model.head_dim))
    for name, param in list(model.named_parameters()):
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        # A fused parameter stacks its checkpoint tensors on the output dim, e.g. q, k, v
        tensor = torch.cat([read_tensor(files, part, shard) for part in checkpoint_names(name)], dim=0)
        module_name, _, leaf = name.rpartition(".")
        tensor = tensor.to(device=device, dtype=dtype)
        if name.endswith("proj.weight") or name == "lm_head.weight":
            tensor = layout_for_matmul(tensor)
        weight = nn.Parameter(tensor, requires_grad=False)
        setattr(model.get_submodule(module_name), leaf, weight)
    if config.tie_word_embeddings:  # tied: lm_head.weight is the embedding matrix, not a copy
        model.lm_head.weight = model.model.embed_tokens.weight
    return pack_linears(model.to(device).eval())  # .to moves the RoPE cache; parameters are already there


def layout_for_matmul(weight: torch.Tensor) -> torch.Tensor:
    """A linear layer's weight `[out, in]`, stored the way its matmul reads it fastest. On CPU in
    float32 that is column-major: the same `[out, in]` tensor laid out as `[in, out]`, so
    `x @ weight.T` is MKL's plain (not transposed) GEMM, measured 1.3-2x faster for the 8-64 rows of
    a decode step and no slower for a prefill. bfloat16 (oneDNN) and CUDA gain nothing: row-major."""
    if weight.device.type == "cpu" and weight.dtype == torch.float32:
        return weight.t().contiguous().t()  # [out, in], strides (1, out)
    return weight


class PackedLinear(nn.Module):
    """nn.Linear without bias, its weight laid out once in oneDNN's own blocked format: the same
    products bit for bit, but in bfloat16 on CPU measured 1.4-2x faster for the 1-8 rows of a decode
    step, and no slower for a prefill. The packed weight is opaque (only this reads it) and a copy:
    a tied lm_head keeps the embedding matrix and gets its own packed one."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())  # [out, in]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, None, "none", [], "")


def has_onednn_bf16() -> bool:
    """oneDNN's bfloat16 kernels need AVX512 (or AVX-NE-CONVERT) on x86: elsewhere, nn.Linear."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack_linears(model: nn.Module) -> nn.Module:
    """The speed path for bfloat16 on CPU: every nn.Linear (the reference formulation, kept for every
    other dtype and device) becomes a PackedLinear. SmolLM2-135M, one request decoding on 2 cores: the
    step's matmuls 21 -> 16 ms. float32 gains nothing from it (MKL's GEMM, see layout_for_matmul)."""
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or module.bias is not None or not has_onednn_bf16():
            continue
        if module.weight.device.type == "cpu" and module.weight.dtype == torch.bfloat16:
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, PackedLinear(module))
    return model


def read_config(path: str) -> PretrainedConfig:
    """config.json, checked for what this module implements."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"model folder {path!r} does not exist")
    if not (folder / "config.json").is_file():
        raise ValueError(f"model folder {path!r} has no config.json")
    config = AutoConfig.from_pretrained(path)
    if config.model_type != "llama":
        raise ValueError(f"unsupported model_type {config.model_type!r} (architectures "
                         f"{getattr(config, 'architectures', None)}): nanoserve only runs Llama models")
    if config.attention_bias or config.mlp_bias:
        raise ValueError("attention_bias / mlp_bias are not supported (Llama checkpoints have none)")
    if config.hidden_act != "silu":
        raise ValueError(f"unsupported hidden_act {config.hidden_act!r}: Llama uses 'silu'")
    return config


def index_checkpoint(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (one file, or the shards of an index)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({folder / name for name in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model folder {str(folder)!r} has no *.safetensors files")
    names = {}
    for file in files:
        with safe_open(file, framework="pt") as f:  # reads only the header
            names.update({name: file for name in f.keys()})
    return names


def expected_shapes(config: PretrainedConfig, head_dim: int) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama checkpoint must hold (Hugging Face names), with its shape."""
    hidden, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    q_size, kv_size = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}"
        shapes |= {
            f"{layer}.self_attn.q_proj.weight": (q_size, hidden),
            f"{layer}.self_attn.k_proj.weight": (kv_size, hidden),
            f"{layer}.self_attn.v_proj.weight": (kv_size, hidden),
            f"{layer}.self_attn.o_proj.weight": (hidden, q_size),
            f"{layer}.mlp.gate_proj.weight": (inter, hidden),
            f"{layer}.mlp.up_proj.weight": (inter, hidden),
            f"{layer}.mlp.down_proj.weight": (hidden, inter),
            f"{layer}.input_layernorm.weight": (hidden,),
            f"{layer}.post_attention_layernorm.weight": (hidden,),
        }
    return shapes


def check_shapes(files: dict[str, Path], shapes: dict[str, tuple[int, ...]]) -> None:
    """Fail before loading anything if a tensor is missing or has the wrong shape."""
    for name, shape in shapes.items():
        if name not in files:
            raise ValueError(f"checkpoint is missing tensor {name!r} (expected shape {list(shape)})")
        with safe_open(files[name], framework="pt") as f:
            found = f.get_slice(name).get_shape()
        if tuple(found) != shape:
            raise ValueError(f"checkpoint tensor {name!r} has shape {list(found)}, expected {list(shape)}")


def checkpoint_names(param_name: str) -> list[str]:
    """Our parameter name -> the checkpoint tensors it is made of (several when fused)."""
    for fused, parts in FUSED.items():
        if f".{fused}." in param_name:
            return [param_name.replace(fused, part) for part in parts]
    return [param_name]  # everything else keeps its Hugging Face name


def split_dim(name: str) -> int | None:
    """The dim a checkpoint tensor is split on across tensor-parallel ranks (see parallel.py):
    0 = output rows (columns of the matmul: heads, hidden units, vocabulary), 1 = input; None: whole."""
    if any(part in name for part in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "embed_tokens", "lm_head")):
        return 0
    if "o_proj" in name or "down_proj" in name:
        return 1
    return None  # the norms


def read_tensor(files: dict[str, Path], name: str, shard: Shard = Shard()) -> torch.Tensor:
    """A checkpoint tensor, or only `shard`'s slice of it (read from disk as a slice)."""
    with safe_open(files[name], framework="pt", device="cpu") as f:
        dim = split_dim(name)
        if shard.size == 1 or dim is None:
            return f.get_tensor(name)
        tensor = f.get_slice(name)
        part = shard.part(tensor.get_shape()[dim])
        return tensor[part] if dim == 0 else tensor[:, part]
