"""The scheduler on its own, with a fake sampler and no model: the token budget, prefill chunks
mixed with decodes, preemption by recompute, and the static baseline."""
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
    """Schedule one step and pretend the model ran it."""
    scheduled = sched.schedule()
    num_samples = sum(seq.num_computed_tokens + n == seq.num_tokens for seq, n in scheduled)
    sched.update(scheduled, sampled([NEXT_TOKEN] * num_samples))
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
    sched = make_scheduler(num_blocks=5, block_size=2)  # 4 usable blocks
    old = add(sched, [1, 2, 3], max_tokens=10, request_id="old")
    new = add(sched, [4, 5, 6], max_tokens=10, request_id="new")
    step(sched)  # both prefilled: 2 blocks each, all 4 used; each samples its 4th token
    step(sched)  # both decode position 3, still in their 2nd block
    assert sched.block_manager.num_free_blocks == 0
    step(sched)  # old decodes position 4 into a 3rd block: none free, so the newest is preempted
    assert new.status is SequenceStatus.WAITING and new.block_table == [] and new.num_computed_tokens == 0
    assert sched.waiting[0] is new and sched.running == [old]
    assert new.token_ids == [4, 5, 6, NEXT_TOKEN, NEXT_TOKEN]  # its sampled token is kept for the recompute


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
    sched = Scheduler(Config(model="unused", max_num_seqs=2), 5, 2, max_model_len=8, eos_token_ids=set())
    old = add(sched, [1, 2, 3], max_tokens=10, request_id="old")
    new = add(sched, [4, 5, 6], max_tokens=10, request_id="new")
    late = add(sched, [7], max_tokens=1, request_id="late")  # waits: two seats only
    step(sched), step(sched)
    assert sched.block_manager.num_free_blocks == 0 and list(sched.waiting) == [late]
    scheduled = step(sched)  # old needs a 3rd block: new is preempted
    assert list(sched.waiting) == [new, late]  # first come, first served: new arrived before late
    # A seat and 2 blocks are free now, but a step that preempted admits no one.
    assert [s for s, _ in scheduled] == [old] and sched.running == [old]


def test_a_step_that_preempted_admits_no_one():
    # new's 2 blocks come back when it is preempted; old takes one. new's next 2-token chunk would fit
    # the other at once, only to be preempted again as old grows: the step must not admit it.
    config = Config(model="unused", max_num_batched_tokens=3, enable_prefix_caching=False)
    sched = Scheduler(config, 5, 2, max_model_len=8, eos_token_ids=set())
    old = add(sched, [1, 2], max_tokens=6, request_id="old")
    new = add(sched, [20, 21, 22, 23], max_tokens=4, request_id="new")
    while sched.num_preemptions == 0:
        scheduled = step(sched)
    assert [s for s, _ in scheduled] == [old] and list(sched.waiting) == [new]
    assert sched.block_manager.num_free_blocks == 1


def test_num_cached_tokens_counts_prompt_hits_at_first_admission_only():
    sched = Scheduler(Config(model="unused"), 6, 2, max_model_len=10, eos_token_ids=set())
    add(sched, [1, 2, 3], max_tokens=3, request_id="old")
    new = add(sched, [4, 5, 6, 7, 8], max_tokens=4, request_id="new")
    while new.status is not SequenceStatus.WAITING or not new.output_token_ids:
        step(sched)  # until new is preempted; its full blocks stay in the prefix cache
    while new.status is SequenceStatus.WAITING:
        scheduled = sched.schedule()
        sched.update(scheduled, sampled([NEXT_TOKEN] * sum(s.num_computed_tokens + n == s.num_tokens for s, n in scheduled)))
    assert new.num_computed_tokens - dict((s.request_id, n) for s, n in scheduled)["new"] > 0  # it re-found its blocks...
    assert new.num_cached_tokens == 0 and sched.num_cached_tokens == 0  # ...which are no prefix-cache hit
