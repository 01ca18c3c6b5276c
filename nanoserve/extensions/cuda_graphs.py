"""CUDA graphs for decode steps. They run on CUDA, with the flash or triton backend and `enforce_eager=False`.
A step in which every request brings one token replays a graph captured at start-up. It does not launch
the model's kernels one by one from Python.

Why: a decode step of a small batch is hundreds of small kernels (a few per op, ~25 ops per layer).
At batch 1 the GPU finishes each before the host has launched the next. A CUDA graph records one step's
launches once, and one replay launches them all. A graph needs every input at the address it was
captured with, in the same shape. So, as nano-vllm and vLLM do:
- At start-up one graph is captured per batch size: 1, 2, 4, 8, then every 16 up to max_num_seqs.
  Each is over a static `Batch` of that many rows. The largest is captured first, and the others share
  its memory pool.
- A decode step of B requests copies its arrays into the first B rows. It replays the smallest graph
  of at least B rows.
- Rows past B are padding: token 0 at position 0. Its k and v are written to slot 0, which it then reads
  as its one key. Slot 0 is in the null block (attention.py). The flash-attn and triton kernels read a
  request's keys through its own block table. That table never names block 0 among its first seq_lens
  keys, so padding is harmless.
- A graph ends at the model's final norm (`[rows, hidden]`). The lm_head runs after the replay, on the rows
  `logits_indices` names, as in the eager model. The logits of every padded row, kept for every graph,
  would take far more memory.
- Prompts, mixed steps and steps with draft tokens (spec_decode.py) run the model as they are.
Graphs need the flash or triton backend, whose inputs are the Batch's tensors. (The triton kernel's grid
depends only on their shapes.) The torch backend's per-step plan is Python data (attention.py), which a
graph would freeze. Graphs do not work with tensor parallelism either.
"""

import functools
import logging
from typing import Callable

import torch
from torch import Tensor

from nanoserve.batch import Batch, build_batch
from nanoserve.config import Config, cdiv
from nanoserve.extensions.compilation import summarize_error
from nanoserve.layers.softcap import softcap
from nanoserve.sampler import SamplingParams
from nanoserve.seams import Runner
from nanoserve.sequence import Sequence


def capture(run: Callable[[], Tensor], pool: tuple | None) -> tuple[Callable[[], Tensor], tuple]:
    """Record `run`'s kernels as a CUDA graph. Returns two things:
    - a replay, which launches them again and returns `run`'s output tensor, now holding the new result;
    - the graph's memory pool, for the next capture to share."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = run()
    return lambda: (graph.replay(), out)[1], graph.pool()


class DecodeGraphs:
    """One captured decode step per batch size, each over a static `Batch` of that many rows."""

    @torch.inference_mode()  # as ModelRunner.run: the compiled layers' guards see the same mode
    def __init__(self, model: torch.nn.Module, kv_cache: Tensor, max_rows: int, max_blocks: int) -> None:
        self.model, self.graphs, pool = model, {}, None
        self.sizes = sorted({*(s for s in (1, 2, 4, 8) if s < max_rows), *range(16, max_rows, 16), max_rows})
        padding = Sequence("padding", None, [0], SamplingParams())  # token 0 at position 0 ...
        padding.block_table = [0] * max_blocks  # ... in slot 0 of the null block; tables this wide
        for size in reversed(self.sizes):
            static = build_batch([(padding, 1)] * size, kv_cache.shape[3], kv_cache.device)  # [size] rows
            run = functools.partial(model.model, static, kv_cache)  # -> [size, hidden]
            run()  # once outside the graph: lazy initialisations and compiling happen here, not in it
            replay, pool = capture(run, pool)
            self.graphs[size] = static, replay

    def replay(self, batch: Batch) -> Tensor:
        """Logits `[S + P, vocab]` float32 of a decode-only `batch`, as `model(batch, kv_cache)` returns them."""
        n = len(batch.seq_lens)
        static, replay = self.graphs[next(size for size in self.sizes if size >= n)]
        for name, pad in (("input_ids", 0), ("positions", 0), ("slot_mapping", 0), ("seq_lens", 1)):
            rows = getattr(static, name)  # [size]
            rows[:n] = getattr(batch, name)
            rows[n:] = pad  # an earlier step with more requests left them here
        static.block_tables.zero_()
        static.block_tables[:n, :batch.block_tables.shape[1]] = batch.block_tables
        # the replay returns every row's final hidden state, [size, hidden]; lm_head takes the rows that sample
        logits = self.model.lm_head(replay()[batch.logits_indices]).float()
        # Gemma 2 caps its logits, as the model's forward does (None: not capped)
        return softcap(logits, self.model.final_logit_softcapping)


def capture_graphs(runner: Runner, config: Config, max_model_len: int) -> DecodeGraphs | None:
    """The runner's decode graphs where enforce_eager=False on CUDA; None elsewhere.
    Where they cannot be captured here, it is also None, after one log line naming why. Decode steps
    then run without graphs."""
    if config.enforce_eager or runner.device.type != "cuda":
        return None
    why = ("they need the flash or triton attention backend" if runner.backend not in ("flash", "triton") else
           "not with tensor parallelism" if config.tensor_parallel_size > 1 else None)
    if why is None:
        try:
            return DecodeGraphs(runner.model, runner.kv_cache, config.max_num_seqs,
                                cdiv(max_model_len, runner.block_size))
        except Exception as error:  # an op that cannot be captured, out of memory, ...
            why = summarize_error(error)
    logging.getLogger(__name__).warning(f"enforce_eager=False, but decode steps run without CUDA graphs: {why}")
    return None
