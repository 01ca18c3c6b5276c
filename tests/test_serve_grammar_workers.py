"""The grammars that crashed the server (SIGSEGV in xgrammar), through every route that takes a schema: each a
400 naming the field as sent, the server alive after. With the cheap bounds off, the crash happens in a grammar
worker process (grammar_workers.py): still a 400 for that request alone, a bystander stream beside it unharmed.
The server runs at the default grammar limits (64 KiB: the 45 KB chain gets past the byte bound)."""
import json

import httpx
import pytest
from test_serve import KEY, NAME, model_path, post, start_server  # noqa: F401 (fixtures)

from nanoserve.entrypoints.openai.protocol import Limits
from nanoserve.extensions import structured_outputs

CHAIN = {"type": "string", "pattern": "a" + "{1}" * 15000}  # 45 KB, 1 bracket deep: crashed at 13,000 repeats
DEEP = {"type": "string", "pattern": "(" * 30000 + "a" + ")" * 30000}
MESSAGES = [{"role": "user", "content": "Who came?"}]


@pytest.fixture(scope="module")
def server(model_path):  # noqa: F811
    server = start_server(model_path, api_key=KEY, limits=Limits(max_body_bytes=256 * 1024))
    yield server
    server.stop()


def routes(schema: dict) -> list[tuple[str, dict, str]]:
    """(path, body, the field its 400 must name) for each route that takes a schema."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
        "s": schema}}}}
    return [
        ("/v1/completions", dict(model=NAME, prompt="Emma", max_tokens=4, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}), "response_format"),
        ("/v1/completions", dict(model=NAME, prompt="Emma", max_tokens=4, structured_outputs={"json": schema}),
         "structured_outputs"),
        ("/v1/chat/completions", dict(model=NAME, messages=MESSAGES, max_tokens=4, tools=[tool], tool_choice="none"),
         "tools"),
        ("/v1/chat/completions", dict(model=NAME, messages=MESSAGES, max_tokens=4, tools=[tool],
                                      tool_choice="required"), "tools"),
        ("/v1/responses", dict(model=NAME, input="Who came?", max_output_tokens=4, text={"format": {
            "type": "json_schema", "name": "x", "schema": schema}}), "text"),
    ]


CASES = [(name, *route) for name, schema in (("chain", CHAIN), ("deep", DEEP)) for route in routes(schema)]


@pytest.mark.parametrize("name, path, body, field", CASES, ids=[f"{c[0]}-{c[1]}-{c[3]}" for c in CASES])
def test_each_route_answers_a_crashing_schema_with_a_400(server, name, path, body, field):
    """Catches: the bounds counting brackets only (the chain crashed the server through every route), a route
    that skips them (a tool's parameters with tool_choice "none"), an error naming the wrong field."""
    reply = post(server, path, body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == field, reply.text
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.parametrize("schema", [CHAIN, DEEP], ids=["chain", "deep"])
def test_past_the_bounds_a_crash_in_the_worker_is_a_400_for_that_request_alone(server, monkeypatch, schema):
    """With no cheap bounds, xgrammar crashes, in a worker process: the request gets a 400 naming its field, a
    stream beside it its whole text, and the next grammar compiles. Catches: parsing or compiling in the
    server's process (it dies, and every test after fails), a crash as a 500, a dead worker never replaced."""
    monkeypatch.setattr(structured_outputs, "check_bounds", lambda *args, **kwargs: None)
    with httpx.stream("POST", server.url + "/v1/completions", timeout=120, headers={"Authorization": f"Bearer {KEY}"},
                      json=dict(model=NAME, prompt="Emma", max_tokens=16, temperature=0, stream=True)) as stream:
        reply = post(server, "/v1/completions", dict(model=NAME, prompt="Emma", max_tokens=4,
                                                     structured_outputs={"json": schema}))
        events = [json.loads(line[6:]) for line in stream.iter_lines() if line.startswith("data: {")]
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "structured_outputs", reply.text
    assert "crashed" in reply.json()["error"]["message"]
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    again = post(server, "/v1/completions", dict(model=NAME, prompt="Emma", max_tokens=4,
                                                 structured_outputs={"regex": "[0-9]{3}"}))
    assert again.status_code == 200 and again.json()["choices"][0]["text"].isdigit(), again.text


def test_a_past_call_nested_past_the_recursion_limit_is_a_400(server):
    """Catches: json.loads of a past call's arguments raising RecursionError, answered 500, in chat and in a
    Responses function_call item (whose 400 names input)."""
    deep = "[" * 5000 + "]" * 5000
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": deep}}
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    reply = post(server, "/v1/chat/completions", dict(model=NAME, messages=messages, max_tokens=2))
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "messages", reply.text
    items = [{"role": "user", "content": "x"}, {"type": "function_call", "call_id": "call_1", "name": "f",
                                                 "arguments": deep}]
    reply = post(server, "/v1/responses", dict(model=NAME, input=items, max_output_tokens=2))
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "input", reply.text


def test_responses_errors_name_the_responses_fields(server):
    """Catches: a /v1/responses error naming the chat field it became (max_tokens, messages, response_format)."""
    reply = post(server, "/v1/responses", dict(model=NAME, input="Who came?", max_output_tokens=100_000))
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == "max_output_tokens", reply.text
    assert "max_output_tokens" in error["message"] and "max_tokens" not in error["message"].replace("max_output", "")
    reply = post(server, "/v1/responses", dict(model=NAME, input="x", max_output_tokens=2, text={"format": {
        "type": "json_schema", "name": "x", "schema": {"not": {}}}}))
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "text", reply.text
    assert "response_format" not in reply.json()["error"]["message"]
