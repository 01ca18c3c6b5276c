"""Grammars parsed and compiled in child processes (grammar_workers.py) and the cheap bounds in front of them
(grammar_bounds.py), through the Python API: a spec that crashes xgrammar, outlives the time limit or is killed
mid-compile fails its own request with an InvalidRequest, the worker is replaced, and the requests beside it get
the tokens they get alone. Each test runs in this process: had the crash happened here, pytest itself would die."""
import asyncio
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from nanoserve import DEFAULT_MODEL, LLM, SamplingParams
from nanoserve.entrypoints.async_llm import AsyncLLM
from nanoserve.extensions import structured_outputs
from nanoserve.extensions.grammar_bounds import bracket_depth, check_bounds, count_quantifiers
from nanoserve.extensions.structured_outputs import GrammarCompiler, StructuredOutputsParams
from nanoserve.sampling_params import InvalidRequest

CHAIN = {"type": "string", "pattern": "a" + "{1}" * 15000}  # 45 KB of stacked quantifiers: SIGSEGV in xgrammar
DEEP = {"type": "string", "pattern": "(" * 30000 + "a" + ")" * 30000}  # 30,000 nested groups: SIGSEGV too
SLOW = {"type": "string", "pattern": "a" + "*" * 30000}  # parses for tens of seconds
PROMPTS = ["It is a truth universally acknowledged", "Mr. Darcy said", "Emma was"]


@pytest.fixture(scope="module")
def llm():
    return LLM(DEFAULT_MODEL, block_size=16)


@pytest.fixture
def unbounded(monkeypatch):
    """No cheap bounds: the spec reaches the worker process, which is what must contain it."""
    monkeypatch.setattr(structured_outputs, "check_bounds", lambda *args, **kwargs: None)


def grammar(max_tokens: int = 8, **spec) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, structured_outputs=StructuredOutputsParams(**spec))


def plain() -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=12), SamplingParams(temperature=0.9, seed=7, max_tokens=12)]


def alone(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], plain(), use_tqdm=False)]


@pytest.mark.parametrize("schema", [CHAIN, DEEP], ids=["quantifier-chain", "deep-pattern"])
def test_a_hostile_schema_is_bad_input_for_llm_generate(llm, schema):
    """Catches: the bounds only in the HTTP layer (LLM.generate handed these to xgrammar in this process:
    SIGSEGV), and a bound on brackets alone (the chain is 1 deep). The engine serves on after."""
    with pytest.raises(InvalidRequest) as error:
        llm.generate(PROMPTS[:1], grammar(json=schema), use_tqdm=False)
    assert error.value.param == "structured_outputs"
    assert not llm.engine.has_unfinished_requests()
    assert llm.generate(PROMPTS[:1], grammar(regex="[a-z]{3}"), use_tqdm=False)[0].outputs[0].text.isalpha()


@pytest.mark.parametrize("schema", [CHAIN, DEEP], ids=["quantifier-chain", "deep-pattern"])
def test_a_schema_that_crashes_xgrammar_fails_its_request_alone(llm, unbounded, schema):
    """Past the bounds (none here), the worker process crashes (SIGSEGV), not this one: the request fails with
    an InvalidRequest, the bystanders in the same steps get their tokens alone, and the next grammar compiles
    in a new worker. Catches: compiling in this process (pytest dies), a crash reported as an engine error or
    failing the step, a dead worker never replaced."""
    expected = alone(llm)
    engine = llm.engine
    hostile = engine.add_request(PROMPTS[2], grammar(json=schema))
    ids = [engine.add_request(prompt, params) for prompt, params in zip(PROMPTS, plain())]
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step().outputs)
    outputs.update((o.request_id, o) for o in engine.step().outputs)
    assert outputs[hostile].finish_reason == "error"
    assert isinstance(outputs[hostile].error, InvalidRequest) and "crashed" in str(outputs[hostile].error)
    assert [outputs[i].outputs[0].token_ids for i in ids] == expected
    assert llm.generate(PROMPTS[:1], grammar(regex="[0-9]{3}"), use_tqdm=False)[0].outputs[0].text.isdigit()


def large_lane_worker(grammars):
    return grammars.workers[next(name for name in grammars.workers if not name.startswith("grammar-small"))]


def test_a_worker_killed_mid_compile_fails_that_request_alone(llm, unbounded):
    """Catches: a worker's death hanging its request (waiting on the pipe for good), failing other requests,
    or leaving a dead worker that fails the next grammar too."""
    grammars = llm.engine.grammars
    slow = grammars.submit(StructuredOutputsParams(json=SLOW))  # 30 KB: the large lane
    deadline = time.time() + 120
    while not (any(not name.startswith("grammar-small") for name in grammars.workers)
               and large_lane_worker(grammars).job is not None) and time.time() < deadline:
        time.sleep(0.05)  # until its worker has started and works on it
    time.sleep(0.5)
    assert not slow.done()
    os.kill(large_lane_worker(grammars).process.pid, signal.SIGKILL)
    with pytest.raises(InvalidRequest, match="crashed"):
        slow.result(timeout=30)
    assert llm.generate(PROMPTS[:1], grammar(regex="[0-9]{2}"), use_tqdm=False)[0].outputs[0].text.isdigit()
    big = {"enum": [f"{i}-{'x' * 600}" for i in range(8)]}  # the large lane again: a new worker
    assert llm.generate(PROMPTS[:1], grammar(json=big, max_tokens=400), use_tqdm=False)[0].outputs[0].text


def test_a_compile_past_the_workers_time_limit_fails_alone(llm, unbounded):
    """Catches: no time limit in the worker (the 30 KB pattern of `SLOW` held a compile thread for 35 s), and a
    killed worker not replaced."""
    grammars = llm.engine.grammars
    big = {"enum": [f"{i}-{'y' * 600}" for i in range(8)]}
    assert llm.generate(PROMPTS[:1], grammar(json=big, max_tokens=400), use_tqdm=False)  # the large lane's worker
    worker = large_lane_worker(grammars)
    worker.seconds = 1.0
    try:
        start = time.perf_counter()
        with pytest.raises(InvalidRequest, match="took over"):
            grammars.submit(StructuredOutputsParams(json=SLOW)).result(timeout=120)
        assert time.perf_counter() - start < 20
    finally:
        worker.seconds = 30.0
    again = {"enum": [f"{i}-{'z' * 600}" for i in range(8)]}  # not cached: compiled by a new worker
    assert llm.generate(PROMPTS[:1], grammar(json=again, max_tokens=400), use_tqdm=False)[0].outputs[0].text


def test_a_worker_that_died_while_idle_is_replaced_at_the_next_compile(llm):
    """Catches: a worker reused because it once started, though its process has ended since (killed by the OS
    while idle): every later compile on its lane then fails for good."""
    engine = llm.engine
    grammars = GrammarCompiler(engine.tokenizer, engine.vocab_size, {2})
    try:
        grammars.submit(StructuredOutputsParams(regex="[0-9]{2}")).result(timeout=200)
        (worker,) = grammars.workers.values()  # the small lane's
        worker.process.kill()
        worker.process.wait()
        for regex in ("[a-c]{3}", "[d-f]{3}"):  # new specs, never cached
            grammars.submit(StructuredOutputsParams(regex=regex)).result(timeout=200)
    finally:
        grammars.close()


def test_the_workers_memory_limit_is_its_size_now_plus_memory_bytes():
    """limit_memory reads /proc/self/statm (pages); this reads VmSize in /proc/self/status (kB), another source.
    Catches: statm's pages read as bytes or as kB (the limit then sits below the process's size, or far above)."""
    if not os.path.exists("/proc/self/statm"):
        pytest.skip("the worker's memory limit needs Linux (macOS ignores RLIMIT_AS)")
    code = ("import re, resource; from nanoserve.extensions.grammar_workers import limit_memory; "
            "size = int(re.search(r'VmSize:\\s+(\\d+) kB', open('/proc/self/status').read())[1]) * 1024; "
            "limit_memory(2**30); print(size, resource.getrlimit(resource.RLIMIT_AS)[0])")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": root}).stdout
    size, limit = map(int, out.split())
    assert abs(limit - (size + 2**30)) < 16 * 2**20  # what the process mapped in between: a few MB at most


def test_async_llm_raises_invalid_request_for_a_grammar_that_fails_to_compile(llm, unbounded):
    """Catches: a failed compile (here a crashed worker) reported by AsyncLLM as an EngineGenerateError, as if
    the engine failed, instead of bad input."""
    async def run() -> None:
        async with AsyncLLM(llm.engine) as async_llm:
            with pytest.raises(InvalidRequest, match="crashed"):
                async for _ in async_llm.generate([1, 2, 3], grammar(json=CHAIN), "hostile"):
                    pass
            with pytest.raises(InvalidRequest, match="allows no output"):
                async for _ in async_llm.generate([1, 2, 3], grammar(grammar="root ::= root"), "empty"):
                    pass
    asyncio.run(run())


def test_worker_processes_start_only_with_the_first_grammar():
    """Catches: the workers started with the engine, so every plain LLM pays their start (seconds) and memory."""
    llm = LLM(DEFAULT_MODEL, block_size=16)
    llm.generate(PROMPTS[:1], SamplingParams(max_tokens=3), use_tqdm=False)
    grammars = llm.engine.grammars
    assert not grammars.workers and not grammars.started and grammars.tokenizer_info is None


# --- The cheap bounds ---------------------------------------------------------------------------

def refused(**spec) -> bool:
    try:
        check_bounds(spec, max_bytes=64 * 1024, max_depth=16)
    except InvalidRequest:
        return True
    return False


def test_stacked_quantifiers_count_as_nesting_and_all_quantifiers_are_bounded():
    """Catches: bounds counting brackets only (the 45 KB chain is 1 deep), quantifiers inside a character class
    or escaped counted as quantifiers (legitimate regexes refused)."""
    assert count_quantifiers("a{1}{1}{1}") == (3, 3)
    assert count_quantifiers("[*+?]{2}\\*+x?") == (3, 1)
    assert count_quantifiers("(a){1}{2,}") == (2, 2)
    assert refused(json=CHAIN) and refused(regex="a" + "*" * 30000) and refused(regex="a" + "{1}" * 17)
    assert not refused(regex="a" + "{1}" * 16) and not refused(regex="[a-z]+@[a-z]+\\.(com|org)?")
    assert refused(regex="a?" * 1100)  # 1,100 quantifiers, none stacked
    # over the whole schema, not per pattern: three patterns of 400 each (a count per pattern accepts it)
    properties = {name: {"type": "string", "pattern": "a?" * 400} for name in "xyz"}
    assert refused(json={"type": "object", "properties": properties})
    assert not refused(json={"type": "object", "properties": {"x": properties["x"]}})
    assert refused(json={"type": "object", "patternProperties": {"a" + "+" * 20: {"type": "string"}}})


def test_unmatched_closing_brackets_do_not_lower_the_measured_depth():
    """Catches: a depth count that goes negative on unmatched closing brackets, so that the openings after them
    measure shallower than they nest (it accepted the regex below at a bound of 16)."""
    assert bracket_depth(")" * 5 + "(" * 5) == 5
    assert refused(regex="[" + ")" * 40 + "]" + "(" * 40 + "a" + ")" * 40)


@pytest.mark.parametrize("schema, keyword", [
    ({"not": {"type": "string"}}, "not"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "allOf"),
    ({"type": []}, "type"),
    ({"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}}, "$ref"),
    ({"type": "string", "pattern": "^(?!admin).*$"}, "lookahead"),
    ({"type": "string", "pattern": "(?<=a)b"}, "lookbehind"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems"),
    ({"type": "array", "contains": {"const": 3}}, "contains"),
    ({"type": "array", "maxContains": 2}, "maxContains"),
    ({"if": {"type": "integer"}, "then": {"minimum": 3}, "else": {"type": "string"}}, "if"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
    ({"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]}, "oneOf"),
    ({"type": "integer", "minimum": 5, "maximum": 2}, "minimum"),
    ({"type": "string", "minLength": 5, "maxLength": 2}, "minLength"),
    ({"type": "array", "minItems": 3, "maxItems": 1}, "minItems"),
    ({"enum": []}, "enum"),
    ({"type": "object", "required": ["a"], "additionalProperties": False}, "required"),
], ids=["not", "contradictory-allOf", "empty-type", "remote-ref", "lookahead", "lookbehind", "uniqueItems",
        "contains", "maxContains", "if-then-else", "overlapping-oneOf", "overlapping-oneOf-types",
        "minimum-over-maximum", "minLength-over-maxLength", "minItems-over-maxItems", "empty-enum",
        "required-but-forbidden"])
def test_a_schema_no_output_can_satisfy_is_refused_naming_the_keyword(schema, keyword):
    """xgrammar ignores these keywords, so the output never validated, yet the request was accepted (200).
    Catches: any of them accepted; a property or an enum value that merely has the keyword's name refused."""
    with pytest.raises(InvalidRequest, match=re.escape(keyword)):
        check_bounds({"json": schema})
    check_bounds({"json": {"allOf": [{"type": "number"}, {"type": "integer"}], "$defs": {"x": {"$ref": "#/a"}}}})
    names = {"not": {"type": "string"}, "type": {"enum": [{"not": 1}]}, "if": {"type": "string"},
             "uniqueItems": {"const": True}}  # properties and values, no keywords
    check_bounds({"json": {"type": "object", "properties": names}})
    # what xgrammar enforces: a oneOf of types apart, a tagged union, uniqueItems false, a group that is no lookahead
    tagged = [{"type": "object", "properties": {"kind": {"const": kind}}, "required": ["kind"]} for kind in "ab"]
    for fine in ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, {"oneOf": tagged},
                 {"type": "array", "uniqueItems": False}, {"type": "string", "pattern": "(?:ab)+=!"},
                 {"type": "integer", "minimum": 2, "maximum": 2}):
        check_bounds({"json": fine})


def test_a_compile_past_the_workers_memory_limit_fails_alone(llm):
    """Catches: no memory limit in the worker (a grammar's compile could take all the machine's memory, and the
    server with it). The limit is the OS's (RLIMIT_AS): Linux only."""
    if not os.path.exists("/proc/self/statm"):
        pytest.skip("the worker's memory limit needs Linux (macOS ignores RLIMIT_AS)")
    engine = llm.engine
    grammars = GrammarCompiler(engine.tokenizer, engine.vocab_size, {2}, memory_bytes=2**20)
    spec = StructuredOutputsParams(choice=[f"{i}-{'x' * 40}" for i in range(1200)])  # MBs to parse and compile
    with pytest.raises(InvalidRequest, match="alloc|memory|crashed"):
        grammars.submit(spec).result(timeout=200)
    grammars.close()
