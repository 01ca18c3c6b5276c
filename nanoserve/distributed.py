"""Tensor parallelism's collectives: one model split over N processes ("ranks"), Megatron-style.

Each rank holds 1/N of every layer and does 1/N of its work. The ranks meet twice per layer to sum
their partial results (all-reduce). A linear's weight is `[out_features, in_features]` (nn.Linear's
layout). Megatron and vLLM name the two ways to split it after the math's `Y = X A`. There A is that
weight transposed, `[in_features, out_features]`:

    qkv_proj, gate_up_proj   column-parallel, split on out_features (dim 0 of the weight): rank r
                             computes its own 1/N of the query and KV heads, and 1/N of the MLP's
                             hidden units; no exchange needed
    o_proj, down_proj        row-parallel, split on in_features (dim 1 of the weight): each rank's
                             product `[N, hidden]` is a partial sum over its heads / hidden units;
                             one all-reduce adds them up
    embed_tokens, lm_head    split over the vocabulary: a rank embeds only the tokens in its range
                             (zeros elsewhere, then an all-reduce); lm_head's slices of the logits
                             are gathered on rank 0, which samples

So each rank's KV cache holds only its KV heads, under the very same block tables. The model calls
the functions here. With a `Shard` of size 1 (no tensor parallelism) each is a no-op. How the ranks
are started and driven is parallel.py.
"""

import gc
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from transformers import PretrainedConfig

# A collective that waits longer than this raises on every rank still alive: a hung rank becomes an
# error, never a hang. With gloo (CPU), a rank that dies or raises is noticed at once (its sockets
# close); NCCL notices only at this timeout.
TIMEOUT = timedelta(minutes=2)


@dataclass(frozen=True)
class Shard:
    """Which part of the model this process holds: the `rank`-th 1/`size` of every split dim."""
    rank: int = 0
    size: int = 1

    def part(self, n: int) -> slice:
        """This rank's range of a dim of length n (size divides n)."""
        step = n // self.size
        return slice(self.rank * step, (self.rank + 1) * step)


def all_reduce(x: torch.Tensor, shard: Shard) -> torch.Tensor:
    """Sum x over the ranks, in place: each rank holds a partial sum of the same `[N, hidden]`."""
    if shard.size > 1:
        dist.all_reduce(x)
    return x


def embed(input_ids: torch.Tensor, weight: torch.Tensor, shard: Shard) -> torch.Tensor:
    """`[N] -> [N, hidden]`; `weight` is this rank's rows of the embedding, a range of the vocabulary."""
    if shard.size == 1:
        return weight[input_ids]
    local = input_ids - shard.rank * weight.shape[0]  # [N], an index into this rank's rows
    mine = (local >= 0) & (local < weight.shape[0])
    x = weight[local.where(mine, 0)].masked_fill(~mine[:, None], 0)  # other ranks' tokens: zeros
    return all_reduce(x, shard)


def gather_on_rank0(x: torch.Tensor, shard: Shard) -> torch.Tensor | None:
    """Every rank's `[S, vocab / N]` slice of the logits, side by side on rank 0 `[S, vocab]`; None elsewhere."""
    if shard.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(shard.size)] if shard.rank == 0 else None
    dist.gather(x.contiguous(), parts, dst=0)
    return torch.cat(parts, dim=-1) if parts else None


def broadcast_from_rank0(value: object, shard: Shard) -> object:
    """Rank 0's `value` on every rank (the others pass None)."""
    if shard.size == 1:
        return value
    objects = [value]
    dist.broadcast_object_list(objects, src=0)
    return objects[0]


def join_group(shard: Shard, store: dist.TCPStore, device: torch.device) -> torch.device:
    """Every rank calls this once: one process group, gloo between CPU processes, NCCL between GPUs,
    meeting at rank 0's TCPStore. Returns the rank's device. On a CPU every rank shares `device`. On CUDA,
    rank r's is the r-th GPU after rank 0's `device`."""
    cuda = device.type == "cuda"
    if cuda:
        device = torch.device("cuda", (device.index or 0) + shard.rank)
        torch.cuda.set_device(device)  # collectives' (and broadcast_object_list's) current GPU
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=shard.rank, world_size=shard.size,
                            timeout=TIMEOUT, device_id=device if cuda else None)
    return device


def check_tensor_parallel(size: int, hf_config: PretrainedConfig, device: torch.device) -> None:
    """N must split the heads, the MLP and the vocabulary evenly, and have a device per rank.
    This process must not be in a process group already."""
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        if (value := getattr(hf_config, name)) % size:
            raise ValueError(f"tensor_parallel_size={size} does not divide the model's {name}={value}")
    if size > 1:
        gc.collect()  # an LLM dropped without close() leaves the group once it is collected
        if dist.is_initialized():
            raise ValueError("this process already has a torch.distributed process group (another LLM with "
                             "tensor_parallel_size > 1 still open?): close() that one first")
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"tensor_parallel_size={size} runs on cpu (gloo) or cuda (NCCL), not {device.type}")
    if device.type == "cuda" and (device.index or 0) + size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={size} from {device} needs more CUDA devices than the "
                         f"{torch.cuda.device_count()} this machine has")
