"""A request's life in the engine: aborts in every state, blocks back in the step a request ends,
memory pressure, metrics, start-up checks, bad input that leaves the engine serving, determinism."""
import gc
import random
import shutil
import sys
from collections.abc import Callable
from functools import partial

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2Config

import conftest
from conftest import greedy
from nanoserve import DEFAULT_MODEL, LLM, LLMEngine, SamplingParams
from nanoserve.sequence import SequenceStatus

rng = random.Random(1)
PREFIX = [rng.randrange(3, 256) for _ in range(8)]
PROMPTS = [PREFIX + [rng.randrange(3, 256) for _ in range(5)],
           [rng.randrange(3, 256) for _ in range(5)],
           [rng.randrange(3, 256) for _ in range(22)],
           PREFIX + [rng.randrange(3, 256)],
           [rng.randrange(3, 256) for _ in range(17)],
           [rng.randrange(3, 256)]]
MAX_TOKENS = [19, 20, 10, 6, 12, 3]

def reference(path: str) -> list[list[int]]:
    """transformers' greedy output for PROMPTS (computed once per model)."""
    return conftest.reference(path, PROMPTS, MAX_TOKENS)


def run_to_completion(engine: LLMEngine) -> dict[str, list[int]]:
    """Step until every request has finished, checking the invariants after each step."""
    outputs = {}
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            return outputs
        outputs.update((o.request_id, o.token_ids) for o in engine.step().outputs)
        engine.assert_invariants()
    raise AssertionError("requests did not finish in 1000 steps")


# ---------------------------------------------------------------------------------------------
# Aborts

def reach(engine: LLMEngine, done: Callable[[], bool], what: str) -> None:
    """Step until `done()`."""
    for _ in range(50):
        if done():
            return
        engine.step()
    raise AssertionError(f"never reached: {what}")


@pytest.mark.parametrize("state", ["waiting", "prefilling", "decoding", "preempted"])
def test_abort_in_any_state_frees_blocks_at_once(tiny_models, state):
    path = tiny_models["gqa"]
    config = dict(block_size=4, max_num_batched_tokens=8 if state == "prefilling" else 2048,
                  max_num_seqs=1 if state == "waiting" else 8)
    if state == "preempted":  # 8 usable blocks; the requests grow to 8 and 7 blocks
        config.update(num_kvcache_blocks=9, max_model_len=32)
    engine = LLM(path, **config).engine
    victim, other = (2, 1) if state == "prefilling" else (1, 0)  # PROMPTS[2] has 22 tokens: 3 chunks
    # A waiting or preempted victim came second; a prefilling or decoding one first.
    order = (victim, other) if state in ("prefilling", "decoding") else (other, victim)
    ids = {i: engine.add_request(PROMPTS[i], greedy(MAX_TOKENS[i])) for i in order}
    victim_id, other_id = ids[victim], ids[other]
    seq = engine.requests[victim_id]
    reach(engine, {
        "waiting": lambda: engine.requests[other_id].status is SequenceStatus.RUNNING,
        "prefilling": lambda: 0 < seq.num_computed_tokens < seq.num_prompt_tokens,
        "decoding": lambda: len(seq.output_token_ids) >= 3,
        "preempted": lambda: seq.status is SequenceStatus.WAITING and len(seq.output_token_ids) > 0,
    }[state], state)
    bm = engine.scheduler.block_manager
    own_blocks = [b for b in seq.block_table if bm.blocks[b].ref_cnt == 1]
    # A prefilling or decoding victim holds blocks of its own; a waiting or preempted one none.
    assert bool(own_blocks) == (state in ("prefilling", "decoding")), (state, seq.block_table)
    num_free = bm.num_free_blocks
    output = engine.abort_request(victim_id)
    assert output.finish_reason == "abort" and output.token_ids == reference(path)[victim][:len(output.token_ids)]
    # No token yet (waiting, prefilling): no time to a first token, rather than a made-up one.
    assert (output.ttft is None) == (state in ("waiting", "prefilling")) and output.latency > 0
    assert bm.num_free_blocks == num_free + len(own_blocks) and all(b in bm.free_queue for b in own_blocks)
    assert seq.status is SequenceStatus.FINISHED and victim_id not in engine.requests
    assert seq not in engine.scheduler.waiting and seq not in engine.scheduler.running
    engine.assert_invariants()
    # The abort is reported once more, by the next step, so a loop over step() sees every request end.
    assert run_to_completion(engine) == {other_id: reference(path)[other], victim_id: output.token_ids}
    assert bm.num_free_blocks == engine.model_runner.num_blocks - 1


def test_abort_of_an_unknown_or_finished_request_is_a_value_error(tiny_models):
    engine = LLM(tiny_models["gqa"], block_size=4).engine
    with pytest.raises(ValueError, match="no unfinished request with id 'nope'"):
        engine.abort_request("nope")
    done = engine.add_request(PROMPTS[5], greedy(1))
    run_to_completion(engine)
    with pytest.raises(ValueError, match=f"no unfinished request with id '{done}'"):
        engine.abort_request(done)


def python_instructions(work: Callable[[], object]) -> int:
    """How many bytecode instructions work() runs: its Python work. C code (a dict lookup, a deque scan)
    counts nothing; the collector is paused, so that no gc callback runs Python code at random."""
    count = 0

    def trace(frame, event, arg):
        nonlocal count
        frame.f_trace_opcodes = True
        count += event == "opcode"
        return trace
    previous = sys.gettrace()
    gc.disable()
    sys.settrace(trace)
    try:
        work()
    finally:
        sys.settrace(previous)
        gc.enable()
    return count


def test_the_python_work_of_an_abort_does_not_grow_with_the_queue(tiny_models):
    # The bug it catches: a Python loop over the queued requests on each abort (a queue rebuilt without
    # the request, a count of the live ones recomputed, a search of what was aborted since the last step),
    # quadratic in an abort storm. (A scan in C, deque.remove, test_scheduler.py catches by its comparisons.)
    engine = LLM(tiny_models["gqa"], block_size=4).engine
    work = []  # per abort
    for num_queued in (1_000, 10_000):
        ids = [engine.add_request(PROMPTS[1], greedy(2)) for _ in range(num_queued)]
        victims = random.Random(0).sample(ids, num_queued // 10)
        work += [python_instructions(partial(engine.abort_request, request_id)) for request_id in victims]
        assert engine.stats()["num_waiting"] == num_queued - len(victims)
        engine.discard(ids)
        assert len(engine.step().outputs) == len(victims) and not engine.has_unfinished_requests()
    # The same for each, whether the queue holds 1,000 or 10,000 requests and whether 0 or 999 went before it.
    assert min(work) == max(work) > 0


def test_survivors_of_an_abort_storm_are_served_as_if_alone(tiny_models):
    # The bug it catches: an abort that removes, frees or reports the wrong request, or leaves a block
    # held, when most of the queue goes at once and the rest runs on (some aborted while running).
    path = tiny_models["gqa"]
    engine = LLM(path, block_size=4, max_num_seqs=16).engine
    doomed, params = [], greedy(30)
    for i, (prompt, max_tokens) in enumerate(zip(PROMPTS, MAX_TOKENS)):  # survivors among the doomed
        engine.add_request(prompt, greedy(max_tokens), f"survivor {i}")
        doomed += [engine.add_request(PROMPTS[j % len(PROMPTS)], params) for j in range(1_000)]
    for _ in range(3):  # some doomed ones run, some are prefilled; the rest wait
        engine.step()
    outputs = {}
    for request_id in random.Random(0).sample(doomed, len(doomed)):
        outputs[request_id] = engine.abort_request(request_id).token_ids
    engine.assert_invariants()
    assert engine.stats()["num_waiting"] + engine.stats()["num_running"] == len(PROMPTS)
    assert run_to_completion(engine) == outputs | {f"survivor {i}": tokens for i, tokens in enumerate(reference(path))}
    bm = engine.scheduler.block_manager
    assert bm.num_free_blocks == engine.model_runner.num_blocks - 1
    assert any(tokens for tokens in outputs.values())  # some were aborted mid-decode


def test_finished_requests_free_their_blocks_in_the_same_step(tiny_models):
    path = tiny_models["gqa"]
    engine = LLM(path, block_size=4, max_num_batched_tokens=16).engine
    ids = [engine.add_request(p, greedy(n)) for p, n in zip(PROMPTS, MAX_TOKENS)]
    bm, outputs = engine.scheduler.block_manager, {}
    while engine.has_unfinished_requests():
        held = {request_id: list(seq.block_table) for request_id, seq in engine.requests.items()}
        result = engine.step()
        still_held = {b for seq in engine.requests.values() for b in seq.block_table}
        for output in result.outputs:
            outputs[output.request_id] = output.token_ids
            assert all(b in bm.free_queue for b in held[output.request_id] if b not in still_held)
    assert [outputs[i] for i in ids] == reference(path)
    assert bm.num_free_blocks == engine.model_runner.num_blocks - 1


# ---------------------------------------------------------------------------------------------
# Memory pressure and metrics

def test_heavy_load_in_a_barely_big_enough_cache(tiny_models):
    path = tiny_models["gqa"]
    load_rng = random.Random(7)
    prompts = [PREFIX[:load_rng.randrange(9)] + [load_rng.randrange(3, 256) for _ in range(load_rng.randrange(1, 30))]
               for _ in range(16)]
    params = [greedy(load_rng.randrange(1, 64 - len(p))) for p in prompts]
    roomy = LLM(path, block_size=4, max_model_len=64)
    # In two rounds, so that the second finds the first's prefixes in the cache.
    expected = roomy.generate(prompts[:4], params[:4], use_tqdm=False)
    expected += roomy.generate(prompts[4:], params[4:], use_tqdm=False)
    assert roomy.engine.stats()["num_cached_tokens"] == sum(o.num_cached_tokens for o in expected) > 0
    # One block more than a 64-token request needs: requests mostly run one or two at a time.
    tight = LLM(path, block_size=4, max_model_len=64, num_kvcache_blocks=17, max_num_batched_tokens=32)
    preempted = []  # counted here, independently of the counter that stats() reports
    preempt = tight.engine.scheduler.preempt
    tight.engine.scheduler.preempt = lambda seq: (preempted.append(seq.request_id), preempt(seq))
    outputs = tight.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    assert all(o.finish_reason == "length" and o.num_cached_tokens < len(o.prompt_token_ids) for o in outputs)
    stats = tight.engine.stats()
    assert stats["num_preemptions"] == len(preempted) > 0
    assert stats["num_cached_tokens"] == sum(o.num_cached_tokens for o in outputs)
    assert (stats["num_waiting"], stats["num_running"], stats["num_free_blocks"]) == (0, 0, 16)


def test_a_cache_too_small_for_one_request_is_rejected_with_the_numbers(tiny_models):
    path = tiny_models["gqa"]
    with pytest.raises(ValueError) as error:
        LLM(path, block_size=4, num_kvcache_blocks=16, max_model_len=64)
    for numbers in ("15 usable blocks", "4 slots", "60 tokens", "max_model_len=64"):
        assert numbers in str(error.value)
    # One block more is enough, even for a prompt that fills max_model_len with its output.
    prompt = PROMPTS[2] * 3  # 66 tokens: cut to 60
    output = LLM(path, block_size=4, num_kvcache_blocks=17, max_model_len=64).generate(
        [prompt[:60]], [greedy(10)], use_tqdm=False)[0]
    assert (output.token_ids, output.finish_reason) == (conftest.reference(path, [prompt[:60]], [4])[0], "length")


# ---------------------------------------------------------------------------------------------
# Bad input: a clear error, and the engine (or the next engine) serves the next request normally

@pytest.fixture(scope="module")
def llm(tiny_models) -> LLM:
    return LLM(tiny_models["gqa"], block_size=4)


def serves_normally(llm: LLM) -> None:
    assert not llm.engine.has_unfinished_requests()
    outputs = llm.generate(PROMPTS[3:], [greedy(n) for n in MAX_TOKENS[3:]], use_tqdm=False)
    assert [o.token_ids for o in outputs] == reference(llm.engine.config.model)[3:]
    llm.engine.assert_invariants()


def rejected_mid_flight(llm: LLM, call: Callable[[], object], message: str) -> None:
    """`call` raises a ValueError matching `message` while a request is half done, and that request
    still finishes exactly as it would have alone."""
    engine = llm.engine
    request_id = engine.add_request(PROMPTS[2], greedy(MAX_TOKENS[2]))
    engine.step()
    with pytest.raises(ValueError, match=message):
        call()
    engine.assert_invariants()
    assert run_to_completion(engine) == {request_id: reference(engine.config.model)[2]}
    serves_normally(llm)


@pytest.mark.parametrize("prompt, params, request_id, message", [
    (PROMPTS[1], dict(max_tokens=5), None, "must be a SamplingParams"),
    ([[1, 2]], None, None, "list of int"),
    ([True, 5], None, None, "list of int"),
    (None, None, None, "string or a list"),
    ([1] * 257, None, None, "more than max_model_len=256"),
    (PROMPTS[1], SamplingParams(stop_token_ids=[3, 10**9]), None, r"stop_token_ids \[1000000000\] are outside"),
    (PROMPTS[1], None, 5, "request_id must be a str"),
    (PROMPTS[1], None, ["unhashable"], "request_id must be a str"),
])
def test_bad_request_is_rejected_and_the_engine_keeps_serving(llm, prompt, params, request_id, message):
    rejected_mid_flight(llm, lambda: llm.engine.add_request(prompt, params, request_id), message)


@pytest.mark.parametrize("prompts, message", [
    ((p for p in PROMPTS), "prompts must be a string, a list of token ids, or a list of those"),
    ({"a": 1}, "prompts must be"),
])
def test_prompts_that_are_no_list_are_refused_by_generate(llm, prompts, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(prompts, use_tqdm=False)
    serves_normally(llm)


def test_a_lone_surrogate_is_a_value_error_and_generate_takes_back_its_prompts():
    llm = LLM(DEFAULT_MODEL)
    with pytest.raises(ValueError, match="not valid Unicode"):
        llm.generate(["It is a truth", "\ud800"], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.stats()["num_free_blocks"] == llm.engine.model_runner.num_blocks - 1


@pytest.mark.parametrize("error", [RuntimeError("boom"), KeyboardInterrupt()])
def test_generate_leaves_the_engine_idle_whatever_fails_in_a_step(tiny_models, error):
    llm = LLM(tiny_models["gqa"], block_size=4)
    run, calls = llm.engine.model_runner.run, []

    def fail_on_the_third_step(*args):
        calls.append(1)
        if len(calls) == 3:
            raise error
        return run(*args)
    llm.engine.model_runner.run = fail_on_the_third_step
    with pytest.raises(type(error)):
        llm.generate(PROMPTS, [greedy(n) for n in MAX_TOKENS], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.stats()["num_free_blocks"] == llm.engine.model_runner.num_blocks - 1
    assert llm.engine.step().outputs == []  # the aborts were reported by raising, not left for a step
    serves_normally(llm)


def test_generate_returns_when_one_of_its_requests_is_aborted(tiny_models):
    """Aborted between two of generate's steps (as another part of the program might, through
    llm.engine): generate returns it with finish_reason "abort" instead of waiting for it forever."""
    path = tiny_models["gqa"]
    llm = LLM(path, block_size=4)
    step, steps = llm.engine.step, []

    def abort_before_the_third_step():
        steps.append(1)
        if len(steps) == 3:
            llm.engine.abort_request("1")
        return step()
    llm.engine.step = abort_before_the_third_step
    outputs = llm.generate(PROMPTS, [greedy(n) for n in MAX_TOKENS], use_tqdm=False)
    assert outputs[1].finish_reason == "abort" and 0 < len(outputs[1].token_ids) < MAX_TOKENS[1]
    assert outputs[1].token_ids == reference(path)[1][:len(outputs[1].token_ids)]
    expected = reference(path)
    assert [o.token_ids for i, o in enumerate(outputs) if i != 1] == [r for i, r in enumerate(expected) if i != 1]
    assert llm.engine.stats()["num_free_blocks"] == llm.engine.model_runner.num_blocks - 1


def test_a_duplicate_request_id_leaves_the_first_request_alone(llm):
    llm.engine.add_request(PROMPTS[0], greedy(MAX_TOKENS[0]), request_id="a")
    with pytest.raises(ValueError, match="already in use"):
        llm.engine.add_request(PROMPTS[1], greedy(5), request_id="a")
    assert run_to_completion(llm.engine) == {"a": reference(llm.engine.config.model)[0]}
    with pytest.raises(ValueError, match="2 sampling_params for 1 prompts"):
        llm.generate([PROMPTS[0]], [greedy(1), greedy(1)], use_tqdm=False)
    serves_normally(llm)


@pytest.mark.parametrize("kwargs, message", [
    (dict(block_size=0), "block_size"),
    (dict(max_num_seqs=-1), "max_num_seqs"),
    (dict(max_num_batched_tokens=1.5), "max_num_batched_tokens"),
    (dict(num_kvcache_blocks=1), "num_kvcache_blocks"),
    (dict(scheduling="fifo"), "scheduling"),
    (dict(dtype="int8"), "dtype"),
    (dict(gpu_memory_utilization=0), "gpu_memory_utilization"),
    (dict(max_model_len=512), "exceeds the model's max_position_embeddings=256"),
    (dict(block_size=512), "block_size=512 is larger than max_model_len=256"),
    (dict(block_size=257, max_model_len=64), "block_size=257 is larger than max_model_len=64 and than 256"),
    (dict(device="nope"), "not a device name"),
    (dict(device=3), "device must be a str"),
    (dict(gpu_memory_utilization="0.5"), "gpu_memory_utilization"),
    (dict(num_kvcache_blocks=10**12), "GiB for the KV cache, but only"),
    (dict(enable_prefix_caching="no"), "enable_prefix_caching"),
])
def test_bad_config_then_a_normal_engine(tiny_models, llm, kwargs, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_models["gqa"], **kwargs)
    serves_normally(llm)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_model_and_device_that_cannot_be_had_are_value_errors():
    with pytest.raises(ValueError, match="model must be a path"):
        LLM(None)
    with pytest.raises(ValueError, match="'cuda' is not available"):
        LLM(DEFAULT_MODEL, device="cuda")


def drop_a_tensor(path: str) -> None:  # as in test_llama, but through LLM
    tensors = load_file(f"{path}/model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})


def reshape_a_tensor(path: str) -> None:
    tensors = load_file(f"{path}/model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("damage, message", [
    (drop_a_tensor, r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"),
    (reshape_a_tensor, r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape"),
    (lambda path: GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(path), "'gpt2'"),
])
def test_bad_checkpoint_then_a_normal_engine(tiny_models, llm, tmp_path, damage, message):
    path = str(tmp_path / "model")
    shutil.copytree(tiny_models["gqa"], path)
    damage(path)
    with pytest.raises(ValueError, match=message):
        LLM(path)
    serves_normally(llm)


# ---------------------------------------------------------------------------------------------
# Determinism

MIXES = [  # (indices of PROMPTS in arrival order, engine config)
    ([3, 0, 5], dict(block_size=4)),
    ([2, 1, 4, 0, 3], dict(block_size=1, max_num_batched_tokens=7)),
    ([5, 4, 3, 2, 1, 0], dict(block_size=4, num_kvcache_blocks=9, max_model_len=32)),  # preempts
    ([0, 3], dict(block_size=16, scheduling="static")),
]


def test_greedy_output_does_not_depend_on_the_batch(tiny_models):
    path = tiny_models["gqa"]
    alone = LLM(path, block_size=4)
    expected = [alone.generate([p], [greedy(n)], use_tqdm=False)[0].token_ids for p, n in zip(PROMPTS, MAX_TOKENS)]
    assert expected == reference(path)
    for order, config in MIXES:
        outputs = LLM(path, **config).generate([PROMPTS[i] for i in order], [greedy(MAX_TOKENS[i]) for i in order],
                                               use_tqdm=False)
        assert [o.token_ids for o in outputs] == [expected[i] for i in order], config


def test_a_seeded_request_gives_the_same_tokens_in_any_mix(tiny_models):
    path = tiny_models["gqa"]
    seeded = SamplingParams(temperature=0.8, top_k=40, max_tokens=20, seed=7)
    alone = LLM(path, block_size=4).generate([PROMPTS[1]], [seeded], use_tqdm=False)[0].token_ids
    for order, config in MIXES:
        order = order if 1 in order else order + [1]
        # The seeded request arrives among unseeded sampled ones.
        params = [seeded if i == 1 else SamplingParams(max_tokens=MAX_TOKENS[i]) for i in order]
        outputs = LLM(path, **config).generate([PROMPTS[i] for i in order], params, use_tqdm=False)
        assert outputs[order.index(1)].token_ids == alone, config


def test_numpy_token_ids_are_token_ids(llm):
    import numpy as np
    # A prompt read from an array holds np.int64, not int: it must not be "not a list of int token ids".
    [out] = llm.generate(list(np.array(PROMPTS[3])), greedy(MAX_TOKENS[3]), use_tqdm=False)
    assert out.token_ids == reference(llm.engine.config.model)[3] and type(out.prompt_token_ids[0]) is int
