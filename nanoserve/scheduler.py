"""The scheduler: which requests run this step, and how many tokens each.

Continuous batching works token by token, not request by request. Each step has one token budget
(`max_num_batched_tokens`) that all requests share:
1. Running requests go first, oldest first. Each gets one decode token, or the next chunk of a prompt
   that did not fit in earlier steps (chunked prefill). With speculative decoding, a decode also carries
   its draft tokens (spec_decode.py). Prefill chunks and decodes mix freely:
   "all requests' current tokens flattened into one batch".
2. Then waiting requests are admitted, first come, first served. They are admitted while budget, blocks
   and `max_num_seqs` allow. The free blocks must also still cover the running requests' next
   2 * block_size tokens (`blocks_to_keep_free`). Admitting into those would only preempt someone a few
   steps later. A prefix-cache hit counts as already computed. That holds even for blocks that a request
   admitted earlier in this step fills (block_manager.py says why that is safe).

When blocks run out, a prefill chunk first shrinks to what the free blocks hold. If not even one token
fits, the newest running request is preempted by recompute. Its blocks are freed, and it goes back to
the front of the queue, ahead of requests that never ran. Its tokens are kept, so nothing is lost.
A step that preempted admits no one.

After the model ran, `update` appends each sampled token. With drafts, it appends the accepted ones and
the sample after them. `stop_reason` applies every stop rule in one place, after each token: EOS, stop
tokens, stop strings, max_tokens and max_model_len.

Prompt logprobs need the logits of every prompt position, and a prefix-cache hit skips the positions
it covers. So requests that ask for the same prompt's logprobs share one list of them (`add`).
An example is the n samples of an echoed prompt. Whichever runs a position first computes its row
(`batch.prompt_logprob_positions`). A hit may skip only the positions whose rows are known.
A row is known if an earlier step computed it, or a request ahead in this step's batch computes it.
(`update` fills the list in batch order.) The prompt is computed once, not n times.

`scheduling="static"` is the baseline (static batching, docs/batching.md). A batch is admitted only
when the previous one has completely finished. KV space for prompt + max_tokens - 1 tokens is reserved
up front (the last sampled token's KV is never needed). The four places where the code differs are
marked "Static batching, difference N of 4".

Invariants (`assert_invariants` checks them):
- Every accepted request is in exactly one of `waiting`, `running`, or finished.
- Waiting requests hold no blocks.
- A step writes each block for one request only. Others read it only once it is full (block_manager.py).
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Protocol

from nanoserve.batch import prompt_logprob_positions
from nanoserve.block_manager import BlockManager
from nanoserve.config import Config, cdiv
from nanoserve.sampler import SamplerOutput, TokenLogprobs
from nanoserve.sequence import ScheduledSeq, Sequence, SequenceStatus

Row = tuple[int, TokenLogprobs | None]  # a sampled token and its logprobs


class Drafter(Protocol):
    """Speculative decoding's seam (extensions/spec_decode.py's Speculator, over any of its Proposers).
    - `schedule_drafts` runs after the running requests are planned, in a step that preempted none.
      It may set a decode's `spec_token_ids` and add them to its tokens this step.
    - `accept` runs in `update` for a request that had drafts, with its 1 + k sampled rows. It returns
      the rows to append, and may roll `num_computed_tokens` back over the rejected drafts.
    - `stats` reports its counters."""

    def schedule_drafts(self, scheduler: Scheduler, scheduled: list[ScheduledSeq]) -> list[ScheduledSeq]: ...

    def accept(self, seq: Sequence, rows: list[Row], block_manager: BlockManager) -> list[Row]: ...

    def stats(self) -> dict[str, int | list[int]]: ...


class Scheduler:
    """Owns the queues (`waiting`, `running`) and the block manager; plans each step."""

    def __init__(self, config: Config, num_blocks: int, block_size: int, max_model_len: int,
                 eos_token_ids: set[int], drafter: Drafter | None = None, sliding_window: int | None = None) -> None:
        self.config = config
        self.static = config.scheduling == "static"  # static batching, the baseline (see the module docstring)
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.block_manager = BlockManager(num_blocks, block_size, config.enable_prefix_caching, sliding_window)
        # The queues are OrderedDicts used as ordered sets: a request leaves from anywhere in O(1), by its
        # hash. An abort storm (a client with a large fan-out leaves) removes each of its requests in turn:
        # a deque or list would scan for every one, quadratic in the queue's length.
        self.waiting: OrderedDict[Sequence, None] = OrderedDict()  # first come, first served
        self.running: OrderedDict[Sequence, None] = OrderedDict()  # in admission order: the newest is last
        self.num_preemptions = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache, over all requests
        # (prompt token ids, prompt_logprobs) -> a request whose prompt logprobs the next such request shares.
        # Weak: an entry lives as long as its request (a finished one's rows are as good as any).
        self.prompt_logprobs_owners: weakref.WeakValueDictionary[tuple, Sequence] = weakref.WeakValueDictionary()
        self.spec = drafter  # drafts for the decodes (spec_decode.py), if asked for

    def add(self, seq: Sequence) -> None:
        """Queue seq. If it asks for prompt logprobs, it shares the list of a request with the same prompt
        and prompt_logprobs (see the module docstring)."""
        if seq.params.prompt_logprobs is not None:
            key = (tuple(seq.token_ids), seq.params.prompt_logprobs)  # a new request's tokens are its prompt
            seq.prompt_logprobs = self.prompt_logprobs_owners.setdefault(key, seq).prompt_logprobs
        self.waiting[seq] = None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[ScheduledSeq]:
        """Plan one step. Returns the scheduled requests in batch order."""
        scheduled, preempted = self.schedule_running()
        if self.spec is not None and not preempted:  # drafts take what the running requests leave
            scheduled = self.spec.schedule_drafts(self, scheduled)
        # A step that preempted is out of blocks: an admission would only be preempted in turn.
        # Static batching, difference 1 of 4: a new batch is admitted only once the last one has
        # completely finished (continuous batching admits at every step).
        if preempted or (self.static and self.running):
            return scheduled
        budget = self.config.max_num_batched_tokens - sum(num_new for _, num_new in scheduled)
        return scheduled + self.admit_waiting(budget, planned=scheduled)

    def schedule_running(self) -> tuple[list[ScheduledSeq], list[Sequence]]:
        """Each running request, oldest first, gets its next decode token or prefill chunk while the
        budget lasts. Returns them, and the requests preempted to find blocks for them."""
        budget = self.config.max_num_batched_tokens
        scheduled = []
        preempted = []
        for seq in list(self.running):  # a copy: preempting removes the newest from self.running
            if budget == 0:
                break
            if self.block_manager.sliding_window:  # blocks no query to come reads go back first
                self.block_manager.free_passed_blocks(seq)
            # Make room: preempt the newest running requests until seq can write at least one more
            # token. Stop if seq itself was preempted: it was the newest left, so no one after it runs.
            while self.block_manager.num_free_slots(seq) == 0 and seq not in preempted:
                preempted.append(next(reversed(self.running)))
                self.preempt(preempted[-1])
            if seq in preempted:  # just now, or as a victim of an older request: so are all requests newer than it
                break
            # A prefill chunk shrinks to what seq's blocks and the free blocks hold (>= 1 token now).
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget, self.block_manager.num_free_slots(seq))
            allocated = self.block_manager.allocate(seq, seq.num_computed_tokens + num_new)
            assert allocated, f"{seq}: {num_new} free slots but no blocks"
            self.block_manager.cache_full_blocks(seq, seq.num_computed_tokens + num_new)
            scheduled.append((seq, num_new))
            budget -= num_new
        return scheduled, preempted

    def admit_waiting(self, budget: int, planned: list[ScheduledSeq]) -> list[ScheduledSeq]:
        """Move waiting requests to running, first come, first served, while they fit. `planned` is the
        step's plan so far. The first that does not fit stops admission, so no one behind it jumps the queue."""
        scheduled = []
        # Static batching, difference 2 of 4: the whole batch is admitted at once, even past the token
        # budget (their prompts then run in chunks over the next steps).
        while ((seq := self.next_ready()) and (budget > 0 or self.static)
               and len(self.running) < self.config.max_num_seqs):
            # Blocks enter the prefix cache when the step that fills them is scheduled: a request
            # admitted after another in this step shares the blocks that one fills (block_manager.py).
            max_hit = self.max_cache_hit(seq, planned + scheduled)
            cached_prefix = self.block_manager.find_cached_prefix(seq, max_hit)
            num_computed = len(cached_prefix) * self.block_manager.block_size
            num_new = min(seq.num_tokens - num_computed, budget)
            # The KV slots seq takes now. Continuous batching: only what this step writes; later steps take
            # blocks as tokens arrive. Static batching, difference 3 of 4: the whole request up front,
            # because nobody knows when it will stop: so it is never preempted.
            num_slots = self.max_kv_len(seq) if self.static else num_computed + num_new
            if not self.block_manager.allocate(seq, num_slots, cached_prefix, self.blocks_to_keep_free()):
                break  # first come, first served: no one behind it may pass
            del self.waiting[seq]
            seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens = num_computed
            # First admission (a preempted request finds its own blocks). Nothing is sampled yet: the hit is prompt.
            if seq.num_cached_tokens is None:
                seq.num_cached_tokens = num_computed
                self.num_cached_tokens += seq.num_cached_tokens
            self.running[seq] = None
            self.block_manager.cache_full_blocks(seq, num_computed + num_new)
            if num_new > 0:
                scheduled.append((seq, num_new))
                budget -= num_new
        return scheduled

    def next_ready(self) -> Sequence | None:
        """The first waiting request that can run. A request WAITING_FOR_GRAMMAR is passed over until its
        grammar is compiled (structured_outputs.py). It does not hold up those behind it."""
        return next((seq for seq in self.waiting if seq.status is SequenceStatus.WAITING or seq.grammar.ready), None)

    def max_cache_hit(self, seq: Sequence, planned: list[ScheduledSeq]) -> int | None:
        """How many of seq's tokens a prefix-cache hit may cover, or None for any.

        With prompt logprobs, a hit covers only the positions whose rows are known. A row is known if an
        earlier step computed it. It is also known if a request planned before seq in this step shares
        seq's list and computes it (`update` adds its rows before seq's)."""
        if seq.params.prompt_logprobs is None:
            return None
        # seq's own rows would start at the first position without a known row
        return prompt_logprob_positions([*planned, (seq, 0)])[-1].start

    def max_kv_len(self, seq: Sequence) -> int:
        """The most KV seq can ever hold: prompt + max_tokens - 1, or max_model_len if less.
        The last sampled token is never fed back, so its KV is never stored."""
        return min(seq.num_prompt_tokens + seq.params.max_tokens - 1, self.max_model_len)

    def blocks_to_keep_free(self) -> int:
        """What an admission must leave free: the blocks the running requests need for their next
        2 * block_size tokens (fewer for one that stops sooner).

        Without it, requests are admitted while blocks last. Then, as the running ones grow, the newest
        are preempted and recomputed a few steps later (docs/batching.md measures it). With nothing
        running it is 0, so a request the cache can hold is always admitted.
        Static batching, difference 4 of 4: it is 0, because admission reserved it all."""
        if self.static:
            return 0
        block_size = self.block_manager.block_size
        return sum(cdiv(min(seq.num_tokens + 2 * block_size, self.max_kv_len(seq)), block_size)
                   - len(seq.block_table) for seq in self.running)

    def preempt(self, seq: Sequence) -> None:
        """Preemption by recompute: drop seq's KV and requeue it at the front."""
        del self.running[seq]
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        self.waiting[seq] = None
        self.waiting.move_to_end(seq, last=False)  # to the front: ahead of those that never ran
        self.num_preemptions += 1

    def update(self, scheduled: list[ScheduledSeq], output: SamplerOutput) -> list[Sequence]:
        """After the model ran, advance each request, append its sampled tokens and logprobs, and finish
        those that stop. Returns the finished ones.

        Every request whose last token ran gets one token, in batch order. Accepted drafts add more."""
        sampled = zip(output.token_ids, output.logprobs)
        prompt_logprobs = iter(output.prompt_logprobs)
        finished = []
        # The rows as planned: all at once, before any is added to the lists that requests share.
        for (seq, num_new), positions in zip(scheduled, prompt_logprob_positions(scheduled)):
            num_held = len(seq.prompt_logprobs) - 1  # rows of positions 0 .. num_held - 1
            assert not positions or positions.start == num_held, f"{seq}: rows from {positions.start}, {num_held} held"
            seq.prompt_logprobs += [next(prompt_logprobs) for _ in positions]
            seq.num_computed_tokens += num_new
            if seq.num_computed_tokens < seq.num_tokens:
                continue  # a prefill chunk that did not reach the end of the prompt: no token yet
            rows = [next(sampled) for _ in range(1 + len(seq.spec_token_ids))]  # its token; with drafts, 1 + k
            if seq.spec_token_ids:  # the rows verify its k drafts: keep those accepted (spec_decode.py)
                rows = self.spec.accept(seq, rows, self.block_manager)
            for token, logprobs in rows:
                seq.append_token(token, logprobs)
                if (reason := self.stop_reason(seq)) is not None:
                    self.finish(seq, reason)
                    finished.append(seq)
                    break
        return finished

    def stop_reason(self, seq: Sequence) -> str | None:
        """Every stop rule, here alone, for the token just appended. Returns, in this order:
        - "error" if the request failed (seq.error).
        - "stop" at EOS (unless ignore_eos), a stop token, or a stop string in the text. The detokenizer
          cut the text before the stop string.
        - "length" at max_tokens or max_model_len.
        - None otherwise: keep going."""
        params, token = seq.params, seq.token_ids[-1]
        if seq.error is not None:  # its grammar or a logits processor failed: it ends alone (its token is void)
            return "error"
        if token in self.eos_token_ids and not params.ignore_eos:
            return "stop"
        if token in (params.stop_token_ids or ()) or (seq.detokenizer is not None and seq.detokenizer.stopped):
            return "stop"
        if seq.grammar is not None and seq.grammar.is_terminated:  # its stop token, even with ignore_eos
            return "stop"
        if len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        """Finished or aborted requests leave their queue (`running`, or `waiting` for an abort) and return
        their blocks at once."""
        self.running.pop(seq, None)
        self.waiting.pop(seq, None)
        self.block_manager.free(seq)
        seq.finish(reason)

    def assert_invariants(self, scheduled: list[ScheduledSeq] = ()) -> None:
        """Check the invariants above and the block manager's. Given this step's plan (before `update`),
        also check that it fits the limits, and that no block is written by two requests."""
        # A queue holds a request once (a dict's keys), and the two statuses below keep it out of the other queue.
        waiting_states = (SequenceStatus.WAITING, SequenceStatus.WAITING_FOR_GRAMMAR)
        assert all(s.status in waiting_states and not s.block_table and s.num_computed_tokens == 0
                   for s in self.waiting), f"a waiting request is not WAITING or holds KV: {list(self.waiting)}"
        assert all(s.status is SequenceStatus.RUNNING for s in self.running), f"bad running: {list(self.running)}"
        assert len(self.running) <= self.config.max_num_seqs, f"{len(self.running)} running > max_num_seqs"
        self.block_manager.assert_invariants([*self.waiting, *self.running], scheduled)
        seqs = [seq for seq, _ in scheduled]
        assert len(set(seqs)) == len(seqs), f"a request planned twice: {scheduled}"
        assert all(s in self.running for s in seqs), f"a planned request is not running: {scheduled}"
        assert all(n > 0 for _, n in scheduled), f"a request scheduled with no tokens: {scheduled}"
        assert sum(n for _, n in scheduled) <= self.config.max_num_batched_tokens, "token budget exceeded"
