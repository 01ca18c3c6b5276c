"""The drafter seam, proven with a second drafter: `FixedProposer` proposes tokens from a fixed script (the output
the test knows is coming, some made wrong on purpose) and plugs into the same seam as the n-gram proposer
(extensions/spec_decode.py's Speculator, the scheduler's Drafter). So the rules every drafter goes through are
tested on drafts the test controls: greedy output exact, seeded sampling unchanged, a stop inside an accepted run,
preemption after a draft, and no step computing again a position whose KV an earlier step computed and kept."""
import math
from dataclasses import replace

import conftest
import nanoserve.engine
from conftest import greedy
from nanoserve import SamplingParams
from nanoserve.composition import build_seams
from nanoserve.config import Config, SpeculativeConfig
from nanoserve.extensions.spec_decode import Speculator

K = 4  # drafts a step
SPEC = {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
        "disable_by_batch_size": 64}
PROMPTS = [[1] + [5, 6, 7, 8, 9, 10, 11] * 4, [1, 20, 21, 22, 23, 20, 21], [1, 30, 31, 32, 33, 34] * 3,
           [1] + list(range(40, 70)) + list(range(40, 50)), [1, 3, 3]]
MAX_TOKENS = [40, 23, 31, 17, 26]


class FixedProposer:
    """For a request whose tokens so far begin one of `scripts`, the script's next k tokens; every `wrong`-th
    proposed token (if given) is changed, so that the step rejects it and rolls back. Counts its calls."""

    def __init__(self, scripts: list[list[int]], wrong: int | None = None) -> None:
        self.scripts, self.wrong, self.calls = scripts, wrong, 0

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        self.calls += 1
        script = next((s for s in self.scripts if s[:len(token_ids)] == token_ids), None)
        if script is None:
            return []
        drafts = script[len(token_ids):len(token_ids) + k]
        return [t + 1 if self.wrong and (i + 1) % self.wrong == 0 else t for i, t in enumerate(drafts)]


def engine_with(path: str, proposer: FixedProposer, **options) -> nanoserve.engine.LLMEngine:
    """The full engine but for its drafter: the Speculator over `proposer`, through the same seam."""
    config = Config.from_kwargs(path, speculative_config=SPEC, **options)
    drafter = Speculator(SpeculativeConfig.from_dict(SPEC), proposer.propose)
    return nanoserve.engine.LLMEngine(config, replace(build_seams(config), drafter=drafter))


def run(engine: nanoserve.engine.LLMEngine, prompts: list[list[int]], params: list[SamplingParams],
        recompute_allowed: bool = False) -> tuple[list, list]:
    """Every request queued at once and stepped to the end, invariants checked after each step; unless
    `recompute_allowed` (preemption recomputes by design), also that no step runs a position of a request whose
    KV an earlier step computed and kept. Returns the outputs in request order and the StepResults."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    kept: dict[str, int] = {}  # request id -> its leading positions whose KV is computed and kept
    outputs, steps = {}, []
    while engine.has_unfinished_requests():
        step = engine.step()
        steps.append(step)
        engine.assert_invariants()
        outputs |= {o.request_id: o for o in step.outputs}
        if step.batch is None:
            continue
        starts, positions = step.batch.query_start_loc_cpu, step.batch.positions.tolist()
        for i, (request_id, _) in enumerate(step.scheduled):
            first, last = positions[starts[i]], positions[starts[i + 1] - 1]
            assert recompute_allowed or first >= kept.get(request_id, 0), f"{request_id} recomputed {first}"
            if request_id in engine.requests:  # the last token's KV is written next step; rejected drafts' never
                kept[request_id] = min(last + 1, engine.requests[request_id].num_tokens - 1)
    return [outputs[i] for i in ids], steps


def scheduled_tokens(steps: list, request_id: str) -> int:
    return sum(n for step in steps for rid, n in step.scheduled if rid == request_id)


def test_always_right_drafts_take_the_fewest_steps(tiny_models):
    """Drafts that are always right: 1 + ceil((max_tokens - 1) / (K + 1)) steps (the prefill, then K accepted and
    one sampled token a step), every position run once. Catches accepted drafts rolled back too (tokens still
    exact, but recomputed: more steps and fewer drafts), and drafts not offered where they fit."""
    path, prompt, max_tokens = tiny_models["gqa"], PROMPTS[0], MAX_TOKENS[0]
    expected = conftest.reference(path, [prompt], [max_tokens])[0]
    engine = engine_with(path, FixedProposer([prompt + expected]), block_size=4)
    outputs, steps = run(engine, [prompt], [greedy(max_tokens)])
    assert outputs[0].token_ids == expected
    assert len(steps) == 1 + math.ceil((max_tokens - 1) / (K + 1))
    stats = engine.stats()
    assert stats["num_drafts"] == len(steps) - 1 and stats["num_accepted_tokens"] == stats["num_draft_tokens"]
    assert scheduled_tokens(steps, outputs[0].request_id) == len(prompt) + len(expected) - 1  # each position once


def test_greedy_is_exact_with_wrong_drafts_and_no_position_is_computed_twice(tiny_models):
    """Drafts partly wrong (every 3rd, or every 2nd): output token-exact with transformers; no step runs a
    position an earlier one computed and kept (`run` checks), only the rejected drafts' again. Catches a rejected
    draft kept, an accepted one dropped, and a rollback over accepted drafts."""
    path = tiny_models["gqa"]
    expected = conftest.reference(path, PROMPTS, MAX_TOKENS)
    for wrong in (3, 2):
        proposer = FixedProposer([p + e for p, e in zip(PROMPTS, expected)], wrong)
        engine = engine_with(path, proposer, block_size=4)
        outputs, _ = run(engine, PROMPTS, [greedy(n) for n in MAX_TOKENS])
        assert [o.token_ids for o in outputs] == expected
        stats = engine.stats()
        rejected = stats["num_draft_tokens"] - stats["num_accepted_tokens"]
        assert stats["num_accepted_tokens"] > 0 and rejected > 0 and proposer.calls > 0


def test_seeded_sampling_is_unchanged_by_fixed_drafts(tiny_models):
    """Seeded sampling with drafts (the seeded output itself, partly wrong) gives the tokens it gives without.
    Catches a draft row sampled with another position's noise."""
    path = tiny_models["gqa"]
    params = [SamplingParams(temperature=0.8, top_k=20, seed=s, max_tokens=n) for s, n in enumerate(MAX_TOKENS)]
    plain = nanoserve.engine.LLMEngine(Config.from_kwargs(path, block_size=4))
    without = [o.token_ids for o in run(plain, PROMPTS, params)[0]]
    engine = engine_with(path, FixedProposer([p + t for p, t in zip(PROMPTS, without)], wrong=3), block_size=4)
    assert [o.token_ids for o in run(engine, PROMPTS, params)[0]] == without
    assert engine.stats()["num_accepted_tokens"] > 0


def test_stops_inside_an_accepted_run(tiny_models):
    """With always-right drafts a decode step appends K + 1 tokens; max_tokens, or a stop token, that falls
    inside such a run ends the request right there. Catches tokens appended past a stop in the same step."""
    path, prompt = tiny_models["gqa"], PROMPTS[0]
    expected = conftest.reference(path, [prompt], [MAX_TOKENS[0]])[0]
    end = 1 + (K + 1) + 2  # the prefill's token, one full run, then 2 tokens into the next run
    engine = engine_with(path, FixedProposer([prompt + expected]), block_size=4)
    out = run(engine, [prompt], [greedy(end)])[0][0]
    assert (out.token_ids, out.finish_reason) == (expected[:end], "length")
    stop = next(i for i in range(end - 1, len(expected) - 2) if expected[i] not in expected[:i])  # first at i
    if (stop - 1) % (K + 1) != K:  # not the last token of a run: inside one
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS[0], stop_token_ids=[expected[stop]])
        out = run(engine, [prompt], [params])[0][0]
        assert (out.token_ids, out.finish_reason) == (expected[:stop + 1], "stop")


def test_preemption_after_a_draft(tiny_models):
    """Few KV blocks: requests with drafts are preempted and recomputed; output token-exact with transformers,
    the blocks all back at the end. Catches drafts kept across a preemption, or their blocks leaked."""
    path = tiny_models["gqa"]
    expected = conftest.reference(path, PROMPTS, MAX_TOKENS)
    proposer = FixedProposer([p + e for p, e in zip(PROMPTS, expected)], wrong=3)
    engine = engine_with(path, proposer, block_size=4, num_kvcache_blocks=22, max_model_len=80)
    outputs, _ = run(engine, PROMPTS, [greedy(n) for n in MAX_TOKENS], recompute_allowed=True)
    assert [o.token_ids for o in outputs] == expected
    stats = engine.stats()
    assert stats["num_preemptions"] > 0 and stats["num_drafts"] > 0
    assert engine.scheduler.block_manager.num_free_blocks == engine.model_runner.num_blocks - 1
