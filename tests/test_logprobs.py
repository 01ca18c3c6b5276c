"""Logprobs and n, against transformers: the prompt's and the output's logprobs are log_softmax of
transformers' logits on the same weights (float32), whatever chunking, caching or preemption did;
n completions of one prompt are the n seeded requests seed, seed + 1, ..."""
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import greedy
from nanoserve import LLM, SamplingParams
from nanoserve.sampling_params import MAX_LOGPROBS, InvalidRequest

PROMPTS = [[1, 17, 42, 9, 200, 31, 77, 5, 64, 12, 90, 150, 3], [1, 17, 42, 9, 200, 31, 77, 5, 9], [1, 250]]
TOP = 3


def hf_logprobs(path: str, token_ids: list[int]) -> torch.Tensor:
    """[len, vocab]: row p is the log-distribution transformers gives for the token after position p."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([token_ids])).logits[0].float(), dim=-1)


def check_position(found: dict, row: torch.Tensor, token: int, num_top: int) -> None:
    """found = {token: Logprob, top...}: the token's logprob and rank, then the num_top most likely in order."""
    assert list(found)[0] == token
    assert found[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
    assert found[token].rank == 1 + (row > row[token]).sum().item()
    top = row.topk(num_top)
    others = {t: lp for t, lp in found.items() if t != token or found[t].rank <= num_top}
    assert sorted(others, key=lambda t: found[t].rank) == top.indices.tolist()
    assert [found[t].logprob for t in top.indices.tolist()] == pytest.approx(top.values.tolist(), abs=1e-4)


@pytest.mark.parametrize("setup", [dict(block_size=4), dict(block_size=4, max_num_batched_tokens=5),
                                   dict(block_size=4, num_kvcache_blocks=8, max_model_len=24)])
def test_prompt_and_output_logprobs_equal_transformers(tiny_models, setup):
    """Catches prompt logprobs shifted by one position, rows of a later prefill chunk mapped to the wrong
    tokens, a chunk's rows skipped, rows recollected after a preemption (duplicates), a second request's
    prompt logprobs cut short by a prefix-cache hit, and output logprobs taken after temperature."""
    path = tiny_models["gqa"]
    llm = LLM(path, **setup)
    params = [SamplingParams(temperature=0, max_tokens=10, logprobs=TOP, prompt_logprobs=TOP),
              SamplingParams(temperature=1.7, seed=3, max_tokens=10, logprobs=TOP, prompt_logprobs=TOP),
              SamplingParams(temperature=0, max_tokens=4)]  # asks for nothing: gets nothing
    prompts = [PROMPTS[1], PROMPTS[1], PROMPTS[2]]  # the repeat would hit the prefix cache
    outputs = llm.generate(prompts, params, use_tqdm=False)
    if "num_kvcache_blocks" in setup:
        assert llm.engine.scheduler.num_preemptions > 0
    # The repeat shares the first one's prompt logprobs, so it may take the blocks they were computed in
    assert outputs[0].num_cached_tokens == 0 and outputs[1].num_cached_tokens == 8
    for output in outputs[:2]:
        rows = hf_logprobs(path, output.prompt_token_ids + output.token_ids)
        assert len(output.prompt_logprobs) == len(output.prompt_token_ids)
        assert output.prompt_logprobs[0] is None
        for p, found in enumerate(output.prompt_logprobs[1:], start=1):
            check_position(found, rows[p - 1], output.prompt_token_ids[p], TOP)
        assert len(output.outputs[0].logprobs) == len(output.token_ids)
        for i, found in enumerate(output.outputs[0].logprobs):  # raw logits: not sharpened by temperature 1.7
            check_position(found, rows[len(output.prompt_token_ids) + i - 1], output.token_ids[i], TOP)
    assert outputs[2].prompt_logprobs is None and outputs[2].outputs[0].logprobs is None


def test_output_logprobs_are_those_of_the_rows_that_asked(tiny_models):
    """Two requests sample in every step, only the second asks for logprobs: they are its own row's.
    Catches logprobs read from the first len(rows) sampling rows (the first request's numbers)."""
    path = tiny_models["gqa"]
    llm = LLM(path, block_size=4)
    params = [greedy(6), SamplingParams(temperature=0, max_tokens=6, logprobs=TOP)]
    silent, asking = llm.generate([PROMPTS[0], PROMPTS[2]], params, use_tqdm=False)
    assert silent.outputs[0].logprobs is None and len(asking.outputs[0].logprobs) == 6
    rows = hf_logprobs(path, asking.prompt_token_ids + asking.token_ids)
    for i, found in enumerate(asking.outputs[0].logprobs):
        check_position(found, rows[len(asking.prompt_token_ids) + i - 1], asking.token_ids[i], TOP)


def test_unseeded_requests_draw_different_tokens(tiny_models):
    """Unseeded sampled requests share the global generator: two of the same prompt, or n=2 of one
    prompt, sample different tokens (16 tokens of a 256-token vocabulary at temperature 1: equal only
    by a fluke, and the global seed is fixed, so never here). Catches `for_sample` seeding an unseeded
    request with 0 + index, which makes every such request deterministic and equal to its twin."""
    torch.manual_seed(0)
    llm = LLM(tiny_models["gqa"], block_size=4)
    params = SamplingParams(temperature=1.0, max_tokens=16)
    twins = llm.generate([PROMPTS[1], PROMPTS[1]], params, use_tqdm=False)
    assert twins[0].token_ids != twins[1].token_ids
    siblings = llm.generate([PROMPTS[1]], replace(params, n=2), use_tqdm=False)[0].outputs
    assert siblings[0].token_ids != siblings[1].token_ids
    assert siblings[0].token_ids not in (twins[0].token_ids, twins[1].token_ids)


def test_logprobs_zero_is_the_token_alone_and_greedy_tokens_rank_first(tiny_models):
    llm = LLM(tiny_models["tied"], block_size=4)
    output = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=5, logprobs=0), use_tqdm=False)[0]
    assert [list(found) for found in output.outputs[0].logprobs] == [[t] for t in output.token_ids]
    assert all(found[t].rank == 1 for found, t in zip(output.outputs[0].logprobs, output.token_ids))


def test_streamed_deltas_carry_each_tokens_logprobs(tiny_models):
    """Catches a delta's logprobs taken from another token (the first, or the previous step's); the prompt
    logprobs missing from the first delta, or sent again with later ones."""
    engine = LLM(tiny_models["gqa"], block_size=4, max_num_batched_tokens=4).engine  # a prefill in 3 chunks
    engine.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=5, logprobs=2, prompt_logprobs=1), "a")
    deltas, outputs = [], []
    while engine.has_unfinished_requests():
        result = engine.step()
        deltas += result.deltas
        outputs += result.outputs
    assert [lp for d in deltas for lp in d.logprobs] == outputs[0].outputs[0].logprobs
    assert [list(lp)[0] for d in deltas for lp in d.logprobs] == outputs[0].token_ids
    assert deltas[0].prompt_logprobs == outputs[0].prompt_logprobs and len(outputs[0].prompt_logprobs) == 9
    assert [d.prompt_logprobs for d in deltas[1:]] == [None] * 4


def test_n_completions_are_the_seeded_requests_seed_plus_index(tiny_models):
    """n=3, seed 7: completion i is the request with seed 7 + i, sampled alone (vLLM's rule); catches
    children sharing one seed (identical completions), indices out of order, outputs of another prompt."""
    path = tiny_models["gqa"]
    llm = LLM(path, block_size=4)
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=8, n=3)
    both = llm.generate([PROMPTS[0], PROMPTS[2]], [params, greedy(5)], use_tqdm=False)
    alone = [llm.generate([PROMPTS[0]], SamplingParams(temperature=1.0, seed=7 + i, max_tokens=8), use_tqdm=False)[0]
             for i in range(3)]
    assert [c.index for c in both[0].outputs] == [0, 1, 2]
    assert [c.token_ids for c in both[0].outputs] == [o.token_ids for o in alone]
    assert len({tuple(c.token_ids) for c in both[0].outputs}) == 3
    assert len(both[1].outputs) == 1 and both[1].prompt_token_ids == PROMPTS[2]
    assert llm.engine.scheduler.block_manager.num_free_blocks == llm.engine.model_runner.num_blocks - 1


def test_n_samples_of_an_echoed_prompt_compute_it_once(tiny_models):
    """Echo with logprobs and n=8 (as the server submits it: n requests, SamplingParams.for_sample): the
    requests share the prompt logprobs, so the first computes the prompt and the others take its blocks
    from the prefix cache. Catches: prompt-logprob requests kept off the prefix cache (the prompt
    computed n times), a hit that skips rows (missing or misplaced ones), rows that differ between the
    samples or from one request alone, rows computed twice, and samples whose tokens change because they share."""
    path, n = tiny_models["gqa"], 8
    prompt = PROMPTS[0] * 3 + [7, 8, 9, 10]  # 43 tokens: 10 full blocks of 4, and 3
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=6, logprobs=2, prompt_logprobs=TOP, n=n)
    alone = LLM(path, block_size=4).generate(prompt, replace(params, n=1), use_tqdm=False)[0]
    plain = LLM(path, block_size=4).generate(prompt, replace(params, prompt_logprobs=None), use_tqdm=False)[0]
    engine = LLM(path, block_size=4).engine
    ids = [engine.add_request(prompt, params.for_sample(i)) for i in range(n)]
    outputs, num_prompt_tokens_run, num_rows = {}, 0, 0
    while engine.has_unfinished_requests():
        result = engine.step()
        num_prompt_tokens_run += result.num_prefill_tokens
        num_rows += result.batch.next_token_ids.numel()  # prompt-logprob rows computed
        outputs.update((o.request_id, o) for o in result.outputs)
    # The prompt once; each other sample takes its 10 full blocks from the cache and runs the last 3 tokens,
    # whose prompt logprobs the first computes: each row once.
    assert num_prompt_tokens_run == len(prompt) + (n - 1) * 3 and num_rows == len(prompt) - 1
    assert [outputs[i].num_cached_tokens for i in ids] == [0] + [40] * (n - 1)
    shared = outputs[ids[0]].prompt_logprobs
    assert all(outputs[request_id].prompt_logprobs == shared for request_id in ids)  # one computation: bit for bit
    # As one request alone computes them, up to float32 rounding: its batch (43 tokens, not 64) differs.
    assert len(shared) == len(alone.prompt_logprobs) == len(prompt) and shared[0] is None
    for found, want in zip(shared[1:], alone.prompt_logprobs[1:]):
        assert [(t, lp.rank) for t, lp in found.items()] == [(t, lp.rank) for t, lp in want.items()]
        assert [lp.logprob for lp in found.values()] == pytest.approx([lp.logprob for lp in want.values()], abs=1e-5)
    assert [outputs[request_id].token_ids for request_id in ids] == [c.token_ids for c in plain.outputs]


@pytest.mark.parametrize("field, value", [("logprobs", MAX_LOGPROBS + 1), ("prompt_logprobs", -1), ("n", 0),
                                          ("logprobs", 2.0), ("n", True)])
def test_bad_logprobs_and_n_are_refused_naming_the_field(field, value):
    with pytest.raises(InvalidRequest, match=field) as error:
        SamplingParams(**{field: value})
    assert error.value.param == field


def test_the_engine_serves_one_completion_per_request(tiny_models):
    engine = LLM(tiny_models["gqa"], block_size=4).engine
    with pytest.raises(InvalidRequest, match="n=2") as error:
        engine.add_request(PROMPTS[0], SamplingParams(n=2))
    assert error.value.param == "n" and not engine.has_unfinished_requests()
