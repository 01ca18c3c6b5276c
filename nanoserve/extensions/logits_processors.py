"""Logits processors: what a request asks of its next token's logits beyond temperature, top-k and top-p.

`process_logits` applies them to the rows that sample (logits [S, vocab], one row per request).
It applies them in vLLM's order:
1. Structured outputs: -inf outside the grammar's allowed tokens (structured_outputs.py).
2. min_tokens: -inf on EOS and the stop tokens while the output is shorter than min_tokens. That holds
   under a grammar too. A grammar that can only end sooner fails the request.
3. logit_bias: added to the logits of the tokens it names.
4. Penalties. First repetition_penalty, over the tokens in the prompt or the output. A positive logit is
   divided by it, and a negative one multiplied. So either way the token gets less likely. Then
   frequency_penalty x count + presence_penalty x (count > 0) is subtracted, counting the output only.
The sampler then divides by the temperature and applies min_p, top-k and top-p (sampler.py).

Logprobs come from the logits as the model gave them (vLLM's default). So these work on a copy. When no
row asks for any of them, the logits come back untouched, after one attribute check per row.
A failure here is one request's: its grammar's, or its parameters'. It fails that request alone
(`process_logits`).
"""

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence

from nanoserve.extensions.structured_outputs import apply_grammar_masks
from nanoserve.sampling_params import InvalidRequest, has_penalties, uses_processors
from nanoserve.sequence import Sequence


def process_logits(logits: torch.Tensor, seqs: list[Sequence], eos_token_ids: set[int]) -> torch.Tensor:
    """logits [S, vocab] of the requests `seqs` that sample now -> the logits to sample from.

    A processor may raise for one request, or leave a row with no token allowed. That fails the request
    alone (seq.error). It ends with "error" once its token, void, is appended. Its row is zeroed, so that
    sampling it cannot fail."""
    if not any(uses_processors(seq.params) for seq in seqs):
        return logits  # the common case: nothing to copy, nothing to do
    logits = logits.clone()
    apply_grammar_masks(logits, seqs)
    for row, seq in enumerate(seqs):
        try:
            apply_row_processors(logits, row, seq, eos_token_ids)
        except Exception as error:  # caused by this request's data: its failure, not the step's
            seq.error = seq.error or error
    apply_penalties(logits, seqs)
    fail_banned_rows(logits, seqs)
    logits[[seq.error is not None for seq in seqs]] = 0  # [S] mask: the failed requests' rows
    return logits


def apply_row_processors(logits: torch.Tensor, row: int, seq: Sequence, eos_token_ids: set[int]) -> None:
    """min_tokens and logit_bias, in place, on seq's row."""
    p = seq.params
    if len(seq.output_token_ids) < p.min_tokens:  # with a grammar too: one that must end sooner fails
        stop = set(p.stop_token_ids or ()) | (set() if p.ignore_eos else eos_token_ids)
        logits[row, sorted(stop)] = float("-inf")
    if bias := p.logit_bias:  # through numpy: a 49k-id bias takes ~4 ms a step, not ~35 as lists (AVX2 EPYC)
        ids = torch.from_numpy(np.fromiter(bias, np.int64, len(bias))).to(logits.device)  # [K]
        logits[row, ids] += torch.from_numpy(np.fromiter(bias.values(), np.float32, len(ids))).to(logits.device)


def fail_banned_rows(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Fail each request whose row allows no token (all -inf). Either its grammar's language is empty, or
    the grammar must end before min_tokens. (The sampler would pick token 0, which the grammar then refuses.)"""
    banned = torch.isneginf(logits).all(dim=1).tolist()  # [S]
    for seq, is_banned in zip(seqs, banned):
        if not is_banned or seq.error is not None or not uses_processors(seq.params):
            continue  # a row with a token allowed, one already failed, or the model's own logits
        num_output = len(seq.output_token_ids)
        if seq.grammar is None:
            seq.error = InvalidRequest("stop_token_ids", "every token is a stop token, banned until min_tokens")
        elif num_output < seq.params.min_tokens:
            seq.error = InvalidRequest("structured_outputs", f"structured_outputs must end after {num_output} "
                                                             f"tokens, before min_tokens={seq.params.min_tokens}")
        else:
            seq.error = InvalidRequest("structured_outputs", f"structured_outputs allows no token after "
                                                             f"{num_output} tokens: its language is empty")


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """The repetition, frequency and presence penalties, in place, on the rows whose requests ask for them."""
    rows = [row for row, seq in enumerate(seqs) if has_penalties(seq.params)]
    if not rows:
        return
    vocab, device = logits.shape[1], logits.device
    # Each request's prompt + output token ids, padded with `vocab`: an extra column, dropped below.
    tokens = pad_sequence([torch.tensor(seqs[r].token_ids) for r in rows], batch_first=True,
                          padding_value=vocab).to(device)                                  # [R, L]
    is_output = pad_sequence([torch.arange(seqs[r].num_tokens) >= seqs[r].num_prompt_tokens for r in rows],
                             batch_first=True).to(device)                                  # [R, L]
    zeros = torch.zeros(len(rows), vocab + 1, device=device)                              # [R, vocab + 1]
    counts = zeros.scatter_add(1, tokens, is_output.float())[:, :vocab]  # [R, vocab]
    seen = zeros.scatter(1, tokens, 1.0)[:, :vocab] > 0                 # [R, vocab]
    repetition, frequency, presence = (
        torch.tensor([getattr(seqs[r].params, name) for r in rows], device=device)[:, None]  # [R, 1] each
        for name in ("repetition_penalty", "frequency_penalty", "presence_penalty"))
    x = logits[rows]                                                                        # [R, vocab]
    x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
    logits[rows] = x - frequency * counts - presence * (counts > 0)
