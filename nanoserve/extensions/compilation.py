"""The compiled step (`enforce_eager=False`): the model's whole step, embeddings to the final norm
(`LlamaModel.run_layers`), is one `torch.compile` graph (inductor), with freezing.

Attention enters the graph as one custom op per layer, which the graph calls as it is:
- the torch backend: `nanoserve::paged_attention` below. Its plan (attention.py: which requests attend
  together, their blocks and masks) is Python data built from the host's lengths, too slow to rebuild in
  each layer and a recompile whenever traced: it is built once per step, as eager builds it, and handed
  to the op as tensors (`plan_tensors`), which the op reads back (`read_plan`);
- triton: its own op (triton_backend.py), on the Batch's tensors;
- flash: its calls stay eager (`torch.compiler.disable`): the graph breaks around them, as vLLM splits
  its graph at attention.
Every op gets the whole KV cache and the layer's index (models/llama.py says why).

Invariants:
- Compiling happens in `compile_model`, at start-up, never while serving: the warm-up runs a step of
  N >= 2 tokens and one of N = 1 (torch specializes 0 and 1, so one row gets its own graph); shapes
  are dynamic in N, and every dim of the attention metadata and of `logits_indices` is unbacked (no size
  assumed, not even 0 or 1), so no later step recompiles for another count of requests, decode groups,
  blocks or prompt chunks (tests/test_compilation.py counts).
- On a CPU, freezing: the weights are the graph's constants, which inductor folds and lays out itself. The
  linears are eager's (layers/linear.py): `PackedLinear` calls its own op, which the graph calls as it is;
  plain nn.Linear weights (float32 at max_num_seqs=1) and int8's get inductor's C++ GEMM templates where
  they time faster (`inductor_options`).
- Anything that goes wrong while compiling or running the warm-up is one log line and an eager model;
  `LLM()` never fails because of compilation.

Inductor keeps its generated code in an on-disk cache (by default `/tmp/torchinductor_$USER`, or
`$TORCHINDUCTOR_CACHE_DIR`): a second start reuses the first's work. Delete that folder to clear it.

It enters the core at the step-executor seam (seams.py's `StepExecutor`), which the composition root
(composition.py's `CompiledSteps`) fills with `compile_model` and cuda_graphs.py's `capture_graphs`.
"""
from __future__ import annotations

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
    paged_attention,
    store_kvcache,
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
    """Compile the runner's whole step and run the warm-up that compiles it. True where the model now runs
    compiled; False, after one log line naming why, where it runs eager."""
    why = why_not_compile(runner.device, config.tensor_parallel_size)
    model = runner.model.model
    if why is None:
        try:
            model.run_layers = compile_layers(model)
            # no duck sizing: N must not be tied to a KV cache dim that happens to equal it in the warm-up
            with (torch.fx.experimental._config.patch(use_duck_shape=False),
                  torch._inductor.config.patch(inductor_options(runner.device))):
                warm_up(runner)
            return True
        except Exception as error:  # a missing C++ compiler, an op inductor cannot lower, ...
            why = describe(error)
            for name in ("prepare", "forward"):  # the backend's and the model's own again
                vars(model.attention).pop(name, None)
            vars(model).pop("run_layers", None)
    logging.getLogger(__name__).warning(f"enforce_eager=False, but the model runs eager: {why}")
    return False


def inductor_options(device: torch.device) -> dict[str, object]:
    """Inductor's settings while the warm-up traces and compiles on `device` (measured: docs/performance.md, "The
    compiled step"). On a CPU, freezing, and `max_autotune` over inductor's C++ GEMM templates and aten, which
    times the candidates of every matmul on a frozen weight, ~4 s each, and keeps the fastest: plain nn.Linear
    (float32 at max_num_seqs=1: a template at one row took ~0.3x MKL's time) and int8's `_weight_int8pack_mm`.
    Packed linears (layers/linear.py) are an op of our own, which it leaves alone. Set around the first call, not
    as `torch.compile(options=...)`: dynamo reads `freezing` as it traces, before those options apply, and would
    freeze nothing."""
    if device.type != "cpu":  # neither is tried on a GPU
        return {}
    return {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
            "autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False}


def compile_layers(model: torch.nn.Module) -> Callable:
    """`model.run_layers` (models/llama.py) compiled whole, and attention entering the graph
    as its backend's op. Every dim of its metadata's tensors and of `logits_indices` is marked unbacked as
    each step calls it."""
    backend = model.attention
    if isinstance(backend, TorchBackend):  # its plan goes in as tensors, to the op
        plan = backend.prepare
        backend.prepare = lambda batch, block_size, dtype: plan_tensors(plan(batch, block_size, dtype), dtype)
        backend.forward = lambda q, k, v, kv_cache, layer, tensors, window=None: torch.ops.nanoserve.paged_attention(
            q, k, v, kv_cache, layer, list(tensors), backend.scale, window)
    elif isinstance(backend, FlashBackend):  # eager, between the graph's pieces
        backend.forward = torch.compiler.disable(backend.forward)
    # a copy of run_layers' code object, this model's own: dynamo keeps at most 8 graphs per code object
    # (recompile_limit), and a process's fifth engine sharing the class's would silently run eager
    run = model.run_layers.__func__
    own = types.FunctionType(run.__code__.replace(), run.__globals__, run.__name__, run.__defaults__, run.__closure__)
    compiled = torch.compile(types.MethodType(own, model), dynamic=True)  # inductor_options apply as it compiles

    def run_layers(input_ids: Tensor, positions: Tensor, logits_indices: Tensor, kv_cache: Tensor,
                   metadata: AttentionMetadata) -> Tensor:
        tensors = metadata if isinstance(metadata, tuple) else vars(metadata).values()
        for tensor in [logits_indices, *tensors]:
            for dim in range(tensor.dim() if isinstance(tensor, Tensor) else 0):
                torch._dynamo.decorators.mark_unbacked(tensor, dim)
        return compiled(input_ids, positions, logits_indices, kv_cache, metadata)
    return run_layers


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
        batch = build_batch([(seq, num_new)], runner.block_size, runner.device)  # outside, as the engine's
        with torch.inference_mode():  # as ModelRunner.run
            runner.model(batch, kv_cache)


# ----------------------------------------------------------------------------- the torch backend as an op

def plan_tensors(plan: AttentionPlan, dtype: torch.dtype) -> tuple[Tensor, ...]:
    """The torch backend's plan as flat tensors only (a flat tensor has no stride for the graph to guard):
    on the host, each decode group's (rows, blocks) and each prompt chunk's (start, end, seqlen_k); then
    the groups' rows, block tables and biases, and the chunks' block tables, each group's or chunk's after
    the last one's. `read_plan` makes the plan again."""
    groups, chunks = plan.decode_groups, plan.prefill_requests

    def flat(parts: list[Tensor], dtype: torch.dtype = torch.int64) -> Tensor:
        return torch.cat([part.flatten().to(dtype) for part in parts] + [plan.slot_mapping.new_zeros(0, dtype=dtype)])
    sizes = [group.block_table.shape for group in groups]
    bounds = [(chunk.start, chunk.end, chunk.seqlen_k) for chunk in chunks]
    return (plan.slot_mapping, torch.tensor(sizes, dtype=torch.int64).flatten(),
            torch.tensor(bounds, dtype=torch.int64).flatten(), flat([group.rows for group in groups]),
            flat([group.block_table for group in groups]), flat([group.bias for group in groups], dtype),
            flat([chunk.block_table for chunk in chunks]))


def read_plan(slot_mapping: Tensor, sizes: Tensor, bounds: Tensor, rows: Tensor, tables: Tensor, bias: Tensor,
              chunk_tables: Tensor, block_size: int) -> AttentionPlan:
    """`plan_tensors`' tensors -> the plan they were made from. Run in every layer's op: views of the
    tensors (splits), and one causal mask per prompt chunk whose keys outnumber its queries."""
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


@torch.library.custom_op("nanoserve::paged_attention", mutates_args=("kv_cache",))
def paged_attention_op(q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor, layer: int, tensors: list[Tensor],
                       scale: float, window: int | None) -> Tensor:
    """The torch backend's attention for layer `layer` (attention.py), with its sliding window if any, as
    one op: q `[N, H, D]`, k, v `[N, Hkv, D]` -> `[N, H, D]`, its plan read back from `plan_tensors`'
    `tensors`. They are one list argument, not seven: each call of an op that mutates costs torch
    ~(arguments)^2 small objects (the version bump's fill_defaults), ~50 us at 13 arguments, 30 times a step."""
    k_cache, v_cache = kv_cache[:, layer]  # views taken inside the op: it declares the whole cache mutated
    plan = read_plan(*tensors, k_cache.shape[1])
    store_kvcache(k, v, k_cache, v_cache, plan.slot_mapping)
    return paged_attention(q, k_cache, v_cache, plan, scale, window).contiguous()


@paged_attention_op.register_fake
def _(q: Tensor, *rest: Tensor | int | float) -> Tensor:
    """The output's shape for tracing: q's, laid out contiguously."""
    return q.new_empty(q.shape)
