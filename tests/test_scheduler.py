"""The scheduler on its own, with a fake sampler and no model: the token budget, prefill chunks
mixed with decodes, preemption by recompute, and the static baseline."""
import gc
import random

import pytest

from nanoserve.batch import build_batch
from nanoserve.config import Config
from nanoserve.sampler import SamplerOutput, SamplingParams
from nanoserve.scheduler import Scheduler
from nanoserve.sequence import Sequence, SequenceStatus

WALKTHROUGH_PROMPTS = [[1, 2, 3, 4, 5], [1, 6, 5, 7, 8, 9, 10], [1, 12, 13]]  # docs/walkthrough.md
NEXT_TOKEN = 99  # the fake sampler always answers this



def sampled(token_ids: list[int]) -> SamplerOutput:
    """The model's sampled tokens for Scheduler.update, without logprobs."""
    return SamplerOutput(token_ids, [None] * len(token_ids), [])

def make_scheduler(num_blocks: int = 64, block_size: int = 16, **config) -> Scheduler:
    return Scheduler(Config(model="unused", **config), num_blocks, block_size, max_model_len=1024, eos_token_ids=set())


def add(sched: Scheduler, prompt: list[int], max_tokens: int = 4, request_id: str | None = None) -> Sequence:
    seq = Sequence(request_id or str(len(sched.waiting) + len(sched.running)), None, prompt,
                   SamplingParams(max_tokens=max_tokens, temperature=0))
    sched.add(seq)
    return seq


def step(sched: Scheduler) -> list[tuple[Sequence, int]]:
    """Schedule one step and pretend the model ran it; the invariants hold for the plan and after."""
    scheduled = sched.schedule()
    sched.assert_invariants(scheduled)
    num_samples = sum(seq.num_computed_tokens + n == seq.num_tokens for seq, n in scheduled)
    sched.update(scheduled, sampled([NEXT_TOKEN] * num_samples))
    sched.assert_invariants()
    return scheduled


def test_walkthrough_prefill_then_decode_batches():
    sched = make_scheduler(block_size=4)
    seqs = [add(sched, p) for p in WALKTHROUGH_PROMPTS]
    scheduled = sched.schedule()
    batch = build_batch(scheduled, 4, "cpu")
    assert batch.input_ids.tolist() == [1, 2, 3, 4, 5, 1, 6, 5, 7, 8, 9, 10, 1, 12, 13]
    assert batch.positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2]
    assert batch.slot_mapping.tolist() == [4, 5, 6, 7, 8, 12, 13, 14, 15, 16, 17, 18, 20, 21, 22]
    assert batch.query_start_loc.tolist() == [0, 5, 12, 15]
    assert batch.seq_lens.tolist() == [5, 7, 3]
    assert batch.block_tables.tolist() == [[1, 2], [3, 4], [5, 0]]
    assert batch.logits_indices.tolist() == [4, 11, 14]
    sched.update(scheduled, sampled([14, 15, 16]))
    batch = build_batch(sched.schedule(), 4, "cpu")
    assert batch.input_ids.tolist() == [14, 15, 16]
    assert batch.positions.tolist() == [5, 7, 3]
    assert batch.slot_mapping.tolist() == [9, 19, 23]
    assert batch.seq_lens.tolist() == [6, 8, 4]
    assert batch.is_decode_only
    assert [s.status for s in seqs] == [SequenceStatus.RUNNING] * 3


def test_token_budget_chunks_prefill_and_mixes_it_with_decodes():
    sched = make_scheduler(max_num_batched_tokens=8, block_size=4)
    short = add(sched, [1, 2, 3], max_tokens=10)
    scheduled = step(sched)
    assert [(s.request_id, n) for s, n in scheduled] == [(short.request_id, 3)]
    long = add(sched, list(range(10, 30)))  # 20 tokens: 7 + 8 + 5 across three steps
    budgets = []
    for _ in range(3):
        scheduled = step(sched)
        assert sum(n for _, n in scheduled) <= 8
        assert scheduled[0] == (short, 1)  # the running decode is always scheduled first
        budgets.append(dict((s.request_id, n) for s, n in scheduled)[long.request_id])
    assert budgets == [7, 7, 6]
    assert long.num_computed_tokens == 20 and len(long.output_token_ids) == 1


def test_max_num_seqs_limits_admission():
    sched = make_scheduler(max_num_seqs=2)
    for i in range(3):
        add(sched, [1, 2, 3], request_id=f"r{i}")
    assert [s.request_id for s, _ in sched.schedule()] == ["r0", "r1"]
    assert len(sched.waiting) == 1


def test_preemption_by_recompute_loses_nothing():
    # 6 usable blocks of 2 slots; three requests that each grow to 8 tokens need 12.
    sched = make_scheduler(num_blocks=7, block_size=2)
    seqs = [add(sched, [1 + i, 2, 3, 4], max_tokens=5, request_id=f"r{i}") for i in range(3)]
    for _ in range(100):
        if not sched.has_unfinished():
            break
        step(sched)
        used = [b for s in sched.running for b in s.block_table]
        assert len(used) == len(set(used))  # no prefix sharing here: no block in two tables
    assert sched.num_preemptions > 0
    assert all(s.status is SequenceStatus.FINISHED and s.finish_reason == "length" for s in seqs)
    assert all(s.output_token_ids == [NEXT_TOKEN] * 5 for s in seqs)
    assert sched.block_manager.num_free_blocks == 6


def test_preempted_request_goes_back_to_the_front_and_newest_is_chosen():
    sched = make_scheduler(num_blocks=7, block_size=2)  # 6 usable blocks
    old = add(sched, [1, 2, 3], max_tokens=10, request_id="old")
    new = add(sched, [4, 5, 6], max_tokens=10, request_id="new")
    step(sched)  # both prefilled: 2 blocks each, leaving the 2 that old's next 4 tokens need
    step(sched), step(sched), step(sched)  # both decode into a 3rd block: all 6 used
    assert sched.block_manager.num_free_blocks == 0 and sched.num_preemptions == 0
    step(sched)  # old decodes position 6 into a 4th block: none free, so the newest is preempted
    assert new.status is SequenceStatus.WAITING and new.block_table == [] and new.num_computed_tokens == 0
    assert list(sched.waiting) == [new] and list(sched.running) == [old]
    assert new.token_ids == [4, 5, 6] + [NEXT_TOKEN] * 4  # its sampled tokens are kept for the recompute


def test_static_batching_waits_for_the_whole_batch_and_reserves_up_front():
    sched = make_scheduler(scheduling="static", block_size=4, max_num_seqs=2)
    a = add(sched, [1, 2, 3], max_tokens=2, request_id="a")     # finishes first
    b = add(sched, [1, 2, 3], max_tokens=9, request_id="b")
    c = add(sched, [1, 2, 3], max_tokens=2, request_id="c")
    step(sched)
    # KV for prompt + max_tokens - 1 is reserved at admission: 1 block for a, 3 for b.
    assert len(a.block_table) == 1 and len(b.block_table) == 3
    while a.status is not SequenceStatus.FINISHED:
        step(sched)
    scheduled = step(sched)
    assert [s for s, _ in scheduled] == [b]  # c may not join while b is still running
    while b.status is not SequenceStatus.FINISHED:
        step(sched)
    assert c.status is SequenceStatus.WAITING
    step(sched)
    assert c.status is SequenceStatus.RUNNING


def test_continuous_batching_lets_a_new_request_join_mid_flight():
    sched = make_scheduler(block_size=4, max_num_seqs=2)
    add(sched, [1, 2, 3], max_tokens=2, request_id="a")
    add(sched, [1, 2, 3], max_tokens=9, request_id="b")
    c = add(sched, [1, 2, 3], max_tokens=2, request_id="c")
    step(sched), step(sched)  # a finishes after its second token
    assert c in [s for s, _ in step(sched)]


def test_stop_token_eos_and_max_model_len():
    sched = Scheduler(Config(model="unused"), 64, 16, max_model_len=6, eos_token_ids={NEXT_TOKEN})
    eos = Sequence("eos", None, [1, 2], SamplingParams(max_tokens=5))
    ignore = Sequence("ignore", None, [1, 2], SamplingParams(max_tokens=10, ignore_eos=True))
    stop = Sequence("stop", None, [1, 2], SamplingParams(max_tokens=5, ignore_eos=True, stop_token_ids=[NEXT_TOKEN]))
    for seq in (eos, ignore, stop):
        sched.add(seq)
    while sched.has_unfinished():
        step(sched)
    assert (eos.finish_reason, len(eos.output_token_ids)) == ("stop", 1)
    assert (stop.finish_reason, len(stop.output_token_ids)) == ("stop", 1)
    assert (ignore.finish_reason, ignore.num_tokens) == ("length", 6)  # capped by max_model_len


def test_prefix_cache_hit_skips_computed_tokens():
    sched = make_scheduler(block_size=4)
    system = list(range(100, 112))  # three full blocks
    first = add(sched, system + [1, 2], max_tokens=1, request_id="first")
    step(sched)
    assert first.status is SequenceStatus.FINISHED
    second = add(sched, system + [3], max_tokens=1, request_id="second")
    scheduled = sched.schedule()
    assert scheduled == [(second, 1)] and second.num_cached_tokens == 12


@pytest.mark.parametrize("scheduling", ["continuous", "static"])
def test_every_block_comes_back(scheduling):
    sched = make_scheduler(num_blocks=20, block_size=4, scheduling=scheduling, max_num_batched_tokens=16)
    for i in range(10):
        add(sched, list(range(i, i + 3 + i)), max_tokens=1 + i % 4)
    for _ in range(200):
        if not sched.has_unfinished():
            break
        step(sched)
    assert not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == 19


def test_a_chunk_shrinks_to_the_free_blocks_before_anyone_is_preempted():
    # 6 usable blocks of 4. `short` holds 2 blocks for its whole life (5 + 3 tokens); the 20-token
    # prompt needs the other 5 blocks but its last 8-token chunk finds only 4 of them free at first.
    sched = Scheduler(Config(model="unused", max_num_batched_tokens=8), 7, 4, max_model_len=24,
                      eos_token_ids=set())
    short = add(sched, [1, 2, 3, 4, 5], max_tokens=4, request_id="short")
    step(sched)
    long = add(sched, list(range(10, 30)), max_tokens=2, request_id="long")
    long_tokens = []
    while sched.has_unfinished():
        long_tokens += [n for s, n in step(sched) if s is long]
    # The bug: the last chunk did not fit, so the newest request, its own, was preempted again and
    # again, recomputing the prompt from the start each time. Now it runs the 2 tokens that fit.
    assert sched.num_preemptions == 0 and long_tokens == [7, 7, 2, 4, 1]
    assert long.output_token_ids == [NEXT_TOKEN] * 2 and short.output_token_ids == [NEXT_TOKEN] * 4


def test_a_preempted_request_goes_back_ahead_of_those_already_waiting_and_nothing_joins_that_step():
    sched = Scheduler(Config(model="unused", max_num_seqs=2), 7, 2, max_model_len=12, eos_token_ids=set())
    old = add(sched, [1, 2, 3], max_tokens=10, request_id="old")
    new = add(sched, [4, 5, 6], max_tokens=10, request_id="new")
    late = add(sched, [7], max_tokens=1, request_id="late")  # waits: two seats only
    step(sched), step(sched), step(sched), step(sched)
    assert sched.block_manager.num_free_blocks == 0 and list(sched.waiting) == [late]
    scheduled = step(sched)  # old needs a 4th block: new is preempted
    assert list(sched.waiting) == [new, late]  # first come, first served: new arrived before late
    # A seat and 2 blocks are free now, but a step that preempted admits no one.
    assert [s for s, _ in scheduled] == [old] and list(sched.running) == [old]
    assert sched.block_manager.num_free_blocks == 2


def test_a_step_that_preempted_admits_no_one():
    """The rule "a step that preempted admits no one" on its own: here nothing else holds the victim
    back. Catches the rule dropped (the victim readmitted in the step that preempted it)."""
    # 3 usable blocks of 2 slots, 2 tokens a step. old (1 + 3 tokens) never holds more than 2 blocks;
    # new's 2-token prompt runs one token a step beside old's, in 1 block. In step 3 old takes the last
    # free block and new, needing a 2nd, is preempted: its block is free again. old then already holds
    # all the KV it will ever write (blocks_to_keep_free is 0) and new's next 1-token chunk fits that
    # block, but the step must not admit it.
    config = Config(model="unused", max_num_batched_tokens=2, enable_prefix_caching=False)
    sched = Scheduler(config, 4, 2, max_model_len=8, eos_token_ids=set())
    old = add(sched, [1], max_tokens=3, request_id="old")
    new = add(sched, [20, 21], max_tokens=2, request_id="new")
    assert [[(s.request_id, n) for s, n in step(sched)] for _ in range(2)] == [[("old", 1), ("new", 1)]] * 2
    assert sched.num_preemptions == 0 and sched.block_manager.num_free_blocks == 1
    scheduled = sched.schedule()  # step 3
    assert scheduled == [(old, 1)] and sched.num_preemptions == 1 and list(sched.waiting) == [new]
    assert sched.block_manager.num_free_blocks == 1 and sched.blocks_to_keep_free() == 0  # only the rule held new
    sched.assert_invariants(scheduled)
    sched.update(scheduled, sampled([NEXT_TOKEN]))
    while sched.has_unfinished():
        step(sched)
    assert old.output_token_ids == [NEXT_TOKEN] * 3 and new.output_token_ids == [NEXT_TOKEN] * 2


def test_num_cached_tokens_counts_prompt_hits_at_first_admission_only():
    sched = Scheduler(Config(model="unused"), 8, 2, max_model_len=12, eos_token_ids=set())
    add(sched, [1, 2, 3], max_tokens=8, request_id="old")
    new = add(sched, [4, 5, 6, 7, 8], max_tokens=6, request_id="new")
    for _ in range(20):  # until new is preempted; its full blocks stay in the prefix cache
        step(sched)
        if new.status is SequenceStatus.WAITING:
            break
    assert new.status is SequenceStatus.WAITING and new.output_token_ids
    while new.status is SequenceStatus.WAITING:
        scheduled = step(sched)
    ran = dict((s.request_id, n) for s, n in scheduled)["new"]
    assert new.num_computed_tokens - ran > 0  # it re-found its blocks...
    assert new.num_cached_tokens == 0 and sched.num_cached_tokens == 0  # ...which are no prefix-cache hit


def test_requests_admitted_in_one_step_share_the_system_prompt_blocks_the_first_one_fills():
    # The bug: blocks entered the prefix cache only after the step that computed them, so N requests
    # with one system prompt arriving together each computed it (block tables [1,2,3] and [4,5,6]).
    sched = make_scheduler(block_size=4)
    system = list(range(100, 113))  # 13 tokens: 3 full blocks, and a 4th the suffix completes differently
    seqs = [add(sched, system + [i, i + 1], max_tokens=2, request_id=f"r{i}") for i in range(5)]
    scheduled = sched.schedule()
    sched.assert_invariants(scheduled)
    assert [n for _, n in scheduled] == [15] + [3] * 4  # the others run only from position 12
    assert [s.num_cached_tokens for s in seqs] == [0] + [12] * 4
    assert all(s.block_table[:3] == seqs[0].block_table[:3] for s in seqs)
    assert len({s.block_table[3] for s in seqs}) == 5  # the 4th block is each one's own
    assert sched.num_cached_tokens == 48
    sched.update(scheduled, sampled([NEXT_TOKEN] * 5))
    sched.assert_invariants()


def test_a_chunk_that_stops_mid_prompt_lets_the_same_step_share_only_the_blocks_it_fills():
    # Static batching admits the whole batch past the token budget: "a" runs 6 of its 13 tokens in
    # step 1, filling block 1 and half of block 2, and "b" is admitted in the same step with nothing
    # to run yet. It may share block 1 only: block 2 is not full, nor computed, until "a" runs on.
    sched = make_scheduler(block_size=4, max_num_batched_tokens=6, scheduling="static")
    system = list(range(100, 112))
    a = add(sched, system + [1], max_tokens=2, request_id="a")
    b = add(sched, system + [2], max_tokens=2, request_id="b")
    scheduled = sched.schedule()
    sched.assert_invariants(scheduled)
    assert scheduled == [(a, 6)] and b.status is SequenceStatus.RUNNING
    assert (b.num_cached_tokens, b.num_computed_tokens) == (4, 4) and b.block_table[0] == a.block_table[0]
    assert b.block_table[1] != a.block_table[1]
    while sched.has_unfinished():
        step(sched)
    assert a.output_token_ids == b.output_token_ids == [NEXT_TOKEN] * 2


def test_the_head_of_the_queue_is_never_passed_by_a_smaller_request():
    # First come, first served: "big" waits for blocks; "small" behind it would fit at once but must
    # not jump the queue (the bug: a head that does not fit rotated to the back).
    sched = make_scheduler(num_blocks=7, block_size=4)  # 6 usable blocks
    running = add(sched, list(range(1, 13)), max_tokens=3, request_id="running")  # 3 blocks, then a 4th
    step(sched)
    big = add(sched, list(range(20, 31)), max_tokens=1, request_id="big")  # 3 blocks: 2 are free
    small = add(sched, [40], max_tokens=1, request_id="small")            # 1 block
    while running.status is SequenceStatus.RUNNING:
        assert [s for s, _ in step(sched)] == [running]
        assert list(sched.waiting) == [big, small]
    assert [s for s, _ in step(sched)] == [big, small]  # in arrival order, once big fits


def test_admission_keeps_blocks_free_for_the_running_requests_next_tokens(monkeypatch):
    # The bug it catches: admitting while free blocks last, so that the newcomer is preempted and
    # recomputed a few steps later as the running requests grow.
    def serve(reserve: bool) -> tuple[Scheduler, list[Sequence]]:
        sched = make_scheduler(num_blocks=9, block_size=4)  # 8 usable blocks
        if not reserve:
            monkeypatch.setattr(sched, "blocks_to_keep_free", lambda: 0)
        first = add(sched, list(range(1, 13)), max_tokens=12, request_id="first")  # 3 blocks, up to 6
        step(sched)
        late = add(sched, list(range(20, 32)), max_tokens=8, request_id="late")   # 3 blocks, up to 5
        waits = [s for s, _ in step(sched)] == [first]
        while sched.has_unfinished():
            step(sched)
        assert first.output_token_ids == [NEXT_TOKEN] * 12 and late.output_token_ids == [NEXT_TOKEN] * 8
        return sched, waits
    # first's next 8 tokens need 3 more blocks: of the 5 free, late may take only 2, and waits.
    sched, late_waited = serve(reserve=True)
    assert late_waited and sched.num_preemptions == 0
    sched, late_waited = serve(reserve=False)
    assert not late_waited and sched.num_preemptions > 0


class ScanDetector(Sequence):
    """A request that counts the == comparisons made with it, failing the test past a budget. A queue
    that finds a request by scanning (deque.remove, list.remove, `in` on a list) compares it with
    every request it passes; a dict finds it by its hash, and identity settles it: no comparison."""
    budget = float("inf")  # comparisons left
    __hash__ = Sequence.__hash__

    def __eq__(self, other: object) -> bool:
        ScanDetector.budget -= 1
        if ScanDetector.budget < 0:
            raise AssertionError("a queue was scanned for a request: each abort costs O(queue length)")
        return self is other


def test_an_abort_storm_of_100000_queued_requests_scans_no_queue():
    # The bug it catches: each abort scans a queue for its request (deque.remove, list.remove), linear
    # in the queue's length: ~5e9 comparisons for the waiting queue here, an engine frozen for minutes.
    # Removal by hash compares nothing; scanning even the 200 running requests would compare ~20,000 times.
    num_running, num_waiting = 200, 100_000
    sched = make_scheduler(num_blocks=1 + num_running, max_num_seqs=num_running, max_num_batched_tokens=4 * num_running)
    params = SamplingParams(temperature=0, max_tokens=4)
    gc.disable()  # the collector's full passes over the 100,000 new requests would take most of the test's time
    try:
        seqs = [ScanDetector(str(i), None, [i % 200 + 1, 2, 3, 4], params) for i in range(num_running + num_waiting)]
        for seq in seqs[:num_running]:
            sched.add(seq)
        step(sched)  # 200 running, one block each
        for seq in seqs[num_running:]:
            sched.add(seq)
        doomed = random.Random(0).sample(seqs, len(seqs))  # in any order, as a server's set of ids comes
        ScanDetector.budget = 1_000
        for num_aborted, seq in enumerate(doomed, start=1):
            sched.finish(seq, "abort")
            if num_aborted == len(doomed) // 2:  # the queues hold only the live requests: stats stay right
                assert len(sched.waiting) + len(sched.running) == len(doomed) - num_aborted
                assert len(sched.running) == sum(s.status is SequenceStatus.RUNNING for s in seqs)
    finally:
        ScanDetector.budget = float("inf")
        gc.enable()
    assert not sched.has_unfinished() and all(s.finish_reason == "abort" for s in seqs)
    sched.assert_invariants()  # with nothing live, every block is free again
    assert sched.block_manager.num_free_blocks == num_running
