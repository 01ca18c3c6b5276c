"""The seams: where extensions plug into the core, one small interface each (docs/architecture.md draws them).

The core is the walkthrough's code: engine, scheduler, batch, model_runner, models, ...
It runs with every seam at its default (`Seams()`). That means eager steps, no logits processing, no drafts,
no grammars, one process, and float weights. The composition root (composition.py) fills the seams with the
extensions a config asks for. Nothing else names an extension. Each seam says when the core calls it and
what it may change:
- `StepExecutor`: how steps run the model (extensions/compilation.py, extensions/cuda_graphs.py);
- `LogitsProcessor`: the sampling rows' logits, before the sampler (extensions/logits_processors.py);
- `WeightTransform`: the model's linears, once loaded (extensions/quantization.py);
- `GrammarCompiler`, with sequence.py's `Grammar` and the WAITING_FOR_GRAMMAR status that the scheduler skips:
  structured outputs (extensions/structured_outputs.py);
- scheduler.py's `Drafter`: draft tokens for the decodes (extensions/spec_decode.py). It lives beside the
  scheduler, whose plan its methods take;
- `Seams.tensor_parallel`: rank 0's runner when the model is split over processes (extensions/parallel.py).
"""

from collections.abc import Collection
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from nanoserve.batch import Batch
from nanoserve.sampling_params import GrammarSpec
from nanoserve.scheduler import Drafter
from nanoserve.sequence import Grammar, Sequence


class Runner(Protocol):
    """What a step executor reads of model_runner.py's ModelRunner."""
    model: nn.Module           # the model: called as model(batch, kv_cache) -> logits
    device: torch.device
    backend: str               # the attention backend's name ("flash", "sdpa", ...)
    block_size: int
    kv_cache: torch.Tensor

    def allocate_kv_cache(self, num_blocks: int) -> torch.Tensor: ...


class DecodeRunner(Protocol):
    """A decode-only step's logits `[S, vocab]`, as the model computes them (cuda_graphs.py's DecodeGraphs)."""

    def replay(self, batch: Batch) -> torch.Tensor: ...


class StepExecutor(Protocol):
    """How steps run the model, other than eager (enforce_eager=False).
    - `ModelRunner.__init__` calls `compile` once the model is loaded, before the KV cache is sized.
      It may compile the model's layers in place. It returns whether the model now runs compiled.
    - It calls `capture` once the KV cache is allocated. That returns what runs the decode-only steps in
      the model's place (CUDA graphs over the model), or None. It is `(batch) -> logits`, the logits as
      `model(batch, kv_cache)` returns them.
    Neither changes anything but the model it is given."""

    def compile(self, runner: Runner) -> bool: ...

    def capture(self, runner: Runner, max_model_len: int) -> DecodeRunner | None: ...


class LogitsProcessor(Protocol):
    """Penalties, logit_bias, min_tokens and grammar masks (logits_processors.py's `process_logits`).

    `ModelRunner.run` calls it once per step, in one place, before the sampler. It gets the rows that sample
    (`[S, vocab]`, row i for `seqs[i]`) and the EOS ids (min_tokens bans them). It returns the logits to
    sample from. It may set `seq.error` to fail one request alone. It changes nothing else."""

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: set[int]) -> torch.Tensor: ...


class WeightTransform(Protocol):
    """Int8 quantization (quantization.py).

    `models.loader.load_model` calls it once, with the loaded model (this rank's shard). It returns the model
    to serve, with its linears replaced. It changes nothing else. Without one, the loader lays the linears out
    for this device (layers/linear.py)."""

    def __call__(self, model: nn.Module) -> nn.Module: ...


class GrammarCompiler(Protocol):
    """Structured outputs (structured_outputs.py's GrammarCompiler).
    - `LLMEngine.add_request` calls `compile` for a request with `structured_outputs`. It returns the
      request's Grammar (sequence.py), compiling in the background. The request waits as
      WAITING_FOR_GRAMMAR. The scheduler passes over it until `Grammar.ready`.
    - `LLMEngine.step` calls `poll` with the waiting requests, after the scheduler planned. It ends each whose
      grammar failed to compile, by `fail`. When `idle` (nothing was scheduled), it may wait a moment for a
      compile.
    It changes nothing else."""

    def compile(self, spec: GrammarSpec) -> Grammar: ...

    def poll(self, waiting: Collection[Sequence], idle: bool,
             fail: Callable[[Sequence, Exception], object]) -> None: ...


class EagerSteps:
    """The core's own step executor: the model as loaded, run eager (enforce_eager=True)."""

    def compile(self, runner: Runner) -> bool:
        return False

    def capture(self, runner: Runner, max_model_len: int) -> DecodeRunner | None:
        return None


def no_logits_processing(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: set[int]) -> torch.Tensor:
    """The core's own logits processor: the logits as the model gave them."""
    return logits


@dataclass(frozen=True)
class Seams:
    """What plugs into the core. The composition root (composition.py) builds it from a config.
    The defaults are the core's own way. Without grammars (and the logits processors that come with them),
    the requests that would need them are refused."""
    executor: StepExecutor = EagerSteps()
    logits_processor: LogitsProcessor = no_logits_processing
    weight_transform: WeightTransform | None = None
    drafter: Drafter | None = None
    # (tokenizer, vocab_size, EOS ids) -> the engine's grammar compiler, built once per engine
    grammars: Callable[[PreTrainedTokenizerBase | None, int, set[int]], GrammarCompiler] | None = None
    tensor_parallel: type | None = None  # a ModelRunner subclass: rank 0's with tensor_parallel_size > 1
