"""Step traces: what one engine step did, printed as in the walkthrough (docs/walkthrough.md).

`format_step` prints a `StepResult` as the walkthrough's arrays, one line each. They are `input_ids`,
`positions`, `slot_mapping`, `query_start_loc`, `seq_lens` and `block_tables`. Then it says which requests
ran a prefill chunk, which decoded one token, and which finished. With speculative decoding it also says
how many drafts each verified and how many it accepted. It only reads: it never changes the engine.
The notebooks draw the KV cache itself with notebooks/block_map.py.
"""
from __future__ import annotations

from nanoserve.outputs import StepResult

FIELDS = ("input_ids", "positions", "slot_mapping", "query_start_loc", "seq_lens")


def format_step(result: StepResult, step_index: int | None = None) -> str:
    """The step as text, one `name = [...]` line per array of its Batch.

    Then come which requests ran a prefill chunk, which decoded one token, and which finished."""
    title = "step" if step_index is None else f"step {step_index}"
    batch = result.batch
    if batch is None:
        return f"{title}: nothing scheduled"
    lines = [f"{title}: {len(result.scheduled)} requests, {batch.input_ids.numel()} tokens "
             f"({result.num_prefill_tokens} prefill, {result.num_decode_tokens} decode)"]
    lines += [f"{name:<15} = {getattr(batch, name).tolist()}" for name in FIELDS]
    # Rows are padded to the longest table with the null block 0, which no request owns: drop it.
    tables = [[b for b in row if b != 0] for row in batch.block_tables.tolist()]
    lines.append(f"{'block_tables':<15} = {tables}")
    # each request's id, its number of tokens in this step and the position of the first of them
    runs = [(request_id, num_tokens, batch.positions[start].item())
            for (request_id, num_tokens), start in zip(result.scheduled, batch.query_start_loc.tolist())]
    prefill = [f"{r} ({n} tokens from position {p})" for r, n, p in runs if r not in result.decode_ids]
    # A decode with drafts (spec_decode.py) ran n - 1 of them after its last token. Its delta holds the tokens
    # kept: the accepted drafts and the sample after them. There are fewer where a stop rule ended the run
    # among them.
    num_out = {delta.request_id: len(delta.token_ids) for delta in result.deltas}
    decode = [f"{r} at position {p}" + (f" + {n - 1} drafts, {num_out[r] - 1} accepted" if n > 1 else "")
              for r, n, p in runs if r in result.decode_ids]
    finished = [f"{o.request_id} ({o.finish_reason}, {len(o.token_ids)} tokens out)" for o in result.outputs]
    for name, items in (("prefill", prefill), ("decode", decode), ("finished", finished)):
        lines.append(f"{name:<15} : {', '.join(items) or '-'}")
    return "\n".join(lines)
