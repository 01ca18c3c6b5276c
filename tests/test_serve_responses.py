"""POST /v1/responses (serving_responses.py) through the openai client's responses.create and its stream
helper: plain, streamed, with text.format json_schema and with function tools, each against the same
request on /v1/chat/completions; the stateless fields' 400s."""
import pytest

# Test extras (pyproject.toml's [test]) this module needs: without one it is skipped, not an error
pytest.importorskip("jsonschema")
import json

import jsonschema
from test_serve import NAME, model_path, post  # noqa: F401 (a fixture)
from test_serve_tools import MESSAGES, TOOLS, WEATHER, client, server  # noqa: F401 (fixtures)

RESPONSES_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]
VISIT = {"type": "object", "required": ["guest", "rooms"], "additionalProperties": False,
         "properties": {"guest": {"type": "string", "maxLength": 8},
                        "rooms": {"type": "integer", "minimum": 1, "maximum": 9}}}


def test_plain_response_equals_the_chat_completion(client):  # noqa: F811
    """Catches instructions or input lost on the way to the template, max_output_tokens ignored, usage
    miscounted, output_text not where the client reads it, the status of a cut response."""
    reply = client.responses.create(model=NAME, instructions="Be brief.", input="Who is Emma?", max_output_tokens=12,
                                    temperature=0)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who is Emma?"}]
    chat = client.chat.completions.create(model=NAME, messages=messages, max_tokens=12, temperature=0)
    assert reply.output_text == chat.choices[0].message.content and reply.output_text
    assert (reply.usage.input_tokens, reply.usage.output_tokens) == (chat.usage.prompt_tokens, 12)
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert reply.id.startswith("resp_") and reply.output[0].type == "message"


def test_streamed_response_equals_the_whole_one(client):  # noqa: F811
    """The stream helper's events: created first, completed last, the text deltas adding up to the whole
    response's text, sequence numbers in order. Catches an event the helper rejects (it raises), a delta
    lost, the final response missing its output."""
    fields = dict(model=NAME, input="Emma was", max_output_tokens=16, temperature=0)
    whole = client.responses.create(**fields)
    with client.responses.stream(**fields) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert [e for e in events if e.type == "response.output_text.done"][0].text == whole.output_text
    assert final.output_text == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_json_schema_text_format(client):  # noqa: F811
    """text.format json_schema reaches the structured outputs, streamed and not. Catches the format dropped
    (Austen's prose is no JSON)."""
    text = {"format": {"type": "json_schema", "name": "visit", "schema": VISIT, "strict": True}}
    fields = dict(model=NAME, input="Who came?", text=text, max_output_tokens=80, temperature=0.8)
    reply = client.responses.create(**fields)
    jsonschema.validate(json.loads(reply.output_text), VISIT)
    with client.responses.stream(**fields) as stream:
        jsonschema.validate(json.loads(stream.get_final_response().output_text), VISIT)


def test_function_call_and_the_loop_back(client):  # noqa: F811
    """A forced function: a function_call item whose arguments follow the schema; streamed, the arguments'
    deltas add up to them. Then the agent loop's second request (input + the call + its output) is served,
    its prompt longer by the call and its result. Catches the flat tools or tool_choice not mapped to chat's,
    function_call items missing, the call or its output dropped from the next prompt."""
    fields = dict(model=NAME, input="Weather in Bath?", tools=RESPONSES_TOOLS, max_output_tokens=100,
                  tool_choice={"type": "function", "name": "get_weather"}, temperature=0)
    reply = client.responses.create(**fields)
    [call] = reply.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    with client.responses.stream(**fields) as stream:
        events = list(stream)
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert "".join(pieces) == call.arguments and len(pieces) > 1
    loop = [{"role": "user", "content": "Weather in Bath?"}, call.model_dump(exclude_none=True),
            {"type": "function_call_output", "call_id": call.call_id, "output": "rain"}]
    again = client.responses.create(model=NAME, input=loop, tools=RESPONSES_TOOLS, tool_choice="none",
                                    max_output_tokens=4, temperature=0)
    assert again.output_text and again.usage.input_tokens > reply.usage.input_tokens + 20


@pytest.mark.parametrize("changes, field", [
    (dict(previous_response_id="resp_1"), "previous_response_id"),
    (dict(store=True), "store"),
    (dict(background=True), "background"),       # was ignored: answered in the foreground
    (dict(max_tool_calls=1), "max_tool_calls"),  # was ignored: any number of calls
    (dict(input=[{"type": "reasoning", "summary": []}]), "input"),
    (dict(input=[{"role": "robot", "content": "hi"}]), "input"),
    (dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]), "input"),
    (dict(tool_choice={"type": "function", "name": "nope"}, tools=RESPONSES_TOOLS), "tool_choice"),
    (dict(text={"format": {"type": "json_schema", "name": "x"}}), "text"),
    (dict(input=5), "input"),
])
def test_bad_responses_fields_are_a_400_naming_them(server, changes, field):  # noqa: F811
    reply = post(server, "/v1/responses", dict(model=NAME, input="Hi", max_output_tokens=4) | changes, headers={})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == field, reply.text
