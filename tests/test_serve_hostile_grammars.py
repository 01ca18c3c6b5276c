"""Hostile structured outputs through the server: each is a 4xx for the hostile request alone, naming its
field as sent, while bystander streams run beside it with the tokens they get alone; the server never exits.
Small bounds (Limits) keep it fast."""
import json
import threading
import time

import pytest
from test_serve import KEY, NAME, model_path, post, start_server  # noqa: F401 (fixtures)

from nanoserve.entrypoints.openai.protocol import Limits

LIMITS = Limits(max_body_bytes=256 * 1024, max_grammar_bytes=8192, max_grammar_depth=16,
                max_grammar_compile_seconds=2.0)
DEAD_END = 'root ::= "a" x\nx ::= x'  # compiles, allows "a", then nothing


@pytest.fixture(scope="module")
def server(model_path):  # noqa: F811
    server = start_server(model_path, api_key=KEY, limits=LIMITS)
    yield server
    server.stop()


def completion(**fields) -> dict:
    return {**dict(model=NAME, prompt="Emma", max_tokens=8, temperature=0), **fields}


def nested(depth: int) -> str:
    return "(" * depth + "a" + ")" * depth


def deep_schema(depth: int) -> dict:
    schema = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


HOSTILE = [  # (body fields, the field the 400 names)
    # 30,000 nested parentheses in a pattern crashed the process (SIGSEGV in xgrammar's regex converter)
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "pattern": nested(30_000)}}}), "response_format"),
    (dict(structured_outputs={"json": {"type": "string", "pattern": nested(40)}}), "structured_outputs"),
    (dict(structured_outputs={"regex": nested(40)}), "structured_outputs"),
    (dict(structured_outputs={"grammar": "root ::= " + nested(40).replace("a", '"a"')}), "structured_outputs"),
    (dict(structured_outputs={"json": deep_schema(40)}), "structured_outputs"),  # slow to parse: ~cubic in depth
    (dict(structured_outputs={"choice": ["x" * 5000, "y" * 5000]}), "structured_outputs"),
    # parse and compile, but their language is empty: every request in the step failed with it
    (dict(structured_outputs={"grammar": "root ::= root"}), "structured_outputs"),
    (dict(structured_outputs={"regex": "[^\\x00-\\U0010FFFF]"}), "structured_outputs"),
    # parses (lazily) and fails only when compiled: the step raised for every request in the engine
    (dict(structured_outputs={"regex": "a{2147483648}"}), "structured_outputs"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "pattern": "a{2147483648}"}}}), "response_format"),
    # compiles, but its mask empties after one token: the step's `assert accepted` failed every request in it
    (dict(structured_outputs={"grammar": DEAD_END}), "structured_outputs"),
    # a schema as a string nested 5,000 deep: a RecursionError, a 500
    (dict(structured_outputs={"json": "[" * 5000 + "]" * 5000}), "structured_outputs"),
    # two kinds of structured output: vLLM refuses, the latter silently won
    (dict(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}), "structured_outputs"),
    # logit_bias: digits to str.isdigit but not ids (int("²") raises), 5,000 digits, an id past the vocabulary
    (dict(logit_bias={"²": 1}), "logit_bias"),
    (dict(logit_bias={"٣": 1}), "logit_bias"),
    (dict(logit_bias={"9" * 5000: 1}), "logit_bias"),
    (dict(logit_bias={"999999": 1}), "logit_bias"),
]


def stream_text(server, body: dict) -> str:
    """A stream's text, asserting it ended with a finish_reason and no error event."""
    import httpx
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert all("error" not in e for e in events), events
    assert events[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    return "".join(e["choices"][0]["text"] for e in events)


# Catches, each: the repro of its HOSTILE line answered other than with a 400 naming its field (a crash, a 500,
# a 200), or failing the bystanders beside it (cut mid-stream by a step failure), or the server gone after.
def test_each_hostile_grammar_is_a_400_for_its_request_alone(server):
    bystander = completion(max_tokens=24, structured_outputs={"regex": "[a-z ]{10,30}"})
    plain = completion(max_tokens=24)
    expected = [stream_text(server, bystander), stream_text(server, plain)]
    got, failures = [], []

    def run_bystanders():
        try:
            for _ in range(3):
                got.append([stream_text(server, bystander), stream_text(server, plain)])
        except AssertionError as error:
            failures.append(error)
    threads = [threading.Thread(target=run_bystanders) for _ in range(2)]
    for thread in threads:
        thread.start()
    for fields, param in HOSTILE:
        reply = post(server, "/v1/completions", completion(**fields))
        assert reply.status_code == 400, (str(fields)[:200], reply.text[:300])
        assert reply.json()["error"]["param"] == param, (str(fields)[:200], reply.text[:300])
    for thread in threads:
        thread.join()
    assert not failures and got == [expected] * 6
    assert post(server, "/v1/completions", completion()).status_code == 200  # the server lives


# Catches: a logit_bias of NaN silently clamped to -100 (json allows NaN; OpenAI's API takes finite numbers).
def test_a_nan_logit_bias_is_a_400(server):
    reply = post(server, "/v1/completions", '{"model": "%s", "prompt": "a", "logit_bias": {"5": NaN}}' % NAME)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "logit_bias", reply.text


# Catches: choice escaped to ASCII by json.dumps: an emoji outside the BMP became a surrogate pair, which xgrammar
# read as two lone surrogates ("������" with finish_reason "stop").
def test_choice_round_trips_any_unicode(server):
    for choice in (["🙂"], ["é🙂ß", "😀😀"]):
        reply = post(server, "/v1/completions", completion(max_tokens=20, structured_outputs={"choice": choice}))
        assert reply.json()["choices"][0]["text"] in choice, reply.text


# Catches: a grammar that fails after acceptance (its mask empties mid-output) answered with a 200 and
# finish_reason "abort" (or "error"), or a stream cut without an error event; a 500 for the client's grammar.
def test_a_grammar_failing_mid_output_is_an_error_for_its_request(server):
    reply = post(server, "/v1/completions", completion(structured_outputs={"grammar": DEAD_END}))
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "structured_outputs", reply.text
    assert "allows no token" in reply.json()["error"]["message"]
    import httpx
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60, headers={"Authorization": f"Bearer {KEY}"},
                      json=completion(stream=True, structured_outputs={"grammar": DEAD_END})) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    errors = [json.loads(e)["error"] for e in events if e.startswith('{"error"')]
    assert len(errors) == 1 and errors[0]["param"] == "structured_outputs" and events[-1] == "[DONE]", events
    assert not any('"finish_reason": "abort"' in e or '"finish_reason": "error"' in e for e in events), events


# Catches: no time budget: a request waiting for its grammar's compile as long as the compile takes.
def test_a_compile_past_the_time_budget_is_a_400(server, monkeypatch):
    grammars = server.serving.grammars
    compile_now = grammars.compile_now

    def slow(grammar):
        time.sleep(3)  # past LIMITS.max_grammar_compile_seconds
        return compile_now(grammar)
    monkeypatch.setattr(grammars, "compile_now", slow)
    start = time.perf_counter()
    reply = post(server, "/v1/completions", completion(structured_outputs={"regex": "[0-9]{5,9}"}))
    assert reply.status_code == 400 and "compile" in reply.json()["error"]["message"], reply.text
    assert time.perf_counter() - start < 2.9
