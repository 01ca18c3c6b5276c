"""How a Hugging Face checkpoint (a folder of config.json and *.safetensors) becomes a model.
The model is llama.py's, built with the `Family` (families.py) its config.json describes.
The page docs/models.md says how to add a family. The engine reads config.json once per process
(`read_checkpoint`) and passes it down as a `Checkpoint`.

Invariants:
- Every parameter comes from the checkpoint. Every tensor that transformers' model of the architecture
  reads, ours reads too. The model is built on the meta device (no memory, no random init). Then
  `load_model` assigns real tensors. Or, before anything is loaded, it raises a `ValueError` naming what
  is wrong. That may be a missing file or tensor, a wrong shape, or a tensor no parameter of ours is made of.
- Checkpoint names map onto the model's parameters by one table, the model's `checkpoint_modules`
  (llama.py's `CHECKPOINT_MODULES`). It says which checkpoint tensors stack into a fused parameter, and
  the dim tensor parallelism splits each on. With tensor parallelism a rank reads only its slices, from disk.
- After loading, each linear layer gets the implementation this device runs fastest (layers/linear.py).
  Or it gets the weight transform's (seams.py): an int8 weight with `quantization` (extensions/quantization.py).
"""

import json
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from nanoserve.distributed import Shard
from nanoserve.layers.linear import pack_linears
from nanoserve.models.families import Family, describe
from nanoserve.models.llama import LlamaForCausalLM
from nanoserve.seams import WeightTransform


class Checkpoint(NamedTuple):
    """A checkpoint folder's config.json, read once per process (`read_checkpoint`) and passed down.
    It holds the folder, the config and the `Family` it describes (families.py)."""
    folder: Path
    config: PretrainedConfig
    family: Family


def load_model(checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device, attention_backend: str,
               shard: Shard = Shard(), compiled_one_row: bool = False,
               transform: WeightTransform | None = None) -> nn.Module:
    """Build the model of a Hugging Face folder (config.json + *.safetensors) on `device` in `dtype`.

    With tensor parallelism it builds only `shard`'s part: every tensor is sliced as it is read.
    Its linears suit the engine's steps (layers/linear.py: `compiled_one_row`). Or they are `transform`'s,
    made of this shard's weights (the weight transform seam, seams.py: int8 quantization)."""
    folder, config, family = checkpoint
    with torch.device("meta"):  # shapes only: every parameter is replaced by a checkpoint tensor
        model = LlamaForCausalLM(config, family, attention_backend, shard)
    tied = family.tie_word_embeddings
    parts = {name: checkpoint_parts(name, model.checkpoint_modules) for name, _ in model.named_parameters()
             if not (name == "lm_head.weight" and tied)}
    files = index_checkpoint(folder)
    check_checkpoint(files, config, {part for param_parts in parts.values() for part, _ in param_parts})
    weights = {}
    for name, param_parts in parts.items():
        # A fused parameter stacks its checkpoint tensors on the output dim, e.g. q, k, v
        tensor = torch.cat([read_tensor(files, part, dim, shard) for part, dim in param_parts])
        weights[name] = tensor.to(device=device, dtype=dtype)
    # assign: the checkpoint's tensors become the parameters (a meta parameter has no memory to copy into)
    model.requires_grad_(False).load_state_dict(weights, strict=False, assign=True)  # a tied lm_head is not in it
    if tied:  # lm_head.weight is the embedding matrix, not a copy
        model.lm_head.weight = model.model.embed_tokens.weight
    model = model.to(device).eval()  # .to moves the RoPE cache; parameters are already there
    if transform is not None:
        return transform(model)
    return pack_linears(model, compiled_one_row)


def checkpoint_parts(param_name: str, table: dict[str, tuple[str, int]]) -> list[tuple[str, int | None]]:
    """Our parameter -> the checkpoint tensors it is made of, in order, each with its split dim.
    The model's `table` says which (llama.py's CHECKPOINT_MODULES). A bias maps likewise. For example:

        "model.layers.0.self_attn.qkv_proj.weight" -> [("model.layers.0.self_attn.q_proj.weight", 0), (k...), (v...)]
    """
    # ["model", "layers", "0", "self_attn"] ([] for lm_head), "qkv_proj", "weight"
    *parents, module, leaf = param_name.split(".")
    parts = [(".".join([*parents, theirs, leaf]), dim) for theirs, (ours, dim) in table.items() if ours == module]
    return parts or [(param_name, None)]  # not in the table (the norms): the same name, whole on every rank


def read_checkpoint(path: str) -> Checkpoint:
    """config.json and the `Family` it describes (families.py), read once per process.
    The engine reads it, and so does each tensor-parallel worker.

    It checks for an architecture in MODELS, and for what llama.py implements. Only attributes every
    family's config has are read as such. A family's own (Llama's attention_bias) are read where present."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"model folder {path!r} does not exist")
    if not (folder / "config.json").is_file():
        raise ValueError(f"model folder {path!r} has no config.json")
    config = AutoConfig.from_pretrained(path)
    family = describe(config)  # raises for an architecture not in MODELS
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        raise ValueError("attention_bias / mlp_bias are not supported: of the linears, only q, k and v may "
                         "have a bias (Qwen2's)")
    if config.num_attention_heads % config.num_key_value_heads:
        raise ValueError(f"num_attention_heads={config.num_attention_heads} is not a multiple of "
                         f"num_key_value_heads={config.num_key_value_heads}: query heads must share kv heads evenly")
    return Checkpoint(folder, config, family)


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
            names |= dict.fromkeys(f.keys(), file)
    return names


def check_checkpoint(files: dict[str, Path], config: PretrainedConfig, used: set[str]) -> None:
    """Fail before loading anything if a tensor is missing or has the wrong shape.
    Fail too if our model would leave one unread. (`used` is the checkpoint tensors its parameters are made of.)

    A checkpoint holds the tensors, with the shapes, that transformers' own model of its architecture holds.
    That model is built on the meta device (shapes only, no memory). A tied lm_head is not stored."""
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(config)
    for name, tensor in reference.state_dict().items():
        shape = list(tensor.shape)
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name not in files:
            raise ValueError(f"checkpoint is missing tensor {name!r} (expected shape {shape})")
        if name not in used:  # e.g. a family with biases registered in MODELS without its flag
            raise ValueError(f"checkpoint tensor {name!r} has no parameter of ours to load into")
        with safe_open(files[name], framework="pt") as f:
            found = f.get_slice(name).get_shape()
        if found != shape:
            raise ValueError(f"checkpoint tensor {name!r} has shape {found}, expected {shape}")
    if missing := sorted(used - files.keys()):  # e.g. a family without biases registered with a bias flag
        raise ValueError(f"checkpoint is missing tensor {missing[0]!r}, which our model reads")


def read_tensor(files: dict[str, Path], name: str, dim: int | None, shard: Shard) -> torch.Tensor:
    """A checkpoint tensor, or only `shard`'s slice of it along `dim` (read from disk as a slice)."""
    with safe_open(files[name], framework="pt", device="cpu") as f:
        if dim is None:
            return f.get_tensor(name)
        tensor = f.get_slice(name)
        part = shard.part(tensor.get_shape()[dim])
        return tensor[part] if dim == 0 else tensor[:, part]
