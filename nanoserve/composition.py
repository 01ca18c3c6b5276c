"""The composition root: the one place that names every extension. It builds an engine with those its config
asks for. The core (engine.py and what it uses) runs alone, with every seam at its default (seams.py).
Each extension enters at one seam (docs/architecture.md):
- the step executor: extensions/compilation.py and, on CUDA, extensions/cuda_graphs.py (enforce_eager=False);
- the logits processor: extensions/logits_processors.py (penalties, logit_bias, min_tokens, grammar masks);
- the grammar compiler: extensions/structured_outputs.py;
- the drafter: extensions/spec_decode.py's n-gram drafter (speculative_config);
- the weight transform: extensions/quantization.py (quantization="int8");
- the tensor-parallel runner: extensions/parallel.py (tensor_parallel_size > 1).
Every front end (LLM, AsyncLLM, the CLI, the HTTP server) builds its engine here. It calls
`build_engine(config)`, or `nanoserve.LLMEngine(config)`, which is the same.
"""

from dataclasses import dataclass
from functools import partial

import nanoserve.engine
from nanoserve.config import Config, SpeculativeConfig

# Each extension is optional: one that cannot be imported leaves its seam empty, and the core runs without it.
try:
    from nanoserve.extensions.compilation import compile_model
    from nanoserve.extensions.cuda_graphs import capture_graphs
except ImportError:
    compile_model = capture_graphs = None
try:  # logits_processors imports structured_outputs
    from nanoserve.extensions.logits_processors import process_logits
    from nanoserve.extensions.structured_outputs import GrammarCompiler
except ImportError:
    process_logits = GrammarCompiler = None
try:
    from nanoserve.extensions.parallel import TensorParallelRunner
except ImportError:
    TensorParallelRunner = None
try:
    from nanoserve.extensions.quantization import quantize_linears
except ImportError:
    quantize_linears = None
try:
    from nanoserve.extensions.spec_decode import Speculator
except ImportError:
    Speculator = None
from nanoserve.seams import DecodeRunner, EagerSteps, Runner, Seams, no_logits_processing


@dataclass(frozen=True)
class CompiledSteps:
    """The step executor for enforce_eager=False. The model's layers are compiled (compilation.py).
    On CUDA with the flash backend, decode steps replay CUDA graphs (cuda_graphs.py).
    Each falls back alone, logged."""
    config: Config

    def compile(self, runner: Runner) -> bool:
        return compile_model(runner, self.config)

    def capture(self, runner: Runner, max_model_len: int) -> DecodeRunner | None:
        return capture_graphs(runner, self.config, max_model_len)


def build_seams(config: Config) -> Seams:
    """The seams filled with the extensions `config` asks for. The logits processors and grammars are always
    there, as any request may ask for them. One asked for but not importable is a ValueError naming it."""
    spec, quantization = config.speculative_config, config.quantization
    asked = {"compilation": not config.enforce_eager and compile_model, "spec_decode": spec is not None and Speculator,
             "quantization": quantization is not None and quantize_linears,
             "parallel": config.tensor_parallel_size > 1 and TensorParallelRunner}
    if missing := [name for name, loaded in asked.items() if loaded is None]:  # asked for, not importable
        raise ValueError(f"the config asks for nanoserve.extensions.{missing[0]}, which cannot be imported")
    return Seams(executor=EagerSteps() if config.enforce_eager else CompiledSteps(config),
                 logits_processor=process_logits or no_logits_processing,
                 # int4's group_size comes from quantization_config (Config checked its keys), else its default
                 weight_transform=partial(quantize_linears, quantization=quantization,
                                          **(config.quantization_config or {})) if quantization else None,
                 drafter=Speculator(SpeculativeConfig.from_dict(spec)) if spec else None,
                 grammars=GrammarCompiler,
                 tensor_parallel=TensorParallelRunner)


class LLMEngine(nanoserve.engine.LLMEngine):
    """The engine with every extension its config asks for. It is the core's (engine.py), with its seams
    filled by `build_seams`. `nanoserve.LLMEngine(config)` and every front end build it."""

    def __init__(self, config: Config) -> None:
        super().__init__(config, build_seams(config))


# The engine a front end serves a config with: build_engine(config) is LLMEngine(config), the class itself.
build_engine = LLMEngine
