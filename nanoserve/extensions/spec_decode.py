"""Speculative decoding by n-gram prompt lookup: several tokens per decode step where the output repeats the context.

A step of one decoding request reads the whole model for one token. Sometimes the output quotes its input
(a summary, a code edit, "rewrite this"). Then the next tokens can be guessed. `propose_ngram` finds the most
recent earlier occurrence of the context's last n tokens, and proposes the k tokens that followed it.
The request then runs 1 + k query tokens in the step, and samples at every one. They are one more varlen row
of the flat batch, like a prefill chunk:

    token_ids        = [... the cat sat on the mat . the cat]   num_computed_tokens: all but the last "cat"
    drafts           = [sat on the]                             (after the earlier "the cat")
    input_ids (row)  = [cat sat on the]                         positions p .. p + 3, 4 KV slots written
    sampled          = [sat on a  mat]                          one token per position
    accepted         = [sat on]  + bonus [a]                    the drafts up to the first mismatch, then the
                                                                token sampled there: 3 tokens in one step

Verification samples each position as a step without drafts would: same params, same seeded noise
(sampler.py). It keeps a draft while the draft equals the sample. Under greedy that means "equals the argmax".
So the output is exactly what decoding token by token gives. At temperature > 0 it is the speculative-sampling
rule of Leviathan et al. and Chen et al. (vLLM's) for a one-hot draft. Draft x is accepted with probability p(x).
After a rejection, the token comes from p with x removed, renormalised (the sample, given it is not x).
The output distribution is unchanged. A seeded request gives the same tokens with speculation as without.

Invariants:
- Drafts live in `seq.spec_token_ids` only from `schedule_drafts` to `accept` (one step).
- Only accepted tokens enter `token_ids`. So stop rules, logprobs, streaming and the prefix cache never see a
  rejected one. (The prefix cache hashes full blocks of `token_ids` only.)
- A rejected draft's KV slot is left as it is. `num_computed_tokens` rolls back over it, and a later step
  writes over it. Blocks that held only rejected drafts go back to the pool.
"""
from collections.abc import Callable
from functools import partial

import numpy as np

from nanoserve.block_manager import BlockManager
from nanoserve.config import SpeculativeConfig
from nanoserve.sampling_params import uses_processors
from nanoserve.scheduler import Row, Scheduler
from nanoserve.sequence import ScheduledSeq, Sequence


def propose_ngram(token_ids: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """k tokens that followed the most recent earlier occurrence of the last n tokens.

    n is the longest from n_max down to n_min that occurs. Returns [] if none does. Fewer than k tokens may
    follow the occurrence, where it overlaps the end. Then the copy runs on over the tokens it proposed, as
    LZ77 does. So a tail that repeats every p tokens is proposed in full, not p tokens at a time."""
    token_ids = np.asarray(token_ids)  # [L] int64
    ends = np.flatnonzero(token_ids[:-1] == token_ids[-1])  # where the last token occurred before: n-gram ends
    for n in range(min(n_max, len(token_ids) - 1), n_min - 1, -1):
        found = ends[ends >= n - 1]
        for back in range(1, n):  # keep the ends whose n - 1 tokens before match too
            found = found[token_ids[found - back] == token_ids[-1 - back]]
        if found.size:
            return np.resize(token_ids[found[-1] + 1:], k).tolist()  # np.resize repeats what follows to fill k
    return []


# A proposer: (the request's tokens so far, the most drafts that fit, k) -> up to k token ids it guesses follow
# them ([] for none). It changes nothing. `Speculator.schedule_drafts` calls it for each decode it drafts for.
# Prompt lookup (`propose_ngram`) is the default one. tests/test_drafter.py has another, which proposes fixed
# tokens. Scheduling, verifying and rolling back are the same for every proposer.
Proposer = Callable[[list[int], int], list[int]]


class Speculator:
    """The scheduler's Drafter (scheduler.py). `schedule_drafts` drafts for its decodes from a `Proposer`.
    `accept` verifies them. `stats` keeps vLLM's counters."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer | None = None) -> None:
        self.config = config
        self.propose = proposer or partial(propose_ngram, n_min=config.prompt_lookup_min,
                                           n_max=config.prompt_lookup_max)
        self.num_drafts = self.num_draft_tokens = 0
        self.num_accepted_tokens_per_pos = [0] * config.num_speculative_tokens

    def schedule_drafts(self, scheduler: Scheduler, scheduled: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """Give each decode in the step's plan its drafts.

        Drafts stay within the token budget, and below max_tokens and max_model_len. Their KV slots leave the
        admission reserve (`blocks_to_keep_free`) free. So the running requests' next tokens always come before
        drafts. Drafts shrink instead, and nobody is preempted for them."""
        if len(scheduler.running) >= self.config.disable_by_batch_size:
            return scheduled
        manager = scheduler.block_manager
        budget = scheduler.config.max_num_batched_tokens - sum(n for _, n in scheduled)
        reserve = scheduler.blocks_to_keep_free()
        planned = []
        for seq, num_new in scheduled:
            # A decode (its last token runs), unless its logits are processed (logits_processors.py): penalties and
            # grammars follow the output token by token, and a draft's row would not see the drafts before it.
            if seq.num_computed_tokens == seq.num_tokens - 1 and not uses_processors(seq.params):
                spare_blocks = max(0, manager.num_free_blocks - reserve)
                room = min(self.config.num_speculative_tokens, budget, scheduler.max_kv_len(seq) - seq.num_tokens,
                           (len(seq.block_table) + spare_blocks) * manager.block_size - seq.num_tokens)
                seq.spec_token_ids = drafts = self.propose(seq.token_ids, room)[:room] if room > 0 else []
                allocated = manager.allocate(seq, seq.num_tokens + len(drafts))  # not in the assert: -O
                assert allocated, f"{seq}: no room for drafts"
                num_new += len(drafts)
                budget -= len(drafts)
            planned.append((seq, num_new))
        return planned

    def accept(self, seq: Sequence, rows: list[Row], block_manager: BlockManager) -> list[Row]:
        """Keep seq's drafts that equal their position's sample, and roll back over the rest.

        The step verified the drafts with seq's 1 + k sampled rows (token, logprobs). Returns the rows of the
        tokens kept: the accepted drafts and the sample after them. The scheduler appends them until a stop
        rule fires."""
        drafts, seq.spec_token_ids = seq.spec_token_ids, []
        num_accepted = next((j for j, draft in enumerate(drafts) if draft != rows[j][0]), len(drafts))
        self.num_drafts += 1
        self.num_draft_tokens += len(drafts)
        for j in range(num_accepted):
            self.num_accepted_tokens_per_pos[j] += 1
        seq.num_computed_tokens -= len(drafts) - num_accepted  # a rejected draft's KV slot is written over later
        # blocks only rejected drafts used go back; + 1 keeps the bonus token's slot, written next step
        block_manager.free(seq, seq.num_computed_tokens + 1)
        return rows[:num_accepted + 1]

    def stats(self) -> dict[str, int | list[int]]:
        """vLLM's spec-decode counters since start. They count verification steps with drafts, draft tokens,
        accepted ones, and accepted ones by position in the draft."""
        per_pos = self.num_accepted_tokens_per_pos  # a draft token is accepted only after all those before it
        return dict(num_drafts=self.num_drafts, num_draft_tokens=self.num_draft_tokens,
                    num_accepted_tokens=sum(per_pos), num_accepted_tokens_per_pos=list(per_pos))
