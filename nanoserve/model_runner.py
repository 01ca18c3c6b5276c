"""The model runner: owns the model, the KV cache and the sampler, and runs one Batch per step.

Planning (scheduler, block_manager) never touches tensors; here a plan, flattened into a `Batch`
(batch.py), meets the weights and the KV cache. With tensor parallelism every rank has a
ModelRunner holding its shard of the model and of the KV cache (distributed.py); rank 0's is a
`TensorParallelRunner` (parallel.py), which also drives the other ranks.
"""
from __future__ import annotations

import torch

from nanoserve.attention import select_backend
from nanoserve.batch import Batch, prompt_logprob_positions, samples_now
from nanoserve.config import CPU_KV_CACHE_FRACTION, Config, cdiv
from nanoserve.device import free_memory, resolve_dtype
from nanoserve.distributed import Shard, broadcast_from_rank0
from nanoserve.models.loader import load_model
from nanoserve.sampler import Logprob, SamplerOutput, sample, top_logprobs
from nanoserve.sequence import Sequence


class ModelRunner:
    """Loads the model (`shard`'s part of it) and a KV cache on `device`, and runs one Batch per step;
    rank 0's samples. Where the ranks of a group run, they must be in it already (parallel.py)."""

    def __init__(self, config: Config, device: torch.device, max_model_len: int, shard: Shard = Shard()) -> None:
        self.shard, self.device = shard, device
        self.dtype = resolve_dtype(config.dtype, device, config.model)
        self.backend = select_backend(config.attention_backend, device, config.block_size, self.dtype)
        self.model = load_model(config.model, self.dtype, device, self.backend, shard, config.max_num_seqs)
        # Rank 0 decides how many blocks; every rank's cache then holds as many, so one block table fits all.
        num_blocks = (config.num_kvcache_blocks or self.size_kv_cache(config, max_model_len)) if shard.rank == 0 else None
        self.num_blocks: int = broadcast_from_rank0(num_blocks, shard)
        needed, available = self.num_blocks * self.bytes_per_block(config.block_size), free_memory(device)[0]
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

    def size_kv_cache(self, config: Config, max_model_len: int) -> int:
        """How many blocks fit the memory budget: `gpu_memory_utilization` of the GPU, or
        CPU_KV_CACHE_FRACTION of available RAM; never more than every seat filled to max_model_len.
        Too few for one request is an error the engine reports, never a cache over budget."""
        free, total = free_memory(self.device)
        if self.device.type == "cuda":
            budget = free - (1 - config.gpu_memory_utilization) * total
        else:
            budget = CPU_KV_CACHE_FRACTION * free
        most_needed = config.max_num_seqs * cdiv(max_model_len, config.block_size) + 1
        return max(0, min(int(budget // self.bytes_per_block(config.block_size)), most_needed))

    @torch.inference_mode()
    def run(self, batch: Batch, scheduled: list[tuple[Sequence, int]]) -> SamplerOutput:
        """One forward pass over the flat batch, then one token for each request that samples now, with
        the logprobs asked for. A worker (no `scheduled`: rank 0 samples) returns nothing."""
        logits = self.model(batch, self.kv_cache)  # [S + P, vocab]: the rows that sample, then prompt-logprob rows
        seqs = [seq for seq, num_new in scheduled if samples_now(seq, num_new)]
        if not scheduled:
            return SamplerOutput([], [], [])
        sampling, prompt_rows = logits[:len(seqs)], logits[len(seqs):]  # [S, vocab], [P, vocab]
        token_ids = sample(sampling, [s.params for s in seqs], [s.num_tokens - s.num_prompt_tokens for s in seqs])
        logprobs: list[dict[int, Logprob] | None] = [None] * len(seqs)
        rows = [row for row, seq in enumerate(seqs) if seq.params.logprobs is not None]
        if rows:
            chosen = torch.tensor([token_ids[row] for row in rows], device=logits.device)
            for row, found in zip(rows, top_logprobs(sampling[rows], chosen, [seqs[r].params.logprobs for r in rows])):
                logprobs[row] = found
        num_top = [seq.params.prompt_logprobs for seq, n in scheduled for _ in prompt_logprob_positions(seq, n)]
        return SamplerOutput(token_ids, logprobs, top_logprobs(prompt_rows, batch.next_token_ids, num_top))

    @property
    def healthy(self) -> bool:
        """Can this runner still run steps? One process always can (see TensorParallelRunner)."""
        return True

    def close(self) -> None:
        """Nothing to release for one process (see TensorParallelRunner.close)."""
