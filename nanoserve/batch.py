"""The flat batch of one step: every scheduled request's current tokens laid end to end.

This is the walkthrough's picture (docs/walkthrough.md) in code. `build_batch` turns the
scheduler's plan into it. The model and the attention kernels read it. Nothing else carries
attention inputs: no globals.
"""

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from nanoserve.device import upload
from nanoserve.sequence import ScheduledSeq, Sequence


@dataclass(frozen=True)
class Batch:
    """One step's flattened input. B requests, N tokens in all.

    Walkthrough step 1 (block_size 4, three prompts of 5, 7 and 3 tokens):
        input_ids       = [1,2,3,4,5, 1,6,5,7,8,9,10, 1,12,13]       # [N]
        positions       = [0,1,2,3,4, 0,1,2,3,4,5,6,  0,1,2]          # [N]
        slot_mapping    = [4,5,6,7,8, 12,...,18,      20,21,22]       # [N] block_id * block_size + offset
        query_start_loc = [0,5,12,15]                                 # [B+1] where each request's tokens start
        seq_lens        = [5,7,3]                                     # [B] tokens in the KV cache after this step
        block_tables    = [[1,2],[3,4],[5,0]]                         # [B, max_blocks], padded with null block 0
    """
    input_ids: Tensor        # [N] int64
    positions: Tensor        # [N] int64
    slot_mapping: Tensor     # [N] int64
    query_start_loc: Tensor  # [B+1] int32, cumulative query lengths (flash-attn's cu_seqlens_q)
    seq_lens: Tensor         # [B] int32, context length of each request after this step
    cu_seqlens_k: Tensor     # [B+1] int32, cumulative seq_lens (flash-attn's cu_seqlens_k)
    block_tables: Tensor     # [B, max_blocks] int32
    logits_indices: Tensor   # [S + P] int64, rows whose logits the model returns: the last token of
                             # each request that samples now (and its drafts', spec_decode.py), then
                             # the P prompt-logprob rows
    next_token_ids: Tensor   # [P] int64, the prompt token each prompt-logprob row predicts
    max_query_len: int
    max_seq_len: int
    # The lengths again, on the host (numpy int64): plans are built from these, never read back from the device
    query_start_loc_cpu: np.ndarray  # [B+1]
    seq_lens_cpu: np.ndarray         # [B]

    @property
    def is_decode_only(self) -> bool:
        """Every request brings exactly one new token: the decode fast path applies."""
        return self.max_query_len == 1


def samples_now(seq: Sequence, num_new: int) -> bool:
    """A request samples in the step that runs its last token, not in a mid-prompt chunk.
    It samples a token there, and one at each of its draft tokens if it has any (spec_decode.py)."""
    return seq.num_computed_tokens + num_new >= seq.num_tokens


def sampling_rows(scheduled: list[ScheduledSeq]) -> tuple[list[Sequence], list[int]]:
    """The sampled rows of a step, and how many tokens the request has sampled before each row.

    A request that samples now has 1 + k rows: its last token, then each of its k drafts (spec_decode.py).
    Without drafts k = 0. The counts let every row sample as a step without drafts would."""
    rows = [(seq, j) for seq, num_new in scheduled if samples_now(seq, num_new)
            for j in range(1 + len(seq.spec_token_ids))]
    return [seq for seq, _ in rows], [seq.num_tokens - seq.num_prompt_tokens + j for seq, j in rows]


def prompt_logprob_positions(scheduled: list[ScheduledSeq]) -> list[range]:
    """For each scheduled request, the positions of its tokens in this step whose logits give a prompt
    logprob. Position p predicts prompt token p + 1. That goes up to the prompt's last token, whose logits
    sample.

    Positions whose row is known are skipped. A preempted request recomputes its prompt, but its
    prompt_logprobs are kept. Requests with the same prompt share one list (scheduler.py). So rows that a
    request earlier in the batch computes for the same list are skipped too. Each row is computed once."""
    planned = {}  # id of a shared list -> the positions with a row by the end of this step
    found = []
    for seq, num_new in scheduled:
        if seq.params.prompt_logprobs is None:
            found.append(range(0))
            continue
        rows = seq.prompt_logprobs
        start = max(seq.num_computed_tokens, len(rows) - 1, planned.get(id(rows), 0))
        found.append(range(start, min(seq.num_computed_tokens + num_new, seq.num_prompt_tokens - 1)))
        planned[id(rows)] = max(planned.get(id(rows), 0), found[-1].stop)
    return found


def build_batch(scheduled: list[ScheduledSeq], block_size: int, device: torch.device) -> Batch:
    """Flatten the scheduled requests' current tokens into one Batch. A pure function.

    Request r runs its tokens [num_computed_tokens, num_computed_tokens + num_new). That is a whole
    prompt, a prompt chunk, or one decode token. Each request's positions count on from its
    num_computed_tokens:
    - 0, 1, ... for a new prompt without a prefix-cache hit;
    - k, k + 1, ... after a hit of k tokens;
    - for a decode, the token's index in its sequence.
    """
    input_ids, sampled_rows, prompt_rows, next_token_ids = [], [], [], []
    for (seq, num_new), positions in zip(scheduled, prompt_logprob_positions(scheduled)):
        start = seq.num_computed_tokens
        prompt_rows += [len(input_ids) + p - start for p in positions]  # rows of the flat batch
        next_token_ids += seq.token_ids[positions.start + 1:positions.stop + 1]
        # num_new counts a request's drafts too (spec_decode.py): they follow its last token, which token_ids ends with
        input_ids += seq.token_ids[start:start + num_new - len(seq.spec_token_ids)] + seq.spec_token_ids
        if samples_now(seq, num_new):  # it samples from its last token's row and its drafts' rows; none mid-prompt
            sampled_rows += range(len(input_ids) - 1 - len(seq.spec_token_ids), len(input_ids))
    query_lens = np.array([num_new for _, num_new in scheduled], np.int64)
    seq_lens = np.array([seq.num_computed_tokens + num_new for seq, num_new in scheduled], np.int64)
    query_start_loc = np.concatenate([[0], np.cumsum(query_lens)])
    # Token t belongs to request req[t]; its position counts on from that request's computed tokens.
    req = np.repeat(np.arange(len(scheduled)), query_lens)
    positions = np.arange(len(input_ids)) - query_start_loc[req] + (seq_lens - query_lens)[req]
    block_tables = np.zeros((len(scheduled), max(len(seq.block_table) for seq, _ in scheduled)), np.int64)
    for r, (seq, _) in enumerate(scheduled):
        block_tables[r, :len(seq.block_table)] = seq.block_table  # the rest stays 0, the null block
    # [N]: token t's block is entry positions[t] // block_size of its request's block table
    slot_mapping = block_tables[req, positions // block_size] * block_size + positions % block_size
    cu_seqlens_k = np.concatenate([[0], np.cumsum(seq_lens)])
    # One copy to the device per dtype (flash-attn wants lengths and block tables in int32)
    tensors = upload(dict(input_ids=input_ids, positions=positions, slot_mapping=slot_mapping,
                          logits_indices=sampled_rows + prompt_rows, next_token_ids=next_token_ids),
                     torch.int64, device)
    tensors |= upload(dict(query_start_loc=query_start_loc, seq_lens=seq_lens, cu_seqlens_k=cu_seqlens_k,
                           block_tables=block_tables), torch.int32, device)
    return Batch(**tensors, max_query_len=int(query_lens.max()), max_seq_len=int(seq_lens.max()),
                 query_start_loc_cpu=query_start_loc, seq_lens_cpu=seq_lens)
