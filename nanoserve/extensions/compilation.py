"""The compiled step (`enforce_eager=False`). The model's whole step, embeddings to the final norm
(`LlamaModel.run_layers`), is one `torch.compile` graph (inductor), with freezing.

Attention enters the graph as one custom op per layer, which the graph calls as it is.
Each backend gets there its own way:
- torch: `nanoserve::paged_attention` below (`paged_attention_op`).
- triton: its own op (triton_backend.py), on the Batch's tensors.
- flash: its calls stay eager (`torch.compiler.disable`). The graph breaks around them, as vLLM splits
  its graph at attention.
Every op gets the whole KV cache and the layer's index (models/llama.py says why).

Almost every line here works around torch.compile. The workarounds, and why each exists:
- `flatten_plan` and `unflatten_plan`: the torch backend's plan goes into the op as flat tensors.
  The plan (attention.py) is Python data built from the host's lengths. Rebuilding it in each layer is
  too slow, and tracing it would recompile. So it is built once per step, as eager builds it.
  Flat tensors have no strides for the graph to guard.
- `paged_attention_op` takes the plan's tensors as one list argument, not seven. Each call of an op
  that mutates costs torch small objects quadratic in its arguments.
- `mark_unbacked`: every dim of the attention metadata and of `logits_indices` is unbacked.
  No size is assumed, not even 0 or 1. So no step recompiles for another count of requests, decode
  groups, blocks or prompt chunks (tests/test_compilation.py counts).
- `compile_model` turns off duck sizing. Otherwise N could be tied to a KV cache dim that happens to
  equal it in the warm-up.
- `copy_code`: each model compiles its own copy of `run_layers`' code object. Dynamo keeps at most
  8 graphs per code object, so a process's fifth engine would silently run eager.
- `warm_up` runs a step of N >= 2 tokens and one of N = 1 at start-up. Torch specializes 0 and 1, so one
  row gets its own graph. Shapes are dynamic in N, so nothing compiles later, while serving.
  Its KV cache is made outside inference mode, as the real one is, because torch guards on it.
- `freeze_and_autotune_options` are set around the warm-up, not passed to `torch.compile`. Dynamo reads
  `freezing` as it traces, before such options apply, and would freeze nothing.
- `compile_model` falls back to eager. Anything that fails while compiling or warming up is one log
  line, so `LLM()` never fails because of compilation.

On a CPU, freezing makes the weights the graph's constants, which inductor folds and lays out itself.
The linears keep eager's layouts (layers/linear.py). `PackedLinear` calls its own op, which the graph
calls as it is. Plain nn.Linear weights (float32 at max_num_seqs=1) and int8's get inductor's C++ GEMM
templates where they time faster (`freeze_and_autotune_options`).

Inductor keeps its generated code in an on-disk cache, so a second start reuses the first's work.
The cache is `/tmp/torchinductor_$USER` by default, or `$TORCHINDUCTOR_CACHE_DIR`. Delete it to clear it.

It enters the core at the step-executor seam (seams.py's `StepExecutor`). The composition root
(composition.py's `CompiledSteps`) fills that seam with `compile_model` and cuda_graphs.py's `capture_graphs`.
"""

import logging
import types
from collections.abc import Callable

import torch
from torch import Tensor

from nanoserve.attention import (
    AttentionMetadata,
    AttentionPlan,
    DecodeGroup,
    FlashBackend,
    PrefillRequest,
    TorchBackend,
    causal_mask,
)
from nanoserve.batch import build_batch
from nanoserve.config import Config, cdiv
from nanoserve.sampler import SamplingParams
from nanoserve.seams import Runner
from nanoserve.sequence import Sequence


def why_not_compile(device: torch.device, tensor_parallel_size: int) -> str | None:
    """Why the step cannot be compiled here, or None where it can be tried."""
    if device.type not in ("cpu", "cuda"):
        return f"torch.compile is not supported here on {device.type}"
    return "the compiled step does not cover tensor parallelism" if tensor_parallel_size > 1 else None


def compile_model(runner: Runner, config: Config) -> bool:
    """Compile the runner's whole step, and run the warm-up that compiles it.

    Returns True where the model now runs compiled. Returns False where it runs eager, after one log line
    naming why."""
    why = why_not_compile(runner.device, config.tensor_parallel_size)
    model = runner.model.model
    if why is None:
        try:
            model.run_layers = compile_layers(model)
            # no duck sizing: N must not be tied to a KV cache dim that happens to equal it in the warm-up
            with (torch.fx.experimental._config.patch(use_duck_shape=False),
                  torch._inductor.config.patch(freeze_and_autotune_options(runner.device))):
                warm_up(runner)
            return True
        except Exception as error:  # a missing C++ compiler, an op inductor cannot lower, ...
            why = summarize_error(error)
            for name in ("prepare", "forward"):  # the backend's and the model's own again
                vars(model.attention).pop(name, None)
            vars(model).pop("run_layers", None)
    logging.getLogger(__name__).warning(f"enforce_eager=False, but the model runs eager: {why}")
    return False


def freeze_and_autotune_options(device: torch.device) -> dict[str, object]:
    """Inductor's settings while the warm-up traces and compiles on `device`.

    On a GPU there are none. On a CPU they turn on freezing, and `max_autotune` over inductor's C++ GEMM
    templates and aten. Autotuning times the candidates of every matmul on a frozen weight, ~4 s each,
    and keeps the fastest. That helps plain nn.Linear (float32 at max_num_seqs=1, where a template at one
    row took ~0.3x MKL's time) and int8's `_weight_int8pack_mm`. Packed linears (layers/linear.py) are an
    op of our own, which it leaves alone. docs/performance.md, "The compiled step", has the measurements.

    They are set around the first call, not as `torch.compile(options=...)`. Dynamo reads `freezing` as
    it traces, before those options apply, and would freeze nothing."""
    if device.type != "cpu":  # neither is tried on a GPU
        return {}
    return {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
            "autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}


def compile_layers(model: torch.nn.Module) -> Callable:
    """`model.run_layers` (models/llama.py) compiled whole, with attention entering the graph as its
    backend's op. Each step's call marks its attention metadata and `logits_indices` unbacked."""
    attention_as_op(model.attention)
    compiled = torch.compile(copy_code(model.run_layers), dynamic=True)  # the options apply as it compiles

    def run_layers(input_ids: Tensor, positions: Tensor, logits_indices: Tensor, kv_cache: Tensor,
                   metadata: AttentionMetadata) -> Tensor:
        tensors = metadata if isinstance(metadata, tuple) else vars(metadata).values()
        mark_unbacked([logits_indices, *tensors])
        return compiled(input_ids, positions, logits_indices, kv_cache, metadata)
    return run_layers


def attention_as_op(backend: object) -> None:
    """Make the backend's attention something the graph can hold.

    The torch backend's plan goes in as flat tensors, to `paged_attention_op`. Flash stays eager, between
    the graph's pieces. Triton needs nothing: it is an op already."""
    if isinstance(backend, TorchBackend):
        plan = backend.prepare
        backend.prepare = lambda batch, block_size, dtype: flatten_plan(plan(batch, block_size, dtype), dtype)
        backend.forward = lambda q, k, v, kv_cache, layer, tensors, window: torch.ops.nanoserve.paged_attention(
            q, k, v, kv_cache, layer, tensors, backend.scale, backend.softcap, window)
    elif isinstance(backend, FlashBackend):
        backend.forward = torch.compiler.disable(backend.forward)


def copy_code(method: types.MethodType) -> types.MethodType:
    """The method bound to a copy of its code object, this model's own.

    Dynamo keeps at most 8 graphs per code object (recompile_limit). Sharing the class's code, a process's
    fifth engine would silently run eager."""
    run = method.__func__
    own = types.FunctionType(run.__code__.replace(), run.__globals__, run.__name__, run.__defaults__, run.__closure__)
    return types.MethodType(own, method.__self__)


def mark_unbacked(tensors: list[object]) -> None:
    """Mark every dim of every tensor unbacked, so the graph assumes no size, not even 0 or 1.
    Non-tensors (the metadata's ints) are skipped."""
    for tensor in tensors:
        for dim in range(tensor.dim() if isinstance(tensor, Tensor) else 0):
            torch._dynamo.decorators.mark_unbacked(tensor, dim)


def summarize_error(error: Exception) -> str:
    """An error as one log line's reason: its type and the first line of its message."""
    return f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"


def warm_up(runner: Runner) -> None:
    """Two steps on a throwaway KV cache: a 2-token prompt, then 1 token.

    Those are the two shapes torch compiles for (N >= 2, and N = 1). They are small on purpose: with
    dynamic shapes a larger N would compile the same."""
    seq = Sequence("warm-up", None, [0, 0], SamplingParams())
    seq.block_table = [1, 2]  # two tokens fit even in blocks of one (block 0 is the null block)
    kv_cache = runner.allocate_kv_cache(3)  # made as the real one is, outside inference mode: torch guards on it
    for num_new in (2, 1):
        batch = build_batch([(seq, num_new)], runner.block_size, runner.device)  # outside, as the engine's
        with torch.inference_mode():  # as ModelRunner.run
            runner.model(batch, kv_cache)


# ----------------------------------------------------------------------------- the torch backend as an op

def flatten_plan(plan: AttentionPlan, dtype: torch.dtype) -> tuple[Tensor, ...]:
    """The torch backend's plan as flat tensors only. A flat tensor has no stride for the graph to guard.

    The tensors, in order:
    - slot_mapping.
    - On the host, each decode group's (rows, blocks), then each prompt chunk's (start, end, seqlen_k).
    - The groups' rows, then their block tables, then their biases.
    - The chunks' block tables.
    Each holds its groups or chunks one after another. `unflatten_plan` makes the plan again."""
    groups, chunks = plan.decode_groups, plan.prefill_requests

    def flat(items: list[object], field: str, dtype: torch.dtype = torch.int64) -> Tensor:
        """Each item's tensor `field`, flattened and one after another."""
        parts = [getattr(item, field).flatten().to(dtype) for item in items]
        return torch.cat(parts + [plan.slot_mapping.new_zeros(0, dtype=dtype)])
    sizes = [group.block_table.shape for group in groups]
    bounds = [(chunk.start, chunk.end, chunk.seqlen_k) for chunk in chunks]
    return (plan.slot_mapping, torch.tensor(sizes, dtype=torch.int64).flatten(),
            torch.tensor(bounds, dtype=torch.int64).flatten(), flat(groups, "rows"), flat(groups, "block_table"),
            flat(groups, "bias", dtype), flat(chunks, "block_table"))


def unflatten_plan(slot_mapping: Tensor, sizes: Tensor, bounds: Tensor, rows: Tensor, tables: Tensor, bias: Tensor,
              chunk_tables: Tensor, block_size: int) -> AttentionPlan:
    """`flatten_plan`'s tensors -> the plan they were made from. It runs in every layer's op, so it stays
    cheap: views of the tensors (splits), and one causal mask per prompt chunk whose keys outnumber its
    queries."""
    sizes, bounds = sizes.view(-1, 2).tolist(), bounds.view(-1, 3).tolist()
    parts = zip(sizes, rows.split([r for r, _ in sizes]), tables.split([r * b for r, b in sizes]),
                bias.split([r * b * block_size for r, b in sizes]))
    groups = [DecodeGroup(group_rows, table.view(r, b), group_bias.view(r, 1, 1, -1))  # bias [R, 1, 1, keys]
              for (r, b), group_rows, table, group_bias in parts]
    chunk_tables = chunk_tables.split([cdiv(seqlen_k, block_size) for _, _, seqlen_k in bounds])
    chunks = [PrefillRequest(start, end, table[None], seqlen_k,
                             None if end - start == seqlen_k else causal_mask(end - start, seqlen_k, table.device))
              for (start, end, seqlen_k), table in zip(bounds, chunk_tables)]
    return AttentionPlan(slot_mapping, groups, chunks)


# Defined through torch.library, not @custom_op: its Python wrapper cost ~60 us more a call (30 calls a step).
# The schema declares the KV cache mutated, `(a!)`, and nothing else.
LIBRARY = torch.library.Library("nanoserve", "FRAGMENT")
LIBRARY.define("paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kv_cache, int layer, Tensor[] tensors, "
               "float scale, float softcap, int? window) -> Tensor")


@torch.library.impl(LIBRARY, "paged_attention", "CompositeExplicitAutograd")
def paged_attention_op(q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor, layer: int, tensors: list[Tensor],
                       scale: float, softcap: float, window: int | None) -> Tensor:
    """The torch backend's attention for layer `layer` (attention.py), as one op. `window` is the layer's
    sliding window, or None.

    q `[N, H, D]`, k, v `[N, Hkv, D]` -> `[N, H, D]`. Its plan is read back from `flatten_plan`'s `tensors`.
    They are one list argument, not seven. Each call of a mutating @custom_op cost torch ~(arguments)^2
    small objects (the version bump's fill_defaults). That was ~50 us at 13 arguments, 30 times a step."""
    # kv_cache [2, layers, blocks, block_size, Hkv, D]. The backend takes the layer's views inside the op,
    # which declares the whole cache mutated.
    plan = unflatten_plan(*tensors, kv_cache.shape[3])
    return TorchBackend(scale, softcap).forward(q, k, v, kv_cache, layer, plan, window).contiguous()


@torch.library.register_fake("nanoserve::paged_attention")
def _(q: Tensor, *rest: Tensor | int | float) -> Tensor:
    """The output's shape for tracing: q's, laid out contiguously."""
    return q.new_empty(q.shape)
