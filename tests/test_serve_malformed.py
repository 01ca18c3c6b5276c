"""Malformed bodies thrown at the server by hypothesis: a valid chat, tools or Responses body (past tool calls,
their results, a forced tool_choice, a stream) with a few of its fields deleted, or replaced by arbitrary JSON
or by shapes that broke the server before. Whatever the body, the answer is never a 500 (nor an error event
saying the stream failed): a bad field is a 4xx naming it, and the server serves on. Bounded (max_examples) to
run in well under a minute on the bundled model."""
import pytest

pytest.importorskip("hypothesis")
pytest.importorskip("httpx")
import json

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_serve import NAME, model_path, post  # noqa: F401 (a fixture)
from test_serve_tools import MESSAGES, TOOLS, server  # noqa: F401 (fixtures)

CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Bath", "days": 2}'}}
CHAT = dict(model=NAME, messages=MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [CALL]},
                                             {"role": "tool", "tool_call_id": "c1", "content": "rain"}],
            tools=TOOLS, tool_choice="auto", max_tokens=3, temperature=0.5, stream=False)
RESPONSES = dict(model=NAME, input=[{"role": "user", "content": "Weather in Bath?"},
                                    {"type": "function_call", "call_id": "c1", "name": "get_weather",
                                     "arguments": '{"city": "Bath", "days": 2}'},
                                    {"type": "function_call_output", "call_id": "c1", "output": "rain"}],
                 tools=[{"type": "function", **tool["function"]} for tool in TOOLS], tool_choice="auto",
                 max_output_tokens=3, stream=False)
# Values that broke the server before: nested past the recursion limit, a pattern that crashed xgrammar, JSON that
# is no object, a lone surrogate, huge and non-finite numbers.
HOSTILE = st.sampled_from(["[" * 5000 + "]" * 5000, {"type": "string", "pattern": "a" + "{1}" * 2000}, "{",
                           '{"city": Bath}', "\ud800", 2**70, -1, 0, float("inf"), float("nan"), "required", "none",
                           {"type": "function", "function": {"name": "nope"}}, {"not": {}}, [], {}, ""])
JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats() | st.text(max_size=12),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                    max_leaves=8)


def paths(value, prefix=()) -> list[tuple]:
    """Every place in a JSON value: its members' and items' paths, nested ones too."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else []
    found = []
    for key, item in items:
        found += [prefix + (key,)] + paths(item, prefix + (key,))
    return found


def mutate(body: dict, data: st.DataObject) -> dict:
    """body with one to four places deleted, or given arbitrary JSON or a hostile value."""
    body = json.loads(json.dumps(body))
    for _ in range(data.draw(st.integers(1, 4))):
        places = paths(body)
        *parent_path, key = data.draw(st.sampled_from(places))
        parent = body
        for step in parent_path:
            parent = parent[step]
        if data.draw(st.booleans()) and isinstance(parent, dict):
            del parent[key]
        else:
            parent[key] = data.draw(HOSTILE | JSON)
        if not paths(body):
            break
    return body


def answer(server, path: str, body: dict) -> tuple[int, str]:  # noqa: F811
    content = json.dumps(body)  # NaN and Infinity as Python writes them: not JSON, a client may send them
    with httpx.stream("POST", server.url + path, content=content, headers={"Content-Type": "application/json"},
                      timeout=60) as reply:
        return reply.status_code, reply.read().decode()


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(data=st.data(), route=st.sampled_from(["chat", "chat stream", "responses", "responses stream"]))
def test_no_malformed_body_is_a_500(server, data, route):  # noqa: F811
    """Catches any body shape that makes a handler raise instead of refusing: a RecursionError from nested
    past-call arguments (was a 500), a tools field of the wrong type reaching the template, a tool_choice naming
    nothing, a Responses item missing its call_id; in a stream, a parser failing mid-stream (an error event
    saying the stream failed)."""
    base = CHAT if route.startswith("chat") else RESPONSES
    body = mutate({**base, "stream": route.endswith("stream")}, data)
    path = "/v1/chat/completions" if route.startswith("chat") else "/v1/responses"
    status, text = answer(server, path, body)
    assert status < 500, (status, text[:500], str(body)[:500])
    assert "the stream failed" not in text and "server_error" not in text, (text[:500], str(body)[:500])


def test_the_server_serves_on_after_the_malformed_bodies(server):  # noqa: F811
    """Catches a malformed body that left the server broken for the next one (a slot never given back, a dead
    engine loop)."""
    reply = post(server, "/v1/chat/completions", dict(model=NAME, messages=MESSAGES, max_tokens=2), headers={})
    assert reply.status_code == 200, reply.text
    assert server.serving.num_in_flight == 0
