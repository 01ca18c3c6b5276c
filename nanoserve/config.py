"""Engine configuration: one frozen dataclass, checked once, never written back.

A Config says exactly what the user asked for. What start-up derives from it and the machine is computed
once, where it is needed. It is passed on as an argument, or held by its owner. Each derived value, where
it comes from, and who uses it:
- device. `device.resolve_device` picks cuda if available, else cpu. The engine and the model runner use it.
- max_model_len. It is the model's max_position_embeddings unless given (`LLMEngine.__init__`).
  The scheduler uses it for the length stop and the static reservation. The model runner sizes the cache by it.
- dtype. `device.resolve_dtype` starts from the checkpoint's, as transformers parsed it from config.json.
  On CUDA it is bfloat16, or float16 below sm80. On a CPU a bfloat16 checkpoint stays bfloat16 only where
  its matmuls beat float32 (AMX on x86). Else it is float32.
- the attention backend and the block_size. `attention.select_attention` picks flash and 256 where
  flash-attn 2 runs, else 16 with torch (or triton on CUDA). The model runner loads the model with them,
  and with the dtype. The engine and the scheduler use block_size too.
- config.json. `models.loader.read_checkpoint` reads it once, with the model's family
  (`models.families.describe`, by config.json's `architectures`). The model runner loads the model with it.
- on a CPU, each linear layer's weight layout. `layers.linear.choose_linear` picks it from the dtype, what
  oneDNN does on this CPU, and enforce_eager with max_num_seqs. `pack_linears` applies it to the model at
  load. With `quantization` the weights are int8 instead (quantization.py).
- num_blocks. `ModelRunner.size_kv_cache` computes it from free memory, on rank 0 alone, unless
  num_kvcache_blocks is given. It is broadcast to the other ranks. The KV cache and the block manager use it.
- the tokenizer and the EOS token ids (tokenizer.py). The engine and the scheduler use them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields

from nanoserve.sampling_params import check_bool, check_positive_int, is_finite_real, require

# Without num_kvcache_blocks on a CPU, the KV cache takes at most this share of available RAM.
CPU_KV_CACHE_FRACTION = 0.1


# With this many requests running, a step has no drafts: a large batch is compute-bound, and rejected drafts cost.
DISABLE_BY_BATCH_SIZE = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` keys for method "ngram" (spec_decode.py drafts with them).

    Without prompt_lookup_min and _max, both are 5, as in vLLM. With one, the other takes its value.
    There are no drafts while disable_by_batch_size requests run. vLLM's default is never. Ours is
    DISABLE_BY_BATCH_SIZE (docs/speculative-decoding.md says why)."""
    num_speculative_tokens: int
    prompt_lookup_max: int
    prompt_lookup_min: int
    disable_by_batch_size: int

    @classmethod
    def from_dict(cls, config: dict) -> SpeculativeConfig:
        """Checked: a ValueError names the key at fault."""
        if not isinstance(config, dict) or config.get("method") != "ngram":
            raise ValueError(f"speculative_config must be a dict with method 'ngram', got {config!r}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"}
        if unknown := sorted(set(config) - known):
            raise ValueError(f"speculative_config: unknown key(s) {unknown}; valid keys: {sorted(known)}")
        low, high = config.get("prompt_lookup_min"), config.get("prompt_lookup_max")
        if low is None and high is None:
            low = high = 5  # vLLM's default
        values = dict(num_speculative_tokens=config.get("num_speculative_tokens"),
                      prompt_lookup_min=high if low is None else low, prompt_lookup_max=low if high is None else high,
                      disable_by_batch_size=config.get("disable_by_batch_size", DISABLE_BY_BATCH_SIZE))
        for name, value in values.items():
            check_positive_int(f"speculative_config: {name}", value)
        if values["prompt_lookup_min"] > values["prompt_lookup_max"]:
            raise ValueError(f"speculative_config: prompt_lookup_min {low} > prompt_lookup_max {high}")
        return cls(**values)


@dataclass(frozen=True)
class Config:
    model: str
    block_size: int | str = "auto"            # "auto": 256 where flash-attn 2 runs, else 16 (see above)
    num_kvcache_blocks: int | None = None     # None: sized from memory (see model_runner)
    max_num_seqs: int = 256                   # requests running at once
    max_num_batched_tokens: int = 2048        # tokens per step: prefill chunks + decodes
    max_model_len: int | None = None          # None: the model's max_position_embeddings
    enable_prefix_caching: bool = True
    dtype: str = "auto"                       # auto: the checkpoint's (float32 -> bfloat16 on CUDA, sm < 80: float16)
    device: str | None = None                 # None: cuda if available, else cpu; or "mps" (Apple)
    attention_backend: str = "auto"           # "auto" | "flash" | "triton" | "torch"
    scheduling: str = "continuous"            # "continuous" | "static" (the baseline)
    gpu_memory_utilization: float = 0.9       # share of GPU memory for weights + KV cache
    tensor_parallel_size: int = 1             # processes (ranks) the model is split over (parallel.py)
    # True: op by op, the readable reference. False: compiled (compilation.py), and on CUDA with flash-attn decode
    # steps replay CUDA graphs (cuda_graphs.py). Opt-in: on the CPUs measured it was no faster at one request,
    # slower at 48, and took 30-90 s to start (docs/performance.md, "The compiled step")
    enforce_eager: bool = True
    speculative_config: dict | None = None    # vLLM's, method "ngram" only (spec_decode.py); None: off
    quantization: str | None = None           # "int8": a scale per output channel; "int4": per group (quantization.py)
    quantization_config: dict | None = None   # int4's {"group_size": 32, 64 or 128}; None: 32

    def __post_init__(self) -> None:
        require(isinstance(self.model, str), "model", self.model, "a path to a model folder (str)")
        for name in ("max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
            check_positive_int(name, getattr(self, name))
        for name, unset in (("block_size", "auto"), ("num_kvcache_blocks", None), ("max_model_len", None)):
            if getattr(self, name) != unset:  # the value that leaves it to be derived (see the fields' comments)
                check_positive_int(name, getattr(self, name))
        require(self.scheduling in ("continuous", "static"), "scheduling", self.scheduling, "'continuous' or 'static'")
        require(self.dtype in ("auto", "float32", "bfloat16", "float16"), "dtype", self.dtype,
                "auto, float32, bfloat16 or float16")
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        check_bool("enforce_eager", self.enforce_eager)
        require(self.device is None or isinstance(self.device, str), "device", self.device,
                "a str such as 'cpu', 'cuda', 'cuda:1' or 'mps'")
        require(self.quantization in (None, "int8", "int4"), "quantization", self.quantization,
                "None, 'int8' (weight-only, a scale per output channel) or 'int4' (weight-only, group-wise)")
        if self.quantization_config is not None:
            require(self.quantization == "int4" and isinstance(self.quantization_config, dict)
                    and set(self.quantization_config) <= {"group_size"}
                    and self.quantization_config.get("group_size", 32) in (32, 64, 128), "quantization_config",
                    self.quantization_config, "None, or with quantization='int4' {'group_size': 32, 64 or 128}")
        if self.speculative_config is not None:
            SpeculativeConfig.from_dict(self.speculative_config)  # raises a ValueError naming the key at fault
        require(is_finite_real(self.gpu_memory_utilization) and 0 < self.gpu_memory_utilization <= 1,
                "gpu_memory_utilization", self.gpu_memory_utilization, "a number in (0, 1]")

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: object) -> Config:
        """Config from LLM(model, **kwargs): an unknown key is an error, never silently ignored."""
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(kwargs) - known):
            raise ValueError(f"unknown config key(s) {unknown}; valid keys: {sorted(known - {'model'})}")
        return cls(model=os.fspath(model) if isinstance(model, os.PathLike) else model, **kwargs)


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of b hold a items."""
    return -(-a // b)
