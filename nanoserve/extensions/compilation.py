"""The compiled step (`enforce_eager=False`): each decoder layer's dense work runs through
`torch.compile` (inductor), the attention backend between the pieces stays eager.

Why piecewise, as vLLM splits its graph at attention: the torch backend's plan (attention.py) is
data-dependent, a Python list of decode groups and prompt chunks that changes in number and size
every step; traced into a graph, every new plan would be a recompile. Around it, a layer is the
same few ops for any N tokens: norms, matmuls, RoPE, SwiGLU, residual adds, which inductor fuses.

Invariants:
- Compiling happens in `compile_model`, at start-up, never while serving: the warm-up runs a step of
  N >= 2 tokens and one of N = 1 (torch specializes 0 and 1, so one row gets its own graph); shapes
  are dynamic in N, so no later step recompiles (tests/test_compilation.py counts).
- The layers share their graphs: the weights are the graphs' inputs, so 30 layers compile as one.
- The linears are laid out as eager's (layers/linear.py): `PackedLinear` calls its own op, which the
  graphs call as it is, so compiling keeps oneDNN's packed weights and fuses the work around them.
- Anything that goes wrong while compiling or running the warm-up is one log line and an eager model;
  `LLM()` never fails because of compilation.

Inductor keeps its generated code in an on-disk cache (by default `/tmp/torchinductor_$USER`, or
`$TORCHINDUCTOR_CACHE_DIR`): a second start reuses the first's work. Delete that folder to clear it.

It enters the core at the step-executor seam (seams.py's `StepExecutor`), which the composition root
(composition.py's `CompiledSteps`) fills with `compile_model` and cuda_graphs.py's `capture_graphs`.
"""
from __future__ import annotations

import logging

import torch

from nanoserve.batch import build_batch
from nanoserve.config import Config
from nanoserve.sampler import SamplingParams
from nanoserve.seams import Runner
from nanoserve.sequence import Sequence


def why_not_compile(device: torch.device, tensor_parallel_size: int) -> str | None:
    """Why the step cannot be compiled here, or None where it can be tried."""
    if device.type not in ("cpu", "cuda"):
        return f"torch.compile is not supported here on {device.type}"
    return "the compiled step does not cover tensor parallelism" if tensor_parallel_size > 1 else None


def compile_model(runner: Runner, config: Config) -> bool:
    """Compile the runner's decoder layers and run the warm-up that compiles them. True where the model
    now runs compiled; False, after one log line naming why, where it runs eager."""
    why = why_not_compile(runner.device, config.tensor_parallel_size)
    backend, layers = runner.model.model.attention, runner.model.model.layers
    if why is None:
        attention = backend.forward
        # contiguous: one output layout whichever path attention took, so the next piece's guards hold
        backend.forward = torch.compiler.disable(lambda *args: attention(*args).contiguous())
        try:
            for layer in layers:
                layer.compile(dynamic=True)
            # no duck sizing: N must not be tied to a KV cache dim that happens to equal it in the warm-up
            with torch.fx.experimental._config.patch(use_duck_shape=False):
                warm_up(runner)
            return True
        except Exception as error:  # a missing C++ compiler, an op inductor cannot lower, ...
            why = describe(error)
            del backend.forward  # the class's own again
            for layer in layers:
                layer._compiled_call_impl = None  # nn.Module.compile's undo
    logging.getLogger(__name__).warning(f"enforce_eager=False, but the model runs eager: {why}")
    return False


def describe(error: Exception) -> str:
    """An error as one log line's reason: its type and the first line of its message."""
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"


def warm_up(runner: Runner) -> None:
    """Two steps on a throwaway KV cache: a 2-token prompt, then 1 token, the two shapes torch compiles
    for (N >= 2, and N = 1). Small on purpose: with dynamic shapes a larger N would compile the same."""
    seq = Sequence("warm-up", None, [0, 0], SamplingParams())
    seq.block_table = [1, 2]  # two tokens fit even in blocks of one (block 0 is the null block)
    kv_cache = runner.allocate_kv_cache(3)  # made as the real one is, outside inference mode: torch guards on it
    for num_new in (2, 1):
        with torch.inference_mode():  # as ModelRunner.run
            runner.model(build_batch([(seq, num_new)], runner.block_size, runner.device), kv_cache)
