"""Tensor parallelism's processes: rank 0 is the engine, ranks 1..N-1 are workers it starts and drives.

Rank 0 holds the scheduler, the block manager and the sampler. Its runner is a `TensorParallelRunner`.
Each step it sends the `Batch` to every worker over a pipe. Then every rank runs the same forward on
its own shard. (distributed.py says what each rank holds and where they meet.) Only rank 0 samples.
With tensor_parallel_size 1 nothing here runs: no process group, no process.
"""

import contextlib
import signal
import traceback
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from nanoserve.batch import Batch
from nanoserve.config import Config
from nanoserve.distributed import TIMEOUT, Shard, join_group
from nanoserve.model_runner import ModelRunner
from nanoserve.models.loader import Checkpoint, read_checkpoint
from nanoserve.sampler import SamplerOutput
from nanoserve.seams import Seams, WeightTransform
from nanoserve.sequence import ScheduledSeq


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner. It starts the workers, joins their group, and loads shard 0. It runs each step's
    Batch after sending it to the workers. Any failure stops every rank, since they are out of step."""

    def __init__(self, config: Config, device: torch.device, max_model_len: int, checkpoint: Checkpoint,
                 seams: Seams) -> None:
        shard = Shard(0, config.tensor_parallel_size)
        self.workers = Workers(config, max_model_len, device, seams.weight_transform)
        # at close(), or once this runner is garbage (an LLM dropped without close()); only once
        self.release = weakref.finalize(self, self.workers.close)
        try:
            self.workers.wait_until_started()
            device = join_group(shard, self.workers.store, device)
            super().__init__(config, device, max_model_len, checkpoint, shard, seams)
            dist.barrier()  # every rank has its shard and cache: a worker's failure shows here
        except BaseException as error:
            self.stop_workers_after(error)
            raise

    def run(self, batch: Batch, scheduled: list[ScheduledSeq]) -> SamplerOutput:
        """The workers get the batch and run theirs alongside rank 0's."""
        try:
            self.workers.send(batch)
            return super().run(batch, scheduled)
        except BaseException as error:
            self.stop_workers_after(error)
            raise

    def stop_workers_after(self, error: BaseException) -> None:
        """An error (or a Ctrl-C) mid-collective leaves the ranks out of step. So stop them all.
        If a worker failed or died, raise its error. Else the caller re-raises `error`. It does so also
        when `error` is a ValueError: bad input that rank 0 found itself."""
        failure = self.workers.failure()
        self.close()
        if failure is not None and not isinstance(error, ValueError):
            raise failure from error

    @property
    def healthy(self) -> bool:
        """False once the workers are stopped, for good (closed, or after a failed step)."""
        return bool(self.workers.processes)

    def close(self) -> None:
        """Stop the workers and leave the process group."""
        self.release()


class Workers:
    """Ranks 1..N-1, each a process running `run_worker`, driven by rank 0 over one pipe each."""

    def __init__(self, config: Config, max_model_len: int, device: torch.device,
                 weight_transform: WeightTransform | None) -> None:
        # The group's meeting point, on a port the system picks: rank 0 serves it, workers connect.
        # Without a world size, it waits for no worker to connect now.
        self.store = dist.TCPStore("127.0.0.1", 0, is_master=True, timeout=TIMEOUT)
        if device.type == "cpu":  # the ranks share the cores: each takes 1/N of this process's threads
            torch.set_num_threads(max(1, torch.get_num_threads() // config.tensor_parallel_size))
        # spawn, not fork: a fork of a process running OpenMP or CUDA threads can deadlock
        context = mp.get_context("spawn")
        self.pipes, self.processes = [], []
        for rank in range(1, config.tensor_parallel_size):
            pipe, child_end = context.Pipe()
            # each rank transforms its own shard's weights (quantization), so the workers get the transform too
            args = (config, max_model_len, rank, self.store.port, child_end, device, torch.get_num_threads(),
                    weight_transform)
            process = context.Process(target=run_worker, args=args, daemon=True)  # daemon: ends with us
            process.start()
            child_end.close()  # ours closed, so a worker's death reads as EOF here
            self.pipes.append(pipe)
            self.processes.append(process)

    def report(self, rank: int, wait: float = 0.0) -> str | None:
        """What worker `rank` says within `wait` seconds. That is "started", or "failed:" and its traceback.
        It is "died (exit code N)" if the worker is gone without a word. It is None while it runs silently."""
        pipe, process = self.pipes[rank - 1], self.processes[rank - 1]
        with contextlib.suppress(EOFError, OSError):  # its end of the pipe closed: it died
            if pipe.poll(wait):
                return pipe.recv()
        if process.is_alive():  # else its exit code is known: is_alive() reaped it
            return None
        if process.exitcode == 1:  # it failed before run_worker (which reports errors): as it importing the script
            return ('died (exit code 1) before it started; its error is printed above. A worker imports the main '
                    'script anew: one that starts tensor parallelism must guard it with `if __name__ == "__main__":`')
        return f"died (exit code {process.exitcode})"

    def wait_until_started(self) -> None:
        """Each worker says "started" just before joining the group. So one that fails or dies first is an
        error now. Rank 0 does not wait TIMEOUT for it in the group's rendezvous."""
        for rank in range(1, len(self.processes) + 1):
            while (message := self.report(rank, wait=0.1)) is None:
                pass
            if message != "started":
                raise RuntimeError(f"tensor-parallel worker {rank} failed to start: {message}")

    def send(self, batch: Batch) -> None:
        """Send the next step's `Batch` to every worker, as numpy arrays. They pickle in microseconds.
        Tensors would each go through a shared-memory file (milliseconds a step)."""
        if not self.processes:
            raise RuntimeError("the tensor-parallel workers are stopped (closed, or after an error): create a new LLM")
        values = vars(batch)  # the dataclass's fields by name
        tensors = {name: value.cpu().numpy() for name, value in values.items() if isinstance(value, torch.Tensor)}
        for pipe in self.pipes:
            pipe.send((tensors, {name: value for name, value in values.items() if name not in tensors}))

    def failure(self) -> RuntimeError | None:
        """After a step failed on rank 0: the error of the worker that failed or died, if one did."""
        for rank, process in enumerate(self.processes, start=1):
            process.join(timeout=1)  # a failing worker reports, then exits
            if (message := self.report(rank)) is not None:
                return RuntimeError(f"tensor-parallel worker {rank} {message}")
        return None

    def close(self) -> None:
        """Rank 0's end of tensor parallelism. Stop every worker, then leave the process group.
        A worker is asked with None instead of a Batch. After a little wait, it is terminated."""
        try:
            for pipe in self.pipes:
                with contextlib.suppress(OSError):  # that worker is gone already
                    pipe.send(None)
            for process in self.processes:
                process.join(timeout=2)  # one stuck in a collective never reads the pipe
                process.terminate()  # a no-op for one that ended
                process.join()
            self.pipes, self.processes, self.store = [], [], None  # the store's port is free once collected
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def run_worker(config: Config, max_model_len: int, rank: int, port: int, pipe: object,
               device: torch.device, num_threads: int, weight_transform: WeightTransform | None) -> None:
    """A worker's life: join the group, load its shard, then run every Batch rank 0 sends until None.
    Anything raised goes back to rank 0 over the pipe. The exit closes its sockets. That fails rank 0's
    collective at once."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is rank 0's to handle
    torch.set_num_threads(num_threads)
    try:
        store = dist.TCPStore("127.0.0.1", port, timeout=TIMEOUT)  # a client of rank 0's
        pipe.send("started")
        shard = Shard(rank, config.tensor_parallel_size)
        device = join_group(shard, store, device)
        # this process's one read of config.json (rank 0's is the engine's)
        runner = ModelRunner(config, device, max_model_len, read_checkpoint(config.model), shard,
                             Seams(weight_transform=weight_transform))
        dist.barrier()
        while (message := pipe.recv()) is not None:
            tensors, others = message  # the Batch's tensors as numpy arrays, and its other fields
            tensors = {name: torch.from_numpy(array).to(device) for name, array in tensors.items()}
            runner.run(Batch(**tensors, **others), [])  # rank 0 samples
    except EOFError:  # rank 0 is gone
        pass
    except BaseException:
        with contextlib.suppress(OSError):  # rank 0 is gone too
            pipe.send("failed:\n" + traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
