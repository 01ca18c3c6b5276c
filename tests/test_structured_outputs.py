"""Structured outputs (structured_outputs.py): every output fits its grammar, on the bundled Austen model
(it never saw JSON: every valid output is the mask's doing), beside unconstrained requests, through preemption."""
import pytest

# Test extras (pyproject.toml's [test]) this module needs: without one it is skipped, not an error
pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")
import json
import logging
import re
import threading
from concurrent.futures import Future

import jsonschema

from nanoserve import DEFAULT_MODEL, LLM, SamplingParams
from nanoserve.config import Config
from nanoserve.extensions.structured_outputs import GrammarCompiler, RequestGrammar, StructuredOutputsParams
from nanoserve.scheduler import Scheduler
from nanoserve.sequence import Sequence

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "minLength": 2, "maxLength": 12},
    "age": {"type": "integer", "minimum": 18, "maximum": 99},
    "mood": {"enum": ["happy", "sad", "vexed"]},
    "friends": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 3},
    "home": {"type": "object", "properties": {"town": {"type": "string", "maxLength": 10},
                                              "rooms": {"type": "integer", "minimum": 1, "maximum": 30}},
             "required": ["town", "rooms"], "additionalProperties": False}},
    "required": ["name", "age", "mood", "friends", "home"], "additionalProperties": False}
NUMBERS = {"type": "array", "items": {"type": "number", "minimum": -5, "maximum": 5}, "minItems": 2, "maxItems": 4}
PROMPTS = ["It is a truth universally acknowledged", "Mr. Darcy said", "Emma was"]


def constrained(temperature=0.0, max_tokens=120, seed=None, **spec):
    return SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**spec))


@pytest.fixture(scope="module")
def austen():
    return LLM(DEFAULT_MODEL, block_size=16)


@pytest.mark.parametrize("schema", [PERSON, NUMBERS], ids=["person", "numbers"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_outputs_fit_their_schema_on_a_model_that_never_saw_json(austen, schema, temperature):
    # Catches: the mask not applied (Austen's prose is no JSON), applied to the wrong row, a finished
    # grammar not ending the request (the text runs on past the closing brace).
    params = [constrained(temperature, seed=i, json=schema) for i in range(len(PROMPTS))]
    outputs = austen.generate(PROMPTS, params)
    for output in outputs:
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), schema)


def test_json_schema_given_as_text_and_json_object(austen):
    out = austen.generate(PROMPTS[:1], constrained(json=json.dumps(NUMBERS)))[0].outputs[0]
    jsonschema.validate(json.loads(out.text), NUMBERS)
    out = austen.generate(PROMPTS[:1], constrained(json_object=True, max_tokens=60, temperature=1.0, seed=3))[0]
    assert out.outputs[0].text.startswith("{")  # Austen's prose never does: the mask is applied
    assert out.outputs[0].finish_reason == "length" or isinstance(json.loads(out.outputs[0].text), dict)
    # {} is the schema every JSON value fits: given, though falsy (json_object=False is not given)
    out = austen.generate(PROMPTS[:1], constrained(json={}, json_object=False, max_tokens=60))[0].outputs[0]
    assert out.text[:1] in '{["-0123456789tfn' and (out.finish_reason == "length" or json.loads(out.text) is not None)


def test_regex_and_choice(austen):
    regex = r"(Miss|Mrs)\. [A-Z][a-z]{2,8}, aged [1-9][0-9]"
    choices = ["Elizabeth", "Jane", "Lydia Bennet"]
    params = [constrained(1.0, seed=i, regex=regex) for i in range(3)] + \
             [constrained(1.0, seed=i, choice=choices) for i in range(3)]
    outputs = [o.outputs[0] for o in austen.generate(PROMPTS + PROMPTS, params)]
    for out in outputs[:3]:
        assert re.fullmatch(regex, out.text) and out.finish_reason == "stop"
    for out in outputs[3:]:
        assert out.text in choices and out.finish_reason == "stop"


def test_ebnf_grammar_and_a_finished_grammar_stops_even_with_ignore_eos(austen):
    grammar = 'root ::= "Yes, " name "." \nname ::= "Emma" | "Harriet"'
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(grammar=grammar))
    out = austen.generate(PROMPTS[:1], params)[0].outputs[0]
    assert out.text in ("Yes, Emma.", "Yes, Harriet.") and out.finish_reason == "stop"


def test_an_unconstrained_request_beside_constrained_ones_gets_its_tokens_as_alone(austen):
    # Catches: a mask row applied to the wrong request (rows are the sampling rows, in batch order).
    plain = SamplingParams(temperature=0, max_tokens=40)
    alone = austen.generate(PROMPTS[1:2], plain)[0].outputs[0].token_ids
    mixed = austen.generate(PROMPTS, [constrained(json=PERSON), plain, constrained(choice=["a", "b"])])
    assert mixed[1].outputs[0].token_ids == alone


def test_preemption_mid_grammar_leaves_the_grammar_exact():
    # A cache of 12 blocks of 4 slots for 3 requests of ~60 tokens: they preempt one another mid-JSON.
    # Catches: the matcher advanced again when a preempted request recomputes, or reset (accept fails).
    params = [constrained(json=PERSON) for _ in PROMPTS]
    expected = [o.outputs[0].text for o in LLM(DEFAULT_MODEL, block_size=4).generate(PROMPTS, params)]
    llm = LLM(DEFAULT_MODEL, block_size=4, num_kvcache_blocks=40, max_model_len=128)
    got = [o.outputs[0].text for o in llm.generate(PROMPTS, params)]
    assert llm.engine.scheduler.num_preemptions > 0
    assert got == expected
    for text in got:
        jsonschema.validate(json.loads(text), PERSON)
    llm.engine.assert_invariants()


def test_a_spec_that_is_no_json_is_a_value_error_naming_structured_outputs():
    with pytest.raises(ValueError, match="structured_outputs") as error:
        constrained(json="{not json")
    assert error.value.param == "structured_outputs"


@pytest.mark.parametrize("spec", [dict(json={"type": "objekt"}), dict(regex="(a"), dict(grammar="root ::= nothing")])
def test_a_spec_the_library_rejects_fails_its_request_alone_naming_structured_outputs(austen, spec):
    """The spec is parsed in a grammar worker's process (grammar_workers.py), so add_request takes it and the
    request fails alone ("error") with an InvalidRequest naming structured_outputs; LLM.generate raises it.
    Catches: a rejected spec failing the step (and the request beside it), or reported as an engine error."""
    engine = austen.engine
    other = engine.add_request("Emma", SamplingParams(max_tokens=3))
    bad = engine.add_request("Emma", constrained(**spec))
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step().outputs)
    finished.update((o.request_id, o) for o in engine.step().outputs)
    assert finished[bad].finish_reason == "error" and len(finished[other].outputs[0].token_ids) == 3
    assert isinstance(finished[bad].error, ValueError) and finished[bad].error.param == "structured_outputs"
    with pytest.raises(ValueError, match="structured_outputs"):
        austen.generate(["Emma"], constrained(**spec), use_tqdm=False)
    engine.assert_invariants()


@pytest.mark.parametrize("spec", [dict(), dict(regex="a", choice=["a"]), dict(choice="ab"), dict(json=3)])
def test_a_malformed_spec_is_refused_when_made(spec):
    with pytest.raises(ValueError, match="structured_outputs"):
        StructuredOutputsParams(**spec)


def test_grammars_are_compiled_once_per_spec(austen):
    grammars = austen.engine.grammars
    first = grammars.compile(StructuredOutputsParams(json={"type": "integer", "minimum": 3}))
    again = grammars.compile(StructuredOutputsParams(json='{"minimum": 3, "type": "integer"}'))
    assert first.compiled is again.compiled and first is not again  # one compile, a matcher each


def test_a_request_whose_grammar_compiles_waits_without_holding_up_the_others():
    # Catches: a compiling request admitted (its first step would block on the compile), or blocking the queue.
    scheduler = Scheduler(Config(DEFAULT_MODEL), num_blocks=20, block_size=4, max_model_len=64, eos_token_ids={2})
    compiling = Future()
    first = Sequence("first", None, [1, 2, 3], SamplingParams(), grammar=RequestGrammar(compiling))
    second = Sequence("second", None, [1, 2, 3], SamplingParams())
    scheduler.add(first)
    scheduler.add(second)
    assert [seq.request_id for seq, _ in scheduler.schedule()] == ["second"]
    compiling.set_result(None)
    assert [seq.request_id for seq, _ in scheduler.schedule()] == ["second", "first"]


def test_a_long_compile_leaves_the_engine_loop_free_and_a_failed_one_fails_its_request_alone(monkeypatch, caplog):
    """A compile still running after a step's short wait leaves that step empty (no error: the engine's loop
    goes back to its new requests and aborts), and the request runs once it is done. A compile that fails
    fails its own request ("error"), logged; the request beside it finishes, and the next request with that spec
    compiles again. Catches: step() blocking for a whole compile, raising 'no progress', a failed grammar
    failing the step and every request in it, a failed compile kept in the cache."""
    llm = LLM(DEFAULT_MODEL, block_size=16)
    engine, grammars, release = llm.engine, llm.engine.grammars, threading.Event()
    compile_now, outcomes = grammars.compile_now, iter(["wait", "fail", "compile"])

    def planted(grammar):
        outcome = next(outcomes)
        if outcome == "wait":
            release.wait(timeout=20)  # the test releases it (a step that waited for it all fails below)
        if outcome == "fail":
            raise RuntimeError("planted: the compile failed")
        return compile_now(grammar)
    monkeypatch.setattr(grammars, "compile_now", planted)
    slow = engine.add_request(PROMPTS[0], constrained(regex="[a-z]{3}"))
    for _ in range(3):
        assert engine.step().batch is None and engine.has_unfinished_requests()
    release.set()
    assert [o.outputs[0].text for o in run_to_end(engine) if o.request_id == slow][0]
    failing = engine.add_request(PROMPTS[1], constrained(regex="[0-9]{3}"))
    beside = engine.add_request(PROMPTS[2], SamplingParams(temperature=0, max_tokens=5))
    with caplog.at_level(logging.ERROR):
        finished = {o.request_id: o.outputs[0] for o in run_to_end(engine)}
    assert finished[failing].finish_reason == "error" and len(finished[beside].token_ids) == 5
    assert "RuntimeError('planted: the compile failed')" in caplog.text
    again = engine.add_request(PROMPTS[1], constrained(regex="[0-9]{3}"))
    assert re.fullmatch("[0-9]{3}", {o.request_id: o.outputs[0] for o in run_to_end(engine)}[again].text)
    assert engine.scheduler.block_manager.num_free_blocks == engine.model_runner.num_blocks - 1


def run_to_end(engine) -> list:
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step().outputs
        engine.assert_invariants()
    return outputs + engine.step().outputs  # aborted requests are reported by the step after their abort


def test_a_small_grammar_never_waits_behind_a_large_one_and_a_left_compile_is_cancelled(austen, monkeypatch):
    """Catches: one compile thread, first come first served (a 1 ms regex waited 23 s behind abandoned huge
    enums), and a queued compile whose waiters all left still run (and cached)."""
    engine = austen.engine  # a compiler of its own: earlier tests leave the engine's lanes and workers as they were
    grammars = GrammarCompiler(engine.tokenizer, engine.vocab_size, {2})
    release, holding, calls = threading.Event(), threading.Event(), []
    compile_now = grammars.compile_now
    large = [StructuredOutputsParams(choice=[f"{i}-{'x' * 5000}", "y"]) for i in range(2)]

    def planted(grammar):
        calls.append(grammar)
        if grammar is large[0]:  # held by spec, not as the first call: the small lane's thread may call first
            holding.set()
            release.wait(timeout=180)  # the first large compile holds its thread until the test is done
        return compile_now(grammar)
    monkeypatch.setattr(grammars, "compile_now", planted)
    for started in grammars.start_workers():  # a worker's start (seconds on a busy machine) is not what this times
        started.result(timeout=200)
    running = grammars.submit(large[0], waiting=True)
    queued = grammars.submit(large[1], waiting=True)
    assert holding.wait(timeout=90)  # large[0] runs: leaving it below drops it once done, never cancels it
    small = grammars.submit(StructuredOutputsParams(regex="[a-z]{2}"), waiting=False)
    try:
        # not behind the large compile, which holds its thread past this timeout. The margin covers a new
        # worker's start: an earlier test may have killed the small lane's worker (seconds, more when loaded).
        small.result(timeout=90)
        grammars.leave(large[1])  # its only waiter left before it started
        assert queued.cancelled() and large[1].key not in grammars.cache
    finally:
        release.set()
    grammars.leave(large[0])
    running.result(timeout=60)
    assert len(calls) == 2 and not grammars.waiters  # the cancelled one never compiled
    grammars.close()


def test_the_grammar_cache_is_bounded_by_bytes(austen):
    """Catches: a cache bounded by count alone (256 compiled 5,000-string enums: ~19 GB)."""
    engine = austen.engine
    grammars = GrammarCompiler(engine.tokenizer, engine.vocab_size, {2})
    specs = [StructuredOutputsParams(regex=f"[a-z]{{{n}}}") for n in (200, 201, 202)]
    for spec in specs[:2]:
        grammars.submit(spec).result(timeout=30)
    sizes = [grammars.sizes[spec.key] for spec in specs[:2]]
    grammars.cache_bytes = sum(sizes) + 1  # room for the two, not for a third
    grammars.submit(specs[2]).result(timeout=30)
    grammars.submit(specs[2])  # evicts once the third's size is known
    assert list(grammars.cache) == [specs[1].key, specs[2].key]

    # 30 `format: email` strings: xgrammar's memory_size_bytes says 1.4 MiB, yet each copy read back holds
    # ~24 MiB (resident memory measured after malloc_trim). Catches: the cache counting memory_size_bytes.
    emails = {"type": "object", "properties": {f"f{i}": {"type": "string", "format": "email"} for i in range(30)},
              "required": [f"f{i}" for i in range(30)]}
    grammars.cache_bytes = 8 * 2**20
    grammars.submit(StructuredOutputsParams(json=emails)).result(timeout=120)
    grammars.submit(specs[0])  # evicts the emails' grammar: it holds far over 8 MiB
    assert StructuredOutputsParams(json=emails).key not in grammars.cache
    grammars.close()


def test_a_compile_every_waiter_left_while_it_ran_never_enters_the_cache(austen, monkeypatch):
    """A server request that waited past its budget got a 400 and left; its compile ran on. Catches: that compile
    then kept in the cache (it held memory no request asked for), or dropped though a request asked again."""
    engine = austen.engine
    grammars = GrammarCompiler(engine.tokenizer, engine.vocab_size, {2})
    started, release = threading.Event(), threading.Event()

    def compile_now(spec):
        started.set()
        release.wait(30)
        return spec.key

    monkeypatch.setattr(grammars, "compile_now", compile_now)
    left, kept = StructuredOutputsParams(regex="[a-z]{5}"), StructuredOutputsParams(regex="[a-z]{6}")
    future = grammars.submit(left, waiting=True)
    assert started.wait(30)
    grammars.leave(left)  # while it runs
    release.set()
    assert future.result(timeout=30) == left.key and left.key not in grammars.cache
    started.clear(), release.clear()
    future = grammars.submit(kept, waiting=True)
    assert started.wait(30)
    grammars.leave(kept)
    grammars.submit(kept, waiting=True)  # asked for again while it runs: kept
    release.set()
    future.result(timeout=30)
    assert kept.key in grammars.cache


class FakeClock:
    """perf_counter for structured_outputs.py: each call advances it `step` more than the call before, so the
    grammar's work seems to take longer at each token, as `(([a-z ]*)*)*`'s does."""

    def __init__(self, step: float) -> None:
        self.now, self.step, self.calls = 0.0, step, 0

    def __call__(self) -> float:
        self.calls += 1
        self.now += self.step * self.calls
        return self.now


def run_beside(engine, hostile_params, plain_params):
    """Step the engine with a hostile and a plain request to the end; their outputs by name."""
    ids = {"hostile": engine.add_request(PROMPTS[0], hostile_params), "plain": engine.add_request(PROMPTS[1],
                                                                                                  plain_params)}
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((o.request_id, o) for o in engine.step().outputs)
    return {name: finished[request_id] for name, request_id in ids.items()}


def test_a_grammar_slower_each_token_fails_alone_past_its_step_budget(austen, monkeypatch):
    """A grammar's mask and advance run on the engine's thread: a slow one stalls every stream. Past STEP_SECONDS
    its request fails alone ("error", naming structured_outputs); the plain request beside it gets its tokens as
    alone. Catches: no time limit on the mask or the advance (the hostile request runs to its 40 tokens), the
    limit failing the step or the request beside it, or a wrong row masked once one failed."""
    from nanoserve.extensions import structured_outputs
    plain = SamplingParams(temperature=0, max_tokens=30)
    alone = austen.generate(PROMPTS[1:2], plain, use_tqdm=False)[0].outputs[0].token_ids
    hostile = SamplingParams(temperature=1.0, seed=0, min_tokens=40, max_tokens=40,
                             structured_outputs=StructuredOutputsParams(regex="(([a-z ]*)*)*"))
    # four calls a token (a fill and an accept, each timed): the work measured grows 8 ms a token, past 0.2 s at ~25
    monkeypatch.setattr(structured_outputs, "perf_counter", FakeClock(0.002))
    out = run_beside(austen.engine, hostile, plain)
    assert out["plain"].outputs[0].token_ids == alone
    assert out["hostile"].finish_reason == "error" and out["hostile"].error.param == "structured_outputs"
    assert "limit" in str(out["hostile"].error) and len(out["hostile"].outputs[0].token_ids) < 40
    # the same request with its work measured as quick runs to its length: the limit, not the regex, failed it
    monkeypatch.setattr(structured_outputs, "perf_counter", lambda: 0.0)
    out = run_beside(austen.engine, hostile, plain)
    assert out["hostile"].finish_reason == "length" and out["plain"].outputs[0].token_ids == alone
    austen.engine.assert_invariants()


class SlowMatcher:
    """A matcher whose mask and advance each take `seconds` on a fake clock."""

    def __init__(self, clock: list[float], seconds: float) -> None:
        self.clock, self.seconds = clock, seconds

    def fill_next_token_bitmask(self, bitmask, row) -> None:
        self.clock[0] += self.seconds

    def accept_token(self, token) -> bool:
        self.clock[0] += self.seconds
        return True


@pytest.mark.parametrize("seconds, fails", [(0.19, False), (0.21, True)])
def test_a_mask_or_an_advance_past_step_seconds_is_an_error_naming_structured_outputs(monkeypatch, seconds, fails):
    # Catches: a limit compared the wrong way, or only on the mask (an advance can be as slow).
    from nanoserve.extensions import structured_outputs
    monkeypatch.setattr(structured_outputs, "STEP_SECONDS", 0.2)
    clock = [0.0]
    monkeypatch.setattr(structured_outputs, "perf_counter", lambda: clock[0])
    grammar = RequestGrammar(Future())
    grammar.matcher = SlowMatcher(clock, seconds)
    error = grammar.accept(5)
    assert (error is not None) == fails and (not fails or error.param == "structured_outputs")
    if fails:
        with pytest.raises(ValueError, match="structured_outputs took 0.21 s to mask"):
            grammar.fill(None, 0)
    else:
        grammar.fill(None, 0)


def test_compiles_take_turns_across_clients_and_a_second_client_starts_beside_the_first(austen, monkeypatch):
    """A client keeping slow schemas queued runs one compile at a time. Another client's compile starts beside it,
    in the small lane's second thread. Catches: one thread per lane (the other client's compile waits for the slow
    one), a client holding both threads, or turns that let the client just served go again."""
    engine = austen.engine
    grammars = GrammarCompiler(engine.tokenizer, engine.vocab_size, {2})
    started, first_started, release = [], threading.Event(), threading.Event()

    def compile_now(spec):
        started.append(spec.regex)
        if spec.regex.startswith("a"):
            first_started.set()
            release.wait(60)  # past the wait for the other client's compile below
        return spec.key

    monkeypatch.setattr(grammars, "compile_now", compile_now)
    many = [grammars.submit(StructuredOutputsParams(regex="a{0}"), client="many")]
    assert first_started.wait(30)
    many += [grammars.submit(StructuredOutputsParams(regex=f"a{{{n}}}"), client="many") for n in (1, 2)]
    try:
        grammars.submit(StructuredOutputsParams(regex="b"), client="other").result(timeout=30)
        assert started == ["a{0}", "b"]
    finally:
        release.set()
    for future in many:
        future.result(timeout=30)
    assert started == ["a{0}", "b", "a{1}", "a{2}"]
