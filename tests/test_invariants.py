"""Nothing lost, nothing leaked: random workloads with the invariants checked after every step.

First, many random workloads through Scheduler + BlockManager + build_batch only. The model is a
fake: the KV it stores for a token is a hash of the whole prefix up to that token (as real K/V
depends on everything before it), and the token it samples is a function of the KV the request's
block table reads back. Like every attention layer, it stores all of a step's KV before any request
reads; a block handed out afresh loses what it held. So a request that reads a slot another request
overwrote, or that nobody has written yet (a block shared before the step that fills it), or loses a
token in a preemption, sees different KV and the test fails; first-come-first-served admission is
checked too. Then a few random workloads end to end through LLMEngine on a tiny Llama, compared with
transformers.
"""
import pytest

# Test extras (pyproject.toml's [test]) this module needs: without one it is skipped, not an error
pytest.importorskip("hypothesis")
import random
from dataclasses import dataclass

from hypothesis import example, given, settings
from hypothesis import strategies as st

from conftest import greedy, hf_greedy, reference
from nanoserve import LLM, SamplingParams
from nanoserve.batch import build_batch, prompt_logprob_positions
from nanoserve.block_manager import Block, BlockManager
from nanoserve.config import Config
from nanoserve.sampler import Logprob, SamplerOutput
from nanoserve.scheduler import ScheduledSeq, Scheduler
from nanoserve.sequence import Sequence, SequenceStatus

VOCAB = 4  # a tiny alphabet, so that random prompts and outputs also share blocks by chance


@dataclass
class Request:
    prompt: list[int]
    max_tokens: int
    arrival_step: int
    abort_step: int | None  # aborted at this step if still unfinished then
    stop_token_ids: list[int]
    ignore_eos: bool
    prompt_logprobs: bool = False  # its hits may skip only positions whose rows a request with its prompt computed


@dataclass
class Workload:
    config: Config
    num_blocks: int
    max_model_len: int
    requests: list[Request]
    eos_token_ids: set[int]


def token_lists(max_size: int) -> st.SearchStrategy[list[int]]:
    """Token lists of a uniformly drawn length (plain st.lists are mostly short)."""
    return st.integers(0, max_size).flatmap(lambda n: st.lists(st.integers(0, VOCAB - 1), min_size=n, max_size=n))


@st.composite
def workloads(draw: st.DrawFn) -> Workload:
    block_size = draw(st.sampled_from([1, 2, 4, 8]))
    max_model_len = draw(st.integers(2, 40))
    # As the engine requires: one max_model_len request fits the cache alone (block 0 is the null block).
    min_blocks = -(-max_model_len // block_size) + 1
    num_blocks = draw(st.integers(min_blocks, min_blocks + 2) | st.integers(min_blocks, 4 * min_blocks))
    config = Config(model="unused", block_size=block_size, num_kvcache_blocks=num_blocks,
                    max_num_batched_tokens=draw(st.integers(1, 12) | st.integers(1, 64)),
                    max_num_seqs=draw(st.integers(1, 8)), enable_prefix_caching=draw(st.booleans()),
                    scheduling=draw(st.sampled_from(["continuous", "continuous", "static"])))
    prefixes = draw(st.lists(token_lists(max_model_len), min_size=1, max_size=3))  # shared by several prompts
    requests = []
    for _ in range(draw(st.integers(1, 8))):
        prompt = (draw(st.sampled_from(prefixes)) + draw(token_lists(max_model_len // 2)))[:max_model_len] or [0]
        prompt_logprobs, arrival_step = draw(st.booleans()), draw(st.integers(0, 10))
        for _ in range(draw(st.sampled_from([1, 1, 2, 3]))):  # n samples of the prompt, arriving together
            requests.append(Request(prompt, max_tokens=draw(st.integers(1, max_model_len)), arrival_step=arrival_step,
                                    abort_step=draw(st.none() | st.none() | st.integers(0, 40)),
                                    stop_token_ids=draw(st.lists(st.integers(0, VOCAB - 1), max_size=1)),
                                    ignore_eos=draw(st.booleans()), prompt_logprobs=prompt_logprobs))
    eos_token_ids = draw(st.sets(st.integers(0, VOCAB - 1), max_size=1))
    return Workload(config, num_blocks, max_model_len, requests, eos_token_ids)


def kv_of(token_ids: list[int]) -> list[int]:
    """The fake KV of each position: a hash of the prefix up to and including it."""
    kv, h = [], 0
    for token in token_ids:
        h = hash((h, token))
        kv.append(h)
    return kv


def next_token(context_kv: list[int]) -> int:
    """The fake model's greedy choice: a function of the whole context it attends to."""
    return context_kv[-1] % VOCAB


def run_fake_model(scheduled: list[ScheduledSeq], kv_cache: dict[int, int], block_size: int) -> SamplerOutput:
    """Write this step's KV by slot_mapping, then read each request's context through its block
    table (as attention does, in every layer) and check it is exactly the request's tokens; sample
    the fake next token. A prompt-logprob row is the KV its position read: `prompt_logprob_rows`."""
    batch = build_batch(scheduled, block_size, "cpu")
    positions = [p for seq, n in scheduled for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n)]
    slots = [seq.block_table[p // block_size] * block_size + p % block_size
             for seq, n in scheduled for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n)]
    assert batch.positions.tolist() == positions and batch.slot_mapping.tolist() == slots
    new_kv = [kv for seq, n in scheduled for kv in kv_of(seq.token_ids)[seq.num_computed_tokens:][:n]]
    kv_cache.update(zip(slots, new_kv))
    sampled, prompt_rows = [], []
    for (seq, num_new), table, seq_len, positions in zip(scheduled, batch.block_tables.tolist(),
                                                         batch.seq_lens.tolist(), prompt_logprob_positions(scheduled)):
        context = [kv_cache.get(table[p // block_size] * block_size + p % block_size) for p in range(seq_len)]
        unwritten = [table[p // block_size] for p, kv in enumerate(context) if kv is None]
        assert not unwritten, f"{seq} reads blocks {unwritten} before anyone wrote them"
        assert context == kv_of(seq.token_ids[:seq_len]), f"{seq} reads KV that is not its own"
        if seq.num_computed_tokens + num_new == seq.num_tokens:
            sampled.append(next_token(context))
        prompt_rows += [{seq.token_ids[p + 1]: Logprob(context[p], 1)} for p in positions]
    return SamplerOutput(sampled, [None] * len(sampled), prompt_rows)


def prompt_logprob_rows(prompt: list[int]) -> list[dict[int, Logprob] | None]:
    """The fake model's prompt logprobs: for each prompt token but the first, the KV of the position before it."""
    kv = kv_of(prompt)
    return [None] + [{prompt[p + 1]: Logprob(kv[p], 1)} for p in range(len(prompt) - 1)]


def expected_output(w: Workload, r: Request) -> tuple[str, list[int]]:
    """What the request generates alone, and why it stops: "stop" after a stop token or (unless
    ignore_eos) an EOS token, else "length" after max_tokens or when max_model_len is reached."""
    tokens = list(r.prompt)
    stops = set(r.stop_token_ids) | (set() if r.ignore_eos else w.eos_token_ids)
    for _ in range(min(r.max_tokens, max(1, w.max_model_len - len(r.prompt)))):
        tokens.append(next_token(kv_of(tokens)))
        if tokens[-1] in stops:
            return "stop", tokens[len(r.prompt):]
    return "length", tokens[len(r.prompt):]


# Chunked prefill stops request 0 mid-block; request 1, with the same prompt, is admitted next step
# while request 0 is still filling that block: it must not be shared (nor cached) yet.
MID_BLOCK_PREFIX_HIT = Workload(
    Config(model="unused", block_size=4, num_kvcache_blocks=9, max_num_batched_tokens=6, max_num_seqs=2),
    num_blocks=9, max_model_len=16, requests=[Request([1, 2, 3, 0, 1, 2, 3, 0, 1, 2], 2, 0, None, [], False)] * 2,
    eos_token_ids=set())


# Four requests with one system prompt (3 blocks and a half) arrive together; the first fills the
# blocks that the others share in the same step.
SAME_STEP_PREFIX_HIT = Workload(
    Config(model="unused", block_size=4, num_kvcache_blocks=21, max_num_batched_tokens=64, max_num_seqs=4),
    num_blocks=21, max_model_len=20, eos_token_ids=set(),
    requests=[Request([3, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, i], 3, 0, None, [], True) for i in range(4)])
# Static batching admits past the token budget: the second request is admitted while the first has
# filled only 1 of the 2 blocks they could share.
SAME_STEP_MID_BLOCK = Workload(
    Config(model="unused", block_size=4, num_kvcache_blocks=9, max_num_batched_tokens=6, scheduling="static"),
    num_blocks=9, max_model_len=12, requests=[Request([1, 2, 3, 0, 1, 2, 3, 0, 1, i], 2, 0, None, [], True)
                                              for i in range(2)], eos_token_ids=set())


@settings(max_examples=200, deadline=None, database=None)
@given(workloads())
@example(MID_BLOCK_PREFIX_HIT)
@example(SAME_STEP_PREFIX_HIT)
@example(SAME_STEP_MID_BLOCK)
def test_random_workloads_keep_every_invariant(w: Workload):
    sched = Scheduler(w.config, w.num_blocks, w.config.block_size, w.max_model_len, eos_token_ids=w.eos_token_ids)
    seqs = [Sequence(str(i), None, r.prompt, SamplingParams(temperature=0, max_tokens=r.max_tokens,
                                                            stop_token_ids=r.stop_token_ids, ignore_eos=r.ignore_eos,
                                                            prompt_logprobs=0 if r.prompt_logprobs else None))
            for i, r in enumerate(w.requests)]
    kv_cache: dict[int, int] = {}
    block_manager, block_size = sched.block_manager, w.config.block_size

    def evict(block: Block) -> None:  # a block handed out afresh will be overwritten: its KV is gone
        for slot in range(block.block_id * block_size, (block.block_id + 1) * block_size):
            kv_cache.pop(slot, None)
        BlockManager.evict(block_manager, block)
    block_manager.evict = evict
    arrived: list[Sequence] = []  # in arrival order
    last_arrival = max(r.arrival_step for r in w.requests)
    # Each step the oldest running request runs >= 1 token and is never preempted (it always fits
    # alone), so every request finishes within len(prompt) + max_tokens steps of reaching the front.
    max_steps = last_arrival + sum(len(r.prompt) + r.max_tokens for r in w.requests) + 2
    for step in range(max_steps):
        for seq, r in zip(seqs, w.requests):
            if r.arrival_step == step:
                sched.add(seq)
                arrived.append(seq)
            if r.abort_step == step and r.arrival_step <= step and not seq.is_finished:
                sched.finish(seq, "abort")
        sched.assert_invariants()
        if step >= last_arrival and not sched.has_unfinished():
            break
        scheduled = sched.schedule()
        sched.assert_invariants(scheduled)
        # First come, first served: no request is ever admitted before one that arrived earlier.
        admitted = [seq.num_cached_tokens is not None for seq in arrived if seq.num_cached_tokens is not None
                    or not seq.is_finished]  # (aborted while waiting)
        assert admitted == sorted(admitted, reverse=True), f"FCFS broken: {arrived}"
        assert scheduled or not sched.has_unfinished(), f"step {step} scheduled nothing: deadlock"
        if scheduled:
            sched.update(scheduled, run_fake_model(scheduled, kv_cache, w.config.block_size))
    else:
        raise AssertionError(f"not done after {max_steps} steps: {sched.waiting} {sched.running}")
    sched.block_manager.assert_invariants([])  # every block is free again
    assert sched.block_manager.num_free_blocks == w.num_blocks - 1
    for seq, r in zip(seqs, w.requests):
        assert seq.status is SequenceStatus.FINISHED and not seq.block_table
        assert (seq.num_cached_tokens or 0) <= seq.num_prompt_tokens
        if r.prompt_logprobs:  # every prompt token's row in its place: none skipped by a hit, none twice
            rows = prompt_logprob_rows(r.prompt)
            assert seq.prompt_logprobs == rows[:len(seq.prompt_logprobs)]
            assert seq.finish_reason == "abort" or len(seq.prompt_logprobs) == len(rows)
        if seq.finish_reason == "abort":
            assert r.abort_step is not None
            assert seq.output_token_ids == expected_output(w, r)[1][:len(seq.output_token_ids)]
        else:
            assert (seq.finish_reason, seq.output_token_ids) == expected_output(w, r)
    if w.config.scheduling == "static":
        assert sched.num_preemptions == 0  # static batching reserves every request's KV up front


# ---------------------------------------------------------------------------------------------
# End to end on a tiny model: random arrival order and steps, a cache small enough to preempt.

def test_random_arrivals_and_preemption_match_transformers(tiny_models):
    """Greedy requests must equal transformers; seeded sampled requests (with stop tokens) must
    equal the same request served alone, whatever shares their steps, preemptions included."""
    path = tiny_models["gqa"]
    rng = random.Random(5)
    prefix = [rng.randrange(3, 256) for _ in range(12)]
    prompts = [prefix[:rng.randrange(13)] + [rng.randrange(3, 256) for _ in range(rng.randrange(1, 16))]
               for _ in range(8)]
    max_tokens = [rng.randrange(1, 17) for _ in prompts]
    expected = hf_greedy(path, prompts, max_tokens)
    sampled = {i: SamplingParams(temperature=0.9, top_p=0.95, max_tokens=16, seed=i,
                                 stop_token_ids=[rng.randrange(3, 256)]) for i in (1, 4, 6)}
    alone = LLM(path, block_size=4)
    expected_sampled = {i: alone.generate([prompts[i]], p, use_tqdm=False)[0] for i, p in sampled.items()}
    num_preemptions = 0
    for block_size, num_blocks, budget in [(4, 13, 16), (2, 25, 5), (1, 49, 64), (4, 14, 7)]:
        engine = LLM(path, block_size=block_size, num_kvcache_blocks=num_blocks, max_model_len=48,
                     max_num_batched_tokens=budget).engine
        order = rng.sample(range(len(prompts)), len(prompts))
        arrivals = sorted(rng.randrange(12) for _ in order)
        outputs, step = {}, 0
        while len(outputs) < 2 * len(prompts):
            for i, arrival in zip(order, arrivals):
                if arrival == step:
                    engine.add_request(prompts[i], SamplingParams(temperature=0, max_tokens=max_tokens[i]), str(i))
                    params = sampled.get(i, SamplingParams(temperature=0, max_tokens=max_tokens[i]))
                    engine.add_request(prompts[i], params, f"s{i}")
            outputs.update((o.request_id, o) for o in engine.step().outputs)
            engine.assert_invariants()
            step += 1
        assert [outputs[str(i)].token_ids for i in range(len(prompts))] == expected, (block_size, num_blocks, budget)
        for i, want in expected_sampled.items():
            got = outputs[f"s{i}"]
            assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason), (i, block_size)
        num_preemptions += engine.scheduler.num_preemptions
    assert num_preemptions > 0


# ---------------------------------------------------------------------------------------------
# Same-step prefix sharing end to end: one system prompt, requests admitted in the same step.

SYSTEM = [random.Random(7).randrange(3, 256) for _ in range(18)]  # 4 full blocks of 4, and 2 tokens
SHARED = [SYSTEM + [10 + i, 20 + i, 30 + i][:1 + i % 3] for i in range(5)]
SHARED_MAX_TOKENS = [6, 9, 4, 7, 5]


def serve_shared(engine, requests: list[int]) -> dict[str, object]:
    """Add `requests` (indexes into SHARED) together, step until they finish; outputs by request id."""
    for i in requests:
        engine.add_request(SHARED[i], SamplingParams(temperature=0, max_tokens=SHARED_MAX_TOKENS[i]), str(i))
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step().outputs)
        engine.assert_invariants()
    return outputs


def test_one_system_prompt_admitted_together_is_computed_once_whatever_the_batch_order(tiny_models):
    """Every layer stores all of the step's k, v before any attention reads them, so a request may
    read, in the same step, the blocks that another one fills, before or after it in the batch.
    Catches: a step that attends before storing another request's keys, a batch order that matters."""
    path = tiny_models["gqa"]
    expected = reference(path, SHARED, SHARED_MAX_TOKENS)
    for reverse in (False, True):
        engine = LLM(path, block_size=4).engine
        if reverse:  # the readers run before the request that writes their shared blocks
            engine.scheduler.schedule = lambda schedule=engine.scheduler.schedule: schedule()[::-1]
        for i in range(5):
            engine.add_request(SHARED[i], SamplingParams(temperature=0, max_tokens=SHARED_MAX_TOKENS[i]), str(i))
        first = engine.step()
        assert first.num_prefill_tokens == len(SHARED[0]) + sum(len(p) - 16 for p in SHARED[1:])
        outputs = serve_shared(engine, [])
        outputs.update((o.request_id, o) for o in first.outputs)
        assert [outputs[str(i)].token_ids for i in range(5)] == expected
        assert [outputs[str(i)].num_cached_tokens for i in range(5)] == [0, 16, 16, 16, 16]


def test_a_step_that_fails_leaves_no_unwritten_block_in_the_prefix_cache(tiny_models):
    """The blocks a failed step would have filled were cached when it was scheduled; generate aborts
    its requests, and those blocks must leave the cache with them. Catches: the next requests with
    the same system prompt reading KV that was never written (zeros), silently."""
    path = tiny_models["gqa"]
    llm = LLM(path, block_size=4)
    run = llm.engine.model_runner.run

    def fail(*args):
        raise RuntimeError("boom")
    llm.engine.model_runner.run = fail
    with pytest.raises(RuntimeError, match="boom"):
        llm.generate(SHARED, [greedy(n) for n in SHARED_MAX_TOKENS], use_tqdm=False)
    llm.engine.model_runner.run = run
    assert not llm.engine.scheduler.block_manager.cached_blocks
    outputs = llm.generate(SHARED, [greedy(n) for n in SHARED_MAX_TOKENS], use_tqdm=False)
    assert [o.token_ids for o in outputs] == reference(path, SHARED, SHARED_MAX_TOKENS)
    assert [o.num_cached_tokens for o in outputs] == [0, 16, 16, 16, 16]


def test_the_writer_aborted_or_preempted_leaves_its_readers_their_kv(tiny_models):
    """Request 0 fills the system prompt's blocks that the others share from the same step. Aborting
    it after that step keeps them cached (they are computed): a later request still hits them. In a
    cache too small for all, the writer and readers are preempted and recomputed; outputs unchanged."""
    path = tiny_models["gqa"]
    expected = reference(path, SHARED, SHARED_MAX_TOKENS)
    engine = LLM(path, block_size=4).engine
    for i in range(3):
        engine.add_request(SHARED[i], SamplingParams(temperature=0, max_tokens=SHARED_MAX_TOKENS[i]), str(i))
    engine.step()
    engine.abort_request("0")
    outputs = serve_shared(engine, [3])
    assert outputs["3"].num_cached_tokens == 16  # request 0's blocks, still cached
    assert [outputs[str(i)].token_ids for i in (1, 2, 3)] == [expected[i] for i in (1, 2, 3)]
    small = LLM(path, block_size=4, num_kvcache_blocks=12, max_model_len=32).engine  # 11 blocks for 5 requests
    small.scheduler.blocks_to_keep_free = lambda: 0  # admit while blocks last, so that growth preempts
    outputs = serve_shared(small, range(5))
    assert small.scheduler.num_preemptions > 0
    assert [outputs[str(i)].token_ids for i in range(5)] == expected


def test_a_prompt_logprobs_request_takes_no_hit_but_its_blocks_serve_the_same_step(tiny_models):
    """Prompt logprobs need every prompt token's logits, so such a request takes no hit on blocks that
    no request sharing its prompt logprobs filled (here: none does), even blocks filled earlier in its own
    step; the blocks it fills serve the requests admitted after it. Catches: a hit that skips
    prompt-logprob rows, its blocks kept out of the cache, or rows that change with what shares the step."""
    path = tiny_models["gqa"]
    expected = reference(path, SHARED[:3], SHARED_MAX_TOKENS[:3])
    with_rows = SamplingParams(temperature=0, max_tokens=SHARED_MAX_TOKENS[1], prompt_logprobs=1)
    alone = LLM(path, block_size=4).generate([SHARED[1]], with_rows, use_tqdm=False)[0].prompt_logprobs
    for order, cached in (([1, 0, 2], [0, 16, 16]), ([0, 1, 2], [0, 0, 16])):
        engine = LLM(path, block_size=4).engine
        for i in order:
            engine.add_request(SHARED[i], with_rows if i == 1 else greedy(SHARED_MAX_TOKENS[i]), str(i))
        outputs = serve_shared(engine, [])
        assert [outputs[str(i)].token_ids for i in range(3)] == expected
        assert [outputs[str(i)].num_cached_tokens for i in order] == cached
        rows = outputs["1"].prompt_logprobs
        assert len(rows) == len(alone) == len(SHARED[1]) and rows[0] is alone[0] is None
        for got, want in zip(rows[1:], alone[1:]):
            assert got.keys() == want.keys()
            assert all(abs(got[t].logprob - want[t].logprob) < 1e-4 for t in got)
