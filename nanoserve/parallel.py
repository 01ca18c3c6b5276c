"""Tensor parallelism: one model split over N processes ("ranks"), Megatron-style.

Each rank holds 1/N of every layer and does 1/N of its work; the ranks meet twice per layer to sum
their partial results (all-reduce):

    qkv_proj, gate_up_proj   split by output columns: rank r computes its own 1/N of the query and
                             KV heads, and 1/N of the MLP's hidden units; no exchange needed
    o_proj, down_proj        split by input rows: each rank's product `[N, hidden]` is a partial
                             sum over its heads / hidden units; one all-reduce adds them up
    embed_tokens, lm_head    split over the vocabulary: a rank embeds only the tokens in its range
                             (zeros elsewhere, then an all-reduce); lm_head's slices of the logits
                             are gathered on rank 0, which samples

So each rank's KV cache holds only its KV heads, under the very same block tables. Rank 0 is the
engine: scheduler, block manager and sampler live there only. Each step it sends the `Batch` to
the other ranks (the workers) over a pipe, then every rank runs the same forward on its shard.
With tensor_parallel_size 1 none of this runs: no process group, no process, `all_reduce` is a no-op.
"""
from __future__ import annotations

import gc
import signal
import traceback
from dataclasses import dataclass, fields
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import PretrainedConfig

from nanoserve.batch import Batch
from nanoserve.config import Config

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


def check_tensor_parallel(size: int, hf_config: PretrainedConfig, device: torch.device) -> None:
    """N must split the heads, the MLP and the vocabulary evenly, and have a device per rank; this
    process must not be in a process group already."""
    for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
        if getattr(hf_config, name) % size:
            raise ValueError(f"tensor_parallel_size={size} does not divide the model's {name}={getattr(hf_config, name)}")
    if size > 1 and dist.is_initialized():
        gc.collect()  # an LLM dropped without close() leaves the group once it is collected
    if size > 1 and dist.is_initialized():
        raise ValueError("this process already has a torch.distributed process group (another LLM with "
                         "tensor_parallel_size > 1 still open?): close() that one first")
    if size > 1 and device.type not in ("cpu", "cuda"):
        raise ValueError(f"tensor_parallel_size={size} runs on cpu (gloo) or cuda (NCCL), not {device.type}")
    if device.type == "cuda" and (device.index or 0) + size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={size} from {device} needs more CUDA devices than the "
                         f"{torch.cuda.device_count()} this machine has")


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: the next r-th GPU after rank 0's; on a CPU every rank shares it."""
    return torch.device("cuda", (device.index or 0) + rank) if device.type == "cuda" else device


def join_group(shard: Shard, store: dist.TCPStore, device: torch.device) -> None:
    """Every rank calls this once: one process group, gloo between CPU processes, NCCL between GPUs,
    meeting at rank 0's TCPStore. `device` has its index on CUDA (see rank_device)."""
    backend, device_id = ("nccl", device) if device.type == "cuda" else ("gloo", None)
    if device_id is not None:
        torch.cuda.set_device(device_id)  # collectives' (and broadcast_object_list's) current GPU
    dist.init_process_group(backend, store=store, rank=shard.rank, world_size=shard.size, timeout=TIMEOUT,
                            device_id=device_id)


def broadcast_from_rank0(value: object) -> object:
    """Rank 0's `value` on every rank."""
    objects = [value]
    dist.broadcast_object_list(objects, src=0)
    return objects[0]


class Workers:
    """Ranks 1..N-1, each a process running `run_worker`, driven by rank 0 over one pipe each."""

    def __init__(self, config: Config, max_model_len: int, device: torch.device) -> None:
        # The group's meeting point, on a port the system picks: rank 0 serves it, workers connect
        self.store = dist.TCPStore("127.0.0.1", 0, config.tensor_parallel_size, is_master=True,
                                   wait_for_workers=False, timeout=TIMEOUT)
        if device.type == "cpu":  # the ranks share the cores: each takes 1/N of this process's threads
            torch.set_num_threads(max(1, torch.get_num_threads() // config.tensor_parallel_size))
        # spawn, not fork: a fork of a process running OpenMP or CUDA threads can deadlock
        context = mp.get_context("spawn")
        self.pipes, self.processes = [], []
        for rank in range(1, config.tensor_parallel_size):
            pipe, child_end = context.Pipe()
            args = (config, max_model_len, rank, self.store.port, child_end, device, torch.get_num_threads())
            process = context.Process(target=run_worker, args=args, daemon=True)  # daemon: ends with us
            process.start()
            child_end.close()  # ours closed, so a worker's death reads as EOF here
            self.pipes.append(pipe)
            self.processes.append(process)

    def report(self, rank: int, wait: float = 0.0) -> str | None:
        """What worker `rank` says within `wait` seconds: "started", "failed:" and its traceback,
        "died (exit code N)" if it is gone without a word, or None while it runs silently."""
        pipe, process = self.pipes[rank - 1], self.processes[rank - 1]
        try:
            if pipe.poll(wait):
                return pipe.recv()
        except (EOFError, OSError):  # its end of the pipe closed: it died
            pass
        if process.is_alive():
            return None
        process.join()
        return f"died (exit code {process.exitcode})"

    def wait_until_started(self) -> None:
        """Each worker says "started" just before joining the group: one that fails or dies first
        is an error now, not after rank 0 has waited TIMEOUT for it in the group's rendezvous."""
        for rank in range(1, len(self.processes) + 1):
            while (message := self.report(rank, wait=0.1)) is None:
                pass
            if message != "started":
                raise RuntimeError(f"tensor-parallel worker {rank} failed to start: {message}")

    def send(self, batch: Batch) -> None:
        """The next step's `Batch` to every worker, as numpy arrays: they pickle in microseconds,
        where tensors would each go through a shared-memory file (milliseconds a step)."""
        if not self.processes:
            raise RuntimeError("the tensor-parallel workers are stopped (closed, or after an error): create a new LLM")
        arrays = {f.name: value.cpu().numpy() if isinstance(value := getattr(batch, f.name), torch.Tensor) else value
                  for f in fields(batch)}
        for pipe in self.pipes:
            pipe.send(arrays)

    def failure(self) -> RuntimeError | None:
        """After a step failed on rank 0: the error of the worker that failed or died, if one did."""
        for rank, process in enumerate(self.processes, start=1):
            process.join(timeout=1)  # a failing worker reports, then exits
            if (message := self.report(rank)) is not None:
                return RuntimeError(f"tensor-parallel worker {rank} {message}")
        return None

    def close(self) -> None:
        """Stop every worker: ask (None instead of a Batch), wait a little, then terminate."""
        for pipe in self.pipes:
            try:
                pipe.send(None)
            except OSError:  # that worker is gone already
                pass
        for process in self.processes:
            process.join(timeout=2)  # one stuck in a collective never reads the pipe
            if process.is_alive():
                process.terminate()
                process.join()
        self.pipes, self.processes, self.store = [], [], None  # the store's port is free once collected


def shut_down(workers: Workers) -> None:
    """Rank 0's end of tensor parallelism: stop the workers, leave the process group."""
    try:
        workers.close()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_worker(config: Config, max_model_len: int, rank: int, port: int, pipe: object,
               device: torch.device, num_threads: int) -> None:
    """A worker's life: join the group, load its shard, then run every Batch rank 0 sends until
    None. Anything raised goes back to rank 0 over the pipe; the exit closes its sockets, which
    fails rank 0's collective at once."""
    from nanoserve.model_runner import ModelRunner  # here: model_runner imports this module
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle
    torch.set_num_threads(num_threads)
    try:
        store = dist.TCPStore("127.0.0.1", port, config.tensor_parallel_size, is_master=False, timeout=TIMEOUT)
        pipe.send("started")
        runner = ModelRunner(config, device, max_model_len, rank, store)
        while (arrays := pipe.recv()) is not None:
            batch = Batch(**{name: torch.from_numpy(value).to(runner.device) if isinstance(value, np.ndarray)
                             else value for name, value in arrays.items()})
            runner.run(batch, [])
    except EOFError:  # rank 0 is gone
        pass
    except BaseException:
        try:
            pipe.send("failed:\n" + traceback.format_exc())
        except OSError:  # rank 0 is gone too
            pass
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
