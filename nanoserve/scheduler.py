"""The scheduler: which requests run this step, and how many tokens each.

Continuous batching works token by token, not request by request. Each step has one token budget
(`max_num_batched_tokens`) that all requests share:
1. Running requests go first, oldest first: one decode token each, or the next chunk of a prompt
   that did not fit in earlier steps (chunked prefill). Prefill chunks and decodes mix freely:
   "all requests' current tokens flattened into one batch".
2. Then waiting requests are admitted first come, first served, while budget, blocks and
   `max_num_seqs` allow. A prefix-cache hit counts as already computed.
When blocks run out, a prefill chunk first shrinks to what the free blocks hold; if not even one
token fits, the newest running request is preempted by recompute: its blocks are freed and it goes
back to the front of the queue, ahead of requests that never ran. Its tokens are kept, so nothing
is lost. A step that preempted admits no one.

`scheduling="static"` is the baseline (static batching, docs/batching.md): a batch is admitted only
when the previous one has completely finished, and KV space for prompt + max_tokens - 1 tokens is
reserved up front (the last sampled token's KV is never needed).

Invariants (`assert_invariants` checks them): every accepted request is in exactly one of
`waiting`, `running`, or finished; waiting requests hold no blocks; a step writes only into blocks
that the writing request alone holds.
"""
from __future__ import annotations

import time
from collections import deque

from nanoserve.block_manager import BlockManager
from nanoserve.config import Config
from nanoserve.sequence import Sequence, SequenceStatus

ScheduledSeq = tuple[Sequence, int]  # a request and how many of its tokens run this step


class Scheduler:
    """Owns the queues (`waiting`, `running`) and the block manager; plans each step."""

    def __init__(self, config: Config, num_blocks: int, max_model_len: int, eos_token_ids: set[int]) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.block_manager = BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the newest is last
        self.num_preemptions = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache, over all requests

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        """Plan one step. Returns the scheduled requests in batch order."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        num_preemptions = self.num_preemptions
        i = 0
        while i < len(self.running) and budget > 0:  # oldest first; preemption shortens the list
            seq = self.running[i]
            num_new = self.fit_or_preempt(seq, min(seq.num_tokens - seq.num_computed_tokens, budget))
            if num_new == 0:  # seq itself was preempted, so it was the newest: no one is left
                break
            scheduled.append((seq, num_new))
            budget -= num_new
            i += 1
        # A step that preempted is out of blocks: an admission would only be preempted in turn.
        if self.num_preemptions > num_preemptions:
            return scheduled
        # Static batching admits a new batch only once the last one has completely finished.
        if self.config.scheduling == "static" and self.running:
            return scheduled
        return scheduled + self.admit_waiting(budget)

    def fit_or_preempt(self, seq: Sequence, num_new: int) -> int:
        """Allocate blocks for seq's next `num_new` tokens, or for as many as fit (a shorter
        prefill chunk). If not even one token fits, preempt the newest running request and try
        again. Returns how many tokens of seq run this step; 0 if seq itself was preempted."""
        while True:
            num_fitting = min(num_new, self.block_manager.num_free_slots(seq))
            if num_fitting > 0:
                allocated = self.block_manager.allocate(seq, seq.num_computed_tokens + num_fitting)
                assert allocated, f"{seq}: {num_fitting} free slots but no blocks"
                return num_fitting
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return 0

    def admit_waiting(self, budget: int) -> list[ScheduledSeq]:
        """Move waiting requests to running, first come first served, while they fit."""
        static = self.config.scheduling == "static"
        scheduled: list[ScheduledSeq] = []
        while self.waiting and (budget > 0 or static) and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            cached_prefix = self.block_manager.find_cached_prefix(seq)
            num_computed = len(cached_prefix) * self.config.block_size
            num_new = min(seq.num_tokens - num_computed, budget)
            # Static batching reserves the whole request's KV space now; continuous only this step's.
            num_slots = (min(seq.num_prompt_tokens + seq.params.max_tokens - 1, self.max_model_len)
                         if static else num_computed + num_new)
            if not self.block_manager.allocate(seq, num_slots, cached_prefix):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens = num_computed
            if seq.num_cached_tokens is None:  # first admission (a preempted request finds its own blocks)
                seq.num_cached_tokens = min(num_computed, seq.num_prompt_tokens)
                self.num_cached_tokens += seq.num_cached_tokens
            self.running.append(seq)
            if num_new > 0:
                scheduled.append((seq, num_new))
                budget -= num_new
        return scheduled

    def preempt(self, seq: Sequence) -> None:
        """Preemption by recompute: drop seq's KV and requeue it at the front."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def update(self, scheduled: list[ScheduledSeq], sampled: list[int]) -> list[Sequence]:
        """After the model ran: advance each request, append the sampled tokens (one for every
        request whose last token ran, in batch order), and finish those that stop."""
        sampled_iter = iter(sampled)
        finished = []
        for seq, num_new in scheduled:
            seq.num_computed_tokens += num_new
            self.block_manager.cache_full_blocks(seq)
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a prefill chunk that did not reach the end of the prompt: no token yet
            token = next(sampled_iter)
            seq.token_ids.append(token)
            if seq.first_token_time is None:
                seq.first_token_time = time.perf_counter()
            reason = self.stop_reason(seq, token)
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    def stop_reason(self, seq: Sequence, token: int) -> str | None:
        """"stop" at EOS (unless ignore_eos) or a stop token, "length" at max_tokens or
        max_model_len, else None: keep going."""
        params = seq.params
        if (token in self.eos_token_ids and not params.ignore_eos) or token in (params.stop_token_ids or ()):
            return "stop"
        if len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        """Finished or aborted requests return their blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.finish_time = time.perf_counter()

    def assert_invariants(self, scheduled: list[ScheduledSeq] | None = None) -> None:
        """Check the invariants above and the block manager's; given this step's plan (before
        `update`), also check that it fits the limits and writes only into unshared blocks."""
        live = [*self.waiting, *self.running]
        assert len({id(seq) for seq in live}) == len(live), f"a request is queued twice: {live}"
        assert all(s.status is SequenceStatus.WAITING and not s.block_table and s.num_computed_tokens == 0
                   for s in self.waiting), f"a waiting request is not WAITING or holds KV: {list(self.waiting)}"
        assert all(s.status is SequenceStatus.RUNNING for s in self.running), f"bad running: {self.running}"
        assert len(self.running) <= self.config.max_num_seqs, f"{len(self.running)} running > max_num_seqs"
        self.block_manager.assert_invariants(live)
        if scheduled is not None:
            seqs = [seq for seq, _ in scheduled]
            assert len(set(map(id, seqs))) == len(seqs) and all(s in self.running for s in seqs), f"bad plan {scheduled}"
            assert all(n > 0 for _, n in scheduled), f"a request scheduled with no tokens: {scheduled}"
            assert sum(n for _, n in scheduled) <= self.config.max_num_batched_tokens, "token budget exceeded"
            self.block_manager.assert_writable(scheduled)
