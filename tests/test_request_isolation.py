"""One request's failure is its own (logits_processors.py, structured_outputs.py, engine.py): a grammar that
allows no token, a logits processor that raises, a compile that fails while the step waits for it, each ends
that request alone with finish_reason "error" and its error, and the requests beside it get their tokens as alone."""
import time
from concurrent.futures import Future

import pytest

from nanoserve import DEFAULT_MODEL, LLM, SamplingParams
from nanoserve.config import Config
from nanoserve.extensions import logits_processors
from nanoserve.extensions.structured_outputs import RequestGrammar, StructuredOutputsParams
from nanoserve.sampling_params import InvalidRequest
from nanoserve.scheduler import Scheduler
from nanoserve.sequence import Sequence

PROMPTS = ["It is a truth universally acknowledged", "Mr. Darcy said", "Emma was"]
DEAD_END = 'root ::= "a" x\nx ::= x'  # "a" is allowed, then nothing: the mask is empty at the second token


def grammar(min_tokens=0, **spec) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=20, min_tokens=min_tokens,
                          structured_outputs=StructuredOutputsParams(**spec))


@pytest.fixture(scope="module")
def llm():
    return LLM(DEFAULT_MODEL, block_size=16)


def bystanders() -> list[tuple[str, SamplingParams]]:
    return [(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12)),
            (PROMPTS[1], grammar(regex="[a-z]{4,8}")),
            (PROMPTS[2], SamplingParams(temperature=0, max_tokens=12, logit_bias={100: 3.0}, min_tokens=4))]


def alone(llm) -> list[list[int]]:
    return [llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids for prompt, params in bystanders()]


def run_beside_bystanders(llm, hostile: SamplingParams) -> tuple[dict, list[list[int]]]:
    """hostile's output, and the bystanders' tokens, all in the same steps (the hostile one added first)."""
    engine = llm.engine
    hostile_id = engine.add_request(PROMPTS[2], hostile, request_id="hostile")
    ids = [engine.add_request(prompt, params) for prompt, params in bystanders()]
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step().outputs)
        engine.assert_invariants()
    assert engine.scheduler.block_manager.num_free_blocks == engine.model_runner.num_blocks - 1
    return outputs[hostile_id], [outputs[i].outputs[0].token_ids for i in ids]


# Catches: a row whose mask allows nothing sampled anyway (token 0) and `assert accepted` failing the step,
# and with it every request in it; the failure reported as "abort" or without its error.
def test_a_grammar_that_allows_no_token_fails_its_request_alone(llm):
    expected = alone(llm)
    output, tokens = run_beside_bystanders(llm, grammar(grammar=DEAD_END))
    assert output.finish_reason == "error"
    assert isinstance(output.error, InvalidRequest) and output.error.param == "structured_outputs"
    assert "allows no token" in str(output.error)
    assert tokens == expected


# Catches: a logits processor's exception failing the step (every request in it) instead of its request.
def test_a_failing_logits_processor_fails_its_request_alone(llm, monkeypatch):
    expected = alone(llm)
    apply_row_processors = logits_processors.apply_row_processors

    def planted(logits, row, seq, eos_token_ids):
        if seq.request_id == "hostile":
            raise RuntimeError("planted: the processor failed")
        apply_row_processors(logits, row, seq, eos_token_ids)
    monkeypatch.setattr(logits_processors, "apply_row_processors", planted)
    output, tokens = run_beside_bystanders(llm, SamplingParams(temperature=0, max_tokens=12, min_tokens=2))
    assert output.finish_reason == "error" and "planted" in str(output.error)
    assert tokens == expected


# Catches: min_tokens ignored under a grammar (the choice ends at once), and a grammar that must end before
# min_tokens sampling token 0 past the mask instead of failing its request.
def test_min_tokens_under_a_grammar_masks_the_stop_token_or_fails_the_request(llm):
    out = llm.generate([PROMPTS[0]], grammar(regex="[a-z]+", min_tokens=6), use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) >= 6 and out.text.isalpha()
    with pytest.raises(InvalidRequest, match="min_tokens") as error:
        llm.generate([PROMPTS[0]], grammar(choice=["yes"], min_tokens=8), use_tqdm=False)
    assert error.value.param == "structured_outputs"
    assert not llm.engine.has_unfinished_requests()


# Catches: the scheduler admitting a request whose compile failed (done() is not compiled): its first step
# would raise at compiled.result() and fail every request in it.
def test_a_failed_compile_is_never_admitted():
    scheduler = Scheduler(Config(DEFAULT_MODEL), num_blocks=20, block_size=4, max_model_len=64, eos_token_ids={2})
    failed = Future()
    failed.set_exception(RuntimeError("planted"))
    scheduler.add(Sequence("failed", None, [1, 2, 3], SamplingParams(), grammar=RequestGrammar(failed)))
    scheduler.add(Sequence("other", None, [1, 2, 3], SamplingParams()))
    assert [seq.request_id for seq, _ in scheduler.schedule()] == ["other"]


# Catches: a compile that fails while the step waits for it (after the failed grammars were ended) admitted and
# failing the step; the request ending with "abort" instead of its error.
def test_a_compile_failing_during_the_steps_wait_fails_its_request_alone(llm, monkeypatch):
    engine, grammars = llm.engine, llm.engine.grammars

    def planted(grammar):
        time.sleep(0.03)  # inside the step's wait (0.1 s)
        raise RuntimeError("planted: the compile failed")
    monkeypatch.setattr(grammars, "compile_now", planted)
    engine.add_request(PROMPTS[0], grammar(regex="[0-9]{7}"), request_id="failing")
    outputs = []
    for _ in range(5):
        outputs += engine.step().outputs
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("failing", "error")]
    assert "planted" in str(outputs[0].error)
    assert not engine.has_unfinished_requests()


def test_llm_generate_raises_a_requests_own_error(llm):
    # Catches: a failed request returned as an ordinary output (its void token as text), or left in the engine.
    with pytest.raises(InvalidRequest, match="allows no token"):
        llm.generate(PROMPTS[:2], [SamplingParams(max_tokens=5), grammar(grammar=DEAD_END)], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
