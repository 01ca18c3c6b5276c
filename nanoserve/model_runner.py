"""The model runner: owns the model, the KV cache and the sampler, and runs one Batch per step.

Planning (scheduler, block_manager) never touches tensors; here a plan, flattened into a `Batch`
(batch.py), meets the weights and the KV cache.
"""
from __future__ import annotations

import json
import re
import warnings
import weakref
from pathlib import Path

import psutil
import torch
import torch.distributed as dist

from nanoserve.attention import select_backend
from nanoserve.batch import Batch
from nanoserve.config import CPU_KV_CACHE_FRACTION, Config, cdiv
from nanoserve.models.llama import load_model
from nanoserve.parallel import Shard, Workers, broadcast_from_rank0, join_group, rank_device, shut_down
from nanoserve.sampler import sample
from nanoserve.sequence import Sequence


class ModelRunner:
    """Owns the model, the KV cache and the sampler; runs one Batch per step. With tensor
    parallelism (parallel.py) every rank has one, holding its shard; rank 0's also starts and
    drives the workers, and samples."""

    def __init__(self, config: Config, device: torch.device, max_model_len: int, rank: int = 0,
                 store: dist.TCPStore | None = None) -> None:
        self.shard = Shard(rank, config.tensor_parallel_size)
        self.device = rank_device(device, rank) if self.shard.size > 1 else device
        self.workers, self.release = None, lambda: None  # release: what close() does
        if self.shard.size > 1 and rank == 0:
            self.workers = Workers(config, max_model_len, device)
            store = self.workers.store
            # at close(), or once this runner is garbage (an LLM dropped without close()); only once
            self.release = weakref.finalize(self, shut_down, self.workers)
        try:
            if self.workers is not None:
                self.workers.wait_until_started()
            if self.shard.size > 1:
                join_group(self.shard, store, self.device)
            self.load(config, max_model_len)
            if self.shard.size > 1:
                dist.barrier()  # every rank has its shard and cache: a worker's failure shows here
        except BaseException as error:
            self.stop_workers_after(error)
            raise

    def load(self, config: Config, max_model_len: int) -> None:
        """The model (this rank's shard of it) and a KV cache of the blocks rank 0 decided on."""
        device = self.device
        self.dtype = resolve_dtype(config.dtype, device, config.model)
        self.backend = select_backend(config.attention_backend, device, config.block_size, self.dtype)
        self.model = load_model(config.model, self.dtype, device, self.backend, self.shard)
        self.num_blocks = config.num_kvcache_blocks or self.size_kv_cache(config, max_model_len)
        if self.shard.size > 1:
            self.num_blocks = broadcast_from_rank0(self.num_blocks)  # the same block tables fit every rank
        needed, available = self.num_blocks * self.bytes_per_block(config.block_size), self.free_memory()[0]
        if needed > available:
            raise ValueError(f"num_kvcache_blocks={self.num_blocks} needs {needed / 2**30:.2f} GiB for the KV cache, "
                             f"but only {available / 2**30:.2f} GiB of {device.type} memory is free")
        # [2 (k and v), num_layers, num_blocks, block_size, num_kv_heads, head_dim]: flash-attn's
        # paged layout per layer (this rank's KV heads). Zeros, not empty: padding slots are read
        # (and masked) by attention.
        self.kv_cache = torch.zeros(2, self.model.num_layers, self.num_blocks, config.block_size,
                                    self.model.num_kv_heads, self.model.head_dim, dtype=self.dtype, device=device)

    def bytes_per_block(self, block_size: int) -> int:
        """One block's KV bytes in this device's memory: this rank's, times the ranks sharing a CPU's RAM."""
        m, ranks_here = self.model, self.shard.size if self.device.type == "cpu" else 1
        return ranks_here * 2 * m.num_layers * block_size * m.num_kv_heads * m.head_dim * self.dtype.itemsize

    def free_memory(self) -> tuple[int, int]:
        """(free, total) bytes of the device's memory; on a CPU, or Apple's unified memory, the RAM
        available to a new allocation (psutil: the same on Linux, macOS and Windows)."""
        if self.device.type == "cuda":
            return torch.cuda.mem_get_info(self.device)
        memory = psutil.virtual_memory()
        return memory.available, memory.total

    def size_kv_cache(self, config: Config, max_model_len: int) -> int:
        """How many blocks fit the memory budget: `gpu_memory_utilization` of the GPU, or
        CPU_KV_CACHE_FRACTION of available RAM; never more than every seat filled to max_model_len.
        Too few for one request is an error the engine reports, never a cache over budget."""
        free, total = self.free_memory()
        if self.device.type == "cuda":
            budget = free - (1 - config.gpu_memory_utilization) * total
        else:
            budget = CPU_KV_CACHE_FRACTION * free
        most_needed = config.max_num_seqs * cdiv(max_model_len, config.block_size) + 1
        return max(0, min(int(budget // self.bytes_per_block(config.block_size)), most_needed))

    @torch.inference_mode()
    def run(self, batch: Batch, seqs: list[Sequence]) -> list[int]:
        """One forward pass over the flat batch, then sample one token per row of logits_indices;
        `seqs` are the requests that sample, in batch order (none on a worker)."""
        if self.workers is None:
            logits = self.model(batch, self.kv_cache)  # [S, vocab]: only the rows that sample
        else:
            logits = self.run_with_workers(batch)
        if not seqs:
            return []
        return sample(logits, [s.params for s in seqs], [s.num_tokens - s.num_prompt_tokens for s in seqs])

    def run_with_workers(self, batch: Batch) -> torch.Tensor:
        """Rank 0's forward: the workers get the batch and run theirs alongside."""
        try:
            self.workers.send(batch)
            return self.model(batch, self.kv_cache)
        except BaseException as error:
            self.stop_workers_after(error)
            raise

    def stop_workers_after(self, error: BaseException) -> None:
        """An error (or a Ctrl-C) mid-collective leaves the ranks out of step: stop them all, and
        raise the error of the worker at fault if one failed or died (else the caller re-raises
        `error`: also when it is a ValueError, bad input that rank 0 found itself)."""
        failure = self.workers.failure() if self.workers is not None else None
        self.close()
        if failure is not None and not isinstance(error, ValueError):
            raise failure from error

    def close(self) -> None:
        """Stop the workers and leave the process group (tensor parallelism on rank 0 only)."""
        self.release()


def resolve_dtype(name: str, device: torch.device, model: str | None = None,
                  cpuinfo: str = "/proc/cpuinfo") -> torch.dtype:
    """Config's dtype name -> torch dtype. "auto" follows the checkpoint, as transformers and vLLM do:
    the `dtype` (or older `torch_dtype`) in `model`'s config.json, float32 where it names none; on
    CUDA float32 becomes bfloat16, which flash-attn needs. bfloat16 runs on any CPU, but without
    native bf16 matmuls (x86 AVX512-BF16 or AMX, Arm BF16: flags in `cpuinfo`) it is slow: a warning says so."""
    if name == "auto":
        config_file = Path(model or "", "config.json")
        saved = json.loads(config_file.read_text()) if model and config_file.is_file() else {}
        name = saved.get("dtype") or saved.get("torch_dtype")
        dtype = getattr(torch, name) if name in ("float32", "bfloat16", "float16") else torch.float32
        if device.type == "cuda" and dtype == torch.float32:
            dtype = torch.bfloat16
    else:
        dtype = getattr(torch, name)
    if dtype == torch.bfloat16 and device.type == "cpu":
        flags = Path(cpuinfo).read_text() if Path(cpuinfo).is_file() else ""
        if not re.search(r"\b(avx512_bf16|amx_bf16|bf16)\b", flags):
            warnings.warn("this CPU has no native bfloat16 matmuls: bfloat16 will be slow; float32 is faster here")
    return dtype
