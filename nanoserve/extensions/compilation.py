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
- Freezing: the weights are the graph's constants, which inductor folds and lays out itself. The linears
  are eager's (layers/linear.py): `PackedLinear` calls its own op, which the graph calls as it is.
- Anything that goes wrong while compiling or running the warm-up is one log line and an eager model;
  `LLM()` never fails because of compilation.

Inductor keeps its generated code in an on-disk cache (by default `/tmp/torchinductor_$USER`, or
`$TORCHINDUCTOR_CACHE_DIR`): a second start reuses the first's work. Delete that folder to clear it.

It enters the core at the step-executor seam (seams.py's `StepExecutor`), which the composition root
(composition.py's `CompiledSteps`) fills with `compile_model` and cuda_graphs.py's `capture_graphs`.
"""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
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
            with torch.fx.experimental._config.patch(use_duck_shape=False):
                warm_up(runner)
            return True
        except Exception as error:  # a missing C++ compiler, an op inductor cannot lower, ...
            why = describe(error)
            for name in ("prepare", "forward"):  # the backend's and the model's own again
                vars(model.attention).pop(name, None)
            vars(model).pop("run_layers", None)
    logging.getLogger(__name__).warning(f"enforce_eager=False, but the model runs eager: {why}")
    return False


def compile_layers(model: torch.nn.Module) -> Callable:
    """`model.run_layers` (models/llama.py) compiled whole, with freezing, and attention entering the graph
    as its backend's op. Every dim of its metadata's tensors and of `logits_indices` is marked unbacked as
    each step calls it."""
    backend = model.attention
    if isinstance(backend, TorchBackend):  # its plan goes in as tensors, to the op
        plan = backend.prepare
        backend.prepare = lambda batch, block_size, dtype: plan_tensors(plan(batch, block_size, dtype), dtype)
        backend.forward = lambda q, k, v, kv_cache, layer, tensors: torch.ops.nanoserve.paged_attention(
            q, k, v, kv_cache, layer, *tensors, backend.scale)
    elif isinstance(backend, FlashBackend):  # eager, between the graph's pieces
        backend.forward = torch.compiler.disable(backend.forward)
    compiled = torch.compile(model.run_layers, dynamic=True, options={"freezing": True})

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
    """The torch backend's plan as tensors only, each flat (`[n]`, so that no stride of a size the graph
    does not know is guarded): the decode groups' rows `[R]`, block tables `[R, blocks]` and biases
    `[R, keys]`, one group after another, each padded to the widest; each group's (rows, blocks) `[G, 2]`
    and each prompt chunk's (start, end, seqlen_k) `[P, 3]`, on the host; the chunks' block tables
    `[P, blocks]`. `read_plan` makes the plan again."""
    groups, chunks = plan.decode_groups, plan.prefill_requests
    no_rows = torch.zeros(0, dtype=torch.int64, device=plan.slot_mapping.device)  # a step without any
    rows = torch.cat([group.rows for group in groups] + [no_rows])
    tables = cat_padded([group.block_table for group in groups], no_rows.view(0, 0))
    bias = cat_padded([group.bias.flatten(1) for group in groups], no_rows.to(dtype).view(0, 0), float("-inf"))
    sizes = torch.tensor([[len(group.rows), group.block_table.shape[1]] for group in groups], dtype=torch.int64)
    bounds = torch.tensor([[chunk.start, chunk.end, chunk.seqlen_k] for chunk in chunks], dtype=torch.int64)
    chunk_tables = cat_padded([chunk.block_table for chunk in chunks], no_rows.view(0, 0))
    return tuple(t.flatten() for t in (plan.slot_mapping, rows, tables, bias, sizes, bounds, chunk_tables))


def cat_padded(parts: list[Tensor], empty: Tensor, value: float = 0) -> Tensor:
    """`parts` `[n_i, width_i]` as one `[sum of n_i, widest]`, each padded with `value`; `empty` (no rows)
    is the answer when there are no parts."""
    width = max(part.shape[-1] for part in parts + [empty])
    return torch.cat([F.pad(part, (0, width - part.shape[-1]), value=value) for part in parts + [empty]])


def read_plan(slot_mapping: Tensor, rows: Tensor, tables: Tensor, bias: Tensor, sizes: Tensor, bounds: Tensor,
              chunk_tables: Tensor, block_size: int) -> AttentionPlan:
    """`plan_tensors`' tensors -> the plan they were made from."""
    tables, bias = unflatten(tables, len(rows)), unflatten(bias, len(rows))
    groups, first = [], 0
    for num_rows, num_blocks in sizes.view(-1, 2).tolist():
        last = first + num_rows
        groups.append(DecodeGroup(rows[first:last], tables[first:last, :num_blocks],
                                  bias[first:last, None, None, :num_blocks * block_size]))
        first = last
    bounds = bounds.view(-1, 3).tolist()
    chunk_tables = unflatten(chunk_tables, len(bounds))
    chunks = [PrefillRequest(start, end, chunk_tables[i:i + 1, :cdiv(seqlen_k, block_size)], seqlen_k,
                             None if end - start == seqlen_k else causal_mask(end - start, seqlen_k, rows.device))
              for i, (start, end, seqlen_k) in enumerate(bounds)]
    return AttentionPlan(slot_mapping, groups, chunks)


def unflatten(flat: Tensor, num_rows: int) -> Tensor:
    """`[num_rows * width]` -> `[num_rows, width]` (width 0 where there are no rows)."""
    return flat.view(num_rows, flat.numel() // max(num_rows, 1))


@torch.library.custom_op("nanoserve::paged_attention", mutates_args=("kv_cache",))
def paged_attention_op(q: Tensor, k: Tensor, v: Tensor, kv_cache: Tensor, layer: int, slot_mapping: Tensor,
                       rows: Tensor, tables: Tensor, bias: Tensor, sizes: Tensor, bounds: Tensor,
                       chunk_tables: Tensor, scale: float) -> Tensor:
    """The torch backend's attention for layer `layer` (attention.py), as one op: q `[N, H, D]`, k, v
    `[N, Hkv, D]` -> `[N, H, D]`, its plan read back from `plan_tensors`' tensors."""
    k_cache, v_cache = kv_cache[:, layer]  # views taken inside the op: it declares the whole cache mutated
    store_kvcache(k, v, k_cache, v_cache, slot_mapping)
    plan = read_plan(slot_mapping, rows, tables, bias, sizes, bounds, chunk_tables, k_cache.shape[1])
    return paged_attention(q, k_cache, v_cache, plan, scale).contiguous()


@paged_attention_op.register_fake
def _(q: Tensor, *rest: Tensor | int | float) -> Tensor:
    """The output's shape for tracing: q's, laid out contiguously."""
    return q.new_empty(q.shape)
