"""Nothing lost, nothing leaked: random workloads with the invariants checked after every step.

First, many random workloads through Scheduler + BlockManager + build_batch only. The model is a
fake: the KV it stores for a token is a hash of the whole prefix up to that token (as real K/V
depends on everything before it), and the token it samples is a function of the KV the request's
block table reads back. So a request that reads a slot another request overwrote, or loses a token
in a preemption, sees different KV and the test fails. Then a few random workloads end to end
through LLMEngine on a tiny Llama, compared with transformers.
"""
import random
from dataclasses import dataclass

from hypothesis import example, given, settings, strategies as st

from conftest import hf_greedy
from nanoserve import LLM, SamplingParams
from nanoserve.batch import build_batch
from nanoserve.config import Config
from nanoserve.sampler import SamplerOutput
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
        requests.append(Request(prompt, max_tokens=draw(st.integers(1, max_model_len)),
                                arrival_step=draw(st.integers(0, 10)),
                                abort_step=draw(st.none() | st.none() | st.integers(0, 40)),
                                stop_token_ids=draw(st.lists(st.integers(0, VOCAB - 1), max_size=1)),
                                ignore_eos=draw(st.booleans())))
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
    """Write this step's KV by slot_mapping, read each request's context through its block table
    (as attention does) and check it is exactly the request's tokens; sample the fake next token."""
    batch = build_batch(scheduled, block_size, "cpu")
    positions = [p for seq, n in scheduled for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n)]
    slots = [seq.block_table[p // block_size] * block_size + p % block_size
             for seq, n in scheduled for p in range(seq.num_computed_tokens, seq.num_computed_tokens + n)]
    assert batch.positions.tolist() == positions and batch.slot_mapping.tolist() == slots
    new_kv = [kv for seq, n in scheduled for kv in kv_of(seq.token_ids)[seq.num_computed_tokens:][:n]]
    kv_cache.update(zip(slots, new_kv))
    sampled = []
    for (seq, num_new), table, seq_len in zip(scheduled, batch.block_tables.tolist(), batch.seq_lens.tolist()):
        context = [kv_cache.get(table[p // block_size] * block_size + p % block_size) for p in range(seq_len)]
        assert context == kv_of(seq.token_ids[:seq_len]), f"{seq} reads KV that is not its own"
        if seq.num_computed_tokens + num_new == seq.num_tokens:
            sampled.append(next_token(context))
    return SamplerOutput(sampled, [None] * len(sampled), [])


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


@settings(max_examples=200, deadline=None, database=None)
@given(workloads())
@example(MID_BLOCK_PREFIX_HIT)
def test_random_workloads_keep_every_invariant(w: Workload):
    sched = Scheduler(w.config, w.num_blocks, w.config.block_size, w.max_model_len, eos_token_ids=w.eos_token_ids)
    seqs = [Sequence(str(i), None, r.prompt, SamplingParams(temperature=0, max_tokens=r.max_tokens,
                                                            stop_token_ids=r.stop_token_ids, ignore_eos=r.ignore_eos))
            for i, r in enumerate(w.requests)]
    kv_cache: dict[int, int] = {}
    last_arrival = max(r.arrival_step for r in w.requests)
    # Each step the oldest running request runs >= 1 token and is never preempted (it always fits
    # alone), so every request finishes within len(prompt) + max_tokens steps of reaching the front.
    max_steps = last_arrival + sum(len(r.prompt) + r.max_tokens for r in w.requests) + 2
    for step in range(max_steps):
        for seq, r in zip(seqs, w.requests):
            if r.arrival_step == step:
                sched.add(seq)
            if r.abort_step == step and r.arrival_step <= step and not seq.is_finished:
                sched.finish(seq, "abort")
        sched.assert_invariants()
        if step >= last_arrival and not sched.has_unfinished():
            break
        scheduled = sched.schedule()
        sched.assert_invariants(scheduled)
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
    sampled = {i: SamplingParams(temperature=0.9, top_p=0.95, max_tokens=16, seed=i, stop_token_ids=[rng.randrange(3, 256)])
               for i in (1, 4, 6)}
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
                    engine.add_request(prompts[i], sampled.get(i, SamplingParams(temperature=0, max_tokens=max_tokens[i])), f"s{i}")
            outputs.update((o.request_id, o) for o in engine.step().outputs)
            engine.assert_invariants()
            step += 1
        assert [outputs[str(i)].token_ids for i in range(len(prompts))] == expected, (block_size, num_blocks, budget)
        for i, want in expected_sampled.items():
            got = outputs[f"s{i}"]
            assert (got.token_ids, got.finish_reason) == (want.token_ids, want.finish_reason), (i, block_size)
        num_preemptions += engine.scheduler.num_preemptions
    assert num_preemptions > 0
