"""How a Hugging Face checkpoint (a folder of config.json and *.safetensors) becomes a Llama.

Invariants:
- Every parameter comes from the checkpoint: the model is built on the meta device (no memory, no
  random init) and `load_model` assigns real tensors, or raises a `ValueError` naming what is wrong
  before anything is loaded (a missing file, tensor, or a wrong shape).
- Checkpoint names map onto the model's parameters by one table, llama.py's `CHECKPOINT_MODULES`:
  which checkpoint tensors stack into a fused parameter, and the dim tensor parallelism splits each
  on. With tensor parallelism a rank reads only its slices, from disk.
- After loading, each linear layer gets the implementation this device runs fastest (layers/linear.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, PretrainedConfig

from nanoserve.distributed import Shard
from nanoserve.layers.linear import pack_linears
from nanoserve.models.llama import CHECKPOINT_MODULES, LlamaForCausalLM


def load_model(path: str, dtype: torch.dtype, device: torch.device, attention_backend: str,
               shard: Shard = Shard(), max_num_seqs: int = 256) -> LlamaForCausalLM:
    """Build a Llama from a Hugging Face folder (config.json + *.safetensors) on `device` in `dtype`;
    with tensor parallelism, only `shard`'s part of it: every tensor is sliced as it is read. Its
    linears suit decode steps of up to `max_num_seqs` rows (layers/linear.py)."""
    config = read_config(path)
    with torch.device("meta"):  # shapes only: every parameter is replaced by a checkpoint tensor
        model = LlamaForCausalLM(config, attention_backend, shard)
    files = index_checkpoint(Path(path))
    check_shapes(files, config)
    for name, _ in list(model.named_parameters()):
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        # A fused parameter stacks its checkpoint tensors on the output dim, e.g. q, k, v
        tensor = torch.cat([read_tensor(files, part, dim, shard) for part, dim in checkpoint_parts(name)])
        module_name, _, leaf = name.rpartition(".")
        weight = nn.Parameter(tensor.to(device=device, dtype=dtype), requires_grad=False)
        setattr(model.get_submodule(module_name), leaf, weight)
    if config.tie_word_embeddings:  # tied: lm_head.weight is the embedding matrix, not a copy
        model.lm_head.weight = model.model.embed_tokens.weight
    return pack_linears(model.to(device).eval(), max_num_seqs)  # .to moves the RoPE cache; parameters are already there


def checkpoint_parts(param_name: str) -> list[tuple[str, int | None]]:
    """Our parameter -> the checkpoint tensors it is made of, in order, each with its split dim:
    "model.layers.0.self_attn.qkv_proj.weight" -> [("model.layers.0.self_attn.q_proj.weight", 0), (k...), (v...)]."""
    module_path, leaf = param_name.rsplit(".", 1)  # "model.layers.0.self_attn.qkv_proj", "weight"
    module = module_path.rpartition(".")[2]  # "qkv_proj"
    parent = module_path[:len(module_path) - len(module)]  # "model.layers.0.self_attn." ("" for lm_head)
    parts = [(f"{parent}{theirs}.{leaf}", dim) for theirs, (ours, dim) in CHECKPOINT_MODULES.items() if ours == module]
    return parts or [(param_name, None)]  # not in the table (the norms): the same name, whole on every rank


def read_config(path: str) -> PretrainedConfig:
    """config.json, checked for what llama.py implements."""
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


def check_shapes(files: dict[str, Path], config: PretrainedConfig) -> None:
    """Fail before loading anything if a tensor is missing or has the wrong shape. Which tensors a Llama
    checkpoint holds, and their shapes, is what transformers' own Llama holds, built on the meta device
    (shapes only, no memory); a tied lm_head is not stored."""
    with torch.device("meta"):
        reference = transformers.LlamaForCausalLM(config)
    for name, tensor in reference.state_dict().items():
        shape = tuple(tensor.shape)
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name not in files:
            raise ValueError(f"checkpoint is missing tensor {name!r} (expected shape {list(shape)})")
        with safe_open(files[name], framework="pt") as f:
            found = f.get_slice(name).get_shape()
        if tuple(found) != shape:
            raise ValueError(f"checkpoint tensor {name!r} has shape {list(found)}, expected {list(shape)}")


def read_tensor(files: dict[str, Path], name: str, dim: int | None, shard: Shard = Shard()) -> torch.Tensor:
    """A checkpoint tensor, or only `shard`'s slice of it along `dim` (read from disk as a slice)."""
    with safe_open(files[name], framework="pt", device="cpu") as f:
        if shard.size == 1 or dim is None:
            return f.get_tensor(name)
        tensor = f.get_slice(name)
        part = shard.part(tensor.get_shape()[dim])
        return tensor[part] if dim == 0 else tensor[:, part]
