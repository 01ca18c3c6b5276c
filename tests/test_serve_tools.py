"""Tools on /v1/chat/completions (serving_tools.py) through the server and the openai client: forced calls
follow their schemas, hermes calls are read under tool_choice "auto" and never under "none", streams give
the calls whole responses give, conversations with calls reach the chat template, and every bad tools
field is a 400 naming it. The server runs the bundled model with --chat-template set to TOOLS_TEMPLATE and
--enable-auto-tool-choice --tool-call-parser hermes."""
import pytest

# Test extras (pyproject.toml's [test]) this module needs: without one it is skipped, not an error
pytest.importorskip("httpx")
pytest.importorskip("jsonschema")
pytest.importorskip("openai")
import json
import re

import httpx
import jsonschema
import openai
from test_serve import NAME, model_path, post  # noqa: F401 (a fixture)

from nanoserve import LLMEngine
from nanoserve.config import Config
from nanoserve.entrypoints.openai.api_server import ServerThread, build_app
from nanoserve.entrypoints.openai.serving_tools import MAX_TOOLS

# Tools as their names, the calls as hermes writes them: short, for the bundled model's 256 positions.
TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|tools|>{% for t in tools %}{{ t.function.name }};{% endfor %}</s>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "{% if m.tool_call_id %}[{{ m.tool_call_id }}]{% endif %}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
ENGINE = dict(device="cpu", block_size=8, num_kvcache_blocks=200, max_model_len=256)
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"]}
TIME = {"type": "object", "properties": {"zone": {"enum": ["GMT", "CET"]}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Bath?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# The hermes text a structured_outputs regex makes the model write: the one way to see "auto" parse it.
HERMES = 'Hi <tool_call>{"name": "get_weather", "arguments": {"city": "Bath", "days": 2}}</tool_call>'
HERMES_REGEX = HERMES.replace("{", "\\{").replace("}", "\\}")


@pytest.fixture(scope="module")
def server(model_path):  # noqa: F811
    engine = LLMEngine(Config.from_kwargs(model_path, **ENGINE))
    server = ServerThread(build_app(engine, NAME, chat_template=TOOLS_TEMPLATE, tool_call_parser="hermes")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


def chat(client, **fields):
    body = dict(model=NAME, messages=MESSAGES, tools=TOOLS, max_tokens=100, temperature=0.8, seed=1) | fields
    if "structured_outputs" in body:  # vLLM's extra, outside the openai client's parameters
        body["extra_body"] = {"structured_outputs": body.pop("structured_outputs")}
    return client.chat.completions.create(**body)


def calls_of(message) -> list[tuple[str, str]]:
    return [(call.function.name, call.function.arguments) for call in message.tool_calls or []]


def streamed(client, **fields) -> tuple[str | None, list[tuple[str, str]], str]:
    """A stream put together as a client does: (content or None, [(name, arguments)], finish_reason). Each
    call's id and name come once, in its first delta."""
    content, calls, finish_reason = "", {}, None
    for chunk in chat(client, stream=True, **fields):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.index not in calls:
                assert call.id and call.function.name
                calls[call.index] = [call.function.name, call.function.arguments or ""]
            else:
                assert call.id is None and call.function.name is None
                calls[call.index][1] += call.function.arguments
        finish_reason = chunk.choices[0].finish_reason or finish_reason
    return content or None, [tuple(calls[i]) for i in sorted(calls)], finish_reason


def test_a_named_function_call_follows_its_schema(client):
    """Catches the grammar not applied (Austen's prose is no JSON), the wrong function's schema, the
    arguments not a JSON string, finish_reason left "stop"."""
    for seed in (1, 2, 3):
        choice = chat(client, tool_choice=NAMED, seed=seed).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [(name, arguments)] = calls_of(choice.message)
        assert name == "get_weather"
        jsonschema.validate(json.loads(arguments), WEATHER)
        assert choice.message.tool_calls[0].id.startswith("call_")


def test_required_calls_follow_their_own_schemas(client):
    """"required": every call names a tool and follows that tool's schema; parallel_tool_calls false gives
    exactly one call. Catches the anyOf pairing a name with another tool's parameters, maxItems ignored."""
    for seed in (1, 2, 3, 4):
        choice = chat(client, tool_choice="required", parallel_tool_calls=False, seed=seed).choices[0]
        [(name, arguments)] = calls_of(choice.message)
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
        assert choice.finish_reason == "tool_calls"
    choice = chat(client, tool_choice="required", max_tokens=150, seed=2).choices[0]
    assert len(calls_of(choice.message)) >= 1
    for name, arguments in calls_of(choice.message)[:-1] if choice.finish_reason == "length" else \
            calls_of(choice.message):
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


STREAMED = [dict(tool_choice=NAMED), dict(tool_choice="required", parallel_tool_calls=False),
            dict(tool_choice=NAMED, max_tokens=5),
            dict(structured_outputs={"regex": HERMES_REGEX}, max_tokens=120, temperature=0)]


@pytest.mark.parametrize("fields", STREAMED)
def test_a_stream_gives_the_calls_of_the_whole_response(client, fields):
    """The same seeded request streamed and not: the same content, calls and finish_reason. Catches argument
    pieces lost or repeated, an id or name sent twice, finish_reason "tool_calls" lost in the stream, and
    under max_tokens inside a call (5 tokens): "length" with the arguments' prefix, as OpenAI answers."""
    choice = chat(client, **fields).choices[0]
    expected = (choice.message.content, calls_of(choice.message), choice.finish_reason)
    assert streamed(client, **fields) == expected
    if fields.get("max_tokens") == 5:
        assert choice.finish_reason == "length"
        with pytest.raises(json.JSONDecodeError):
            json.loads(expected[1][0][1])


def test_auto_reads_hermes_calls_and_none_never_does(client, server, monkeypatch):
    """tool_choice "auto" (the default) with --tool-call-parser hermes: the call is read and the text
    around it is content; "none" never parses (vLLM's #42747); a server without the parser answers text."""
    fields = dict(structured_outputs={"regex": HERMES_REGEX}, max_tokens=120, temperature=0)
    choice = chat(client, **fields).choices[0]
    assert choice.message.content == "Hi" and choice.finish_reason == "tool_calls"
    assert calls_of(choice.message) == [("get_weather", '{"city": "Bath", "days": 2}')]
    for tool_choice in ("none", None):
        if tool_choice is None:  # auto, on a server started without --enable-auto-tool-choice
            monkeypatch.setattr(server.serving, "tool_call_parser", None)
        choice = chat(client, tool_choice=tool_choice or "auto", **fields).choices[0]
        assert choice.message.content == HERMES and not choice.message.tool_calls
        assert choice.finish_reason == "stop"


@pytest.mark.parametrize("call", ['{"name": "get_weather", "arguments": {"city": Bath}}',
                                  '{"name": "get_weather", "arguments": {"city": "Bath",}}',
                                  '{"name": "get_weather", "arguments": {"city": "Bath"]}',
                                  '{"name": "launch_rockets", "arguments": {"city": "Bath"}}'],
                         ids=["bare-word", "trailing-comma", "wrong-bracket", "undeclared"])
def test_auto_returns_a_broken_call_as_content(client, call):
    """Under "auto" the model writes calls freely: arguments that are no JSON object, or a function not in
    tools, are no call. Catches: such a call returned in tool_calls with finish_reason "tool_calls" (hermes
    and llama3_json both did), which a client then runs or fails to parse."""
    text = f"Hi <tool_call>{call}</tool_call>"
    regex = re.escape(text)
    choice = chat(client, structured_outputs={"regex": regex}, max_tokens=120, temperature=0).choices[0]
    assert choice.message.content == text and not choice.message.tool_calls, choice
    assert choice.finish_reason == "stop"
    assert streamed(client, structured_outputs={"regex": regex}, max_tokens=120, temperature=0)[2] == "stop"


def test_required_with_parallel_tool_calls_omitted_allows_several_calls(client, server):
    """tool_choice "required" with parallel_tool_calls omitted allows several calls, as with true (OpenAI's
    default). Catches: a grammar that allows one call unless the flag is true (every other test passes false,
    so a maxItems of 1 for an omitted flag went unnoticed)."""
    from nanoserve.entrypoints.openai.protocol import ChatBody
    from nanoserve.entrypoints.openai.serving_tools import TOOL_CHAT_APIS, forced_schema
    from nanoserve.entrypoints.openai.tool_parsers import parse
    for flag in (None, True):
        body = ChatBody(model=NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required",
                        **({} if flag is None else {"parallel_tool_calls": flag}))
        assert "maxItems" not in forced_schema(body)
    two = ('[{"name": "get_time", "parameters": {"zone": "GMT"}}, '
           '{"name": "get_weather", "parameters": {"city": "Bath", "days": 2}}]')
    body = ChatBody(model=NAME, messages=MESSAGES, tools=TOOLS, tool_choice="required")
    api = TOOL_CHAT_APIS["hermes"](body, [], 1, server.serving.token_strings)
    assert api.max_calls is None and len(parse(api.parse, two).calls[:api.max_calls]) == 2
    # through the server: the grammar lets the model write the two calls
    reply = post(server, "/v1/chat/completions", dict(model=NAME, messages=MESSAGES, tools=TOOLS, max_tokens=120,
                                                      tool_choice="required", temperature=0), headers={})
    assert reply.status_code == 200, reply.text


def test_n_choices_are_each_their_own_request(client):
    """n=2, streamed and not: choice i equals the request alone with seed + i. Catches one parser (or one
    stream's state) shared by the choices: their arrays read as one."""
    fields = dict(tool_choice="required", parallel_tool_calls=False)
    alone = [calls_of(chat(client, seed=7 + i, **fields).choices[0].message) for i in range(2)]
    together = chat(client, seed=7, n=2, **fields)
    assert [calls_of(c.message) for c in sorted(together.choices, key=lambda c: c.index)] == alone
    calls = {0: "", 1: ""}
    for chunk in chat(client, seed=7, n=2, stream=True, **fields):
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                calls[choice.index] += call.function.arguments or ""
    assert [calls[0], calls[1]] == [a[0][1] for a in alone]


def test_a_conversation_with_calls_reaches_the_template(client, server):
    """An assistant message with tool_calls (no content) and a "tool" message go to the template as
    transformers' templates take them: the arguments a dict (tojson once), the tool_call_id, the tools;
    the template is --chat-template's (the model's own writes neither). Counted against the prompt written
    out by hand. Catches tool_calls or tool_call_id dropped, arguments quoted twice, the tools or
    --chat-template ignored."""
    messages = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Bath"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain"}]
    reply = chat(client, messages=messages, max_tokens=1)
    prompt = ('<s><|tools|>get_weather;get_time;</s><|user|>What is the weather in Bath?</s><|assistant|>'
              '<tool_call>{"name": "get_weather", "arguments": {"city": "Bath"}}</tool_call></s>'
              '<|tool|>rain[call_1]</s><|assistant|>')
    tokenizer = server.serving.tokenizer
    assert reply.usage.prompt_tokens == len(tokenizer.encode(prompt, add_special_tokens=False))


BAD = [  # (the body's changes, the field a 400 must name)
    (dict(tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "frobnicate"}}}]), "tools"),
    (dict(tools=[{"type": "function", "function": {"name": f"f{i}"}} for i in range(MAX_TOOLS + 1)]), "tools"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "description": "x" * 2**18}}]), "tools"),
    (dict(tools=[{"type": "function", "function": {"name": "get weather"}}]), "tools"),
    (dict(tools=TOOLS + TOOLS[:1]), "tools"),
    (dict(tools=[{"type": "retrieval"}]), "tools"),
    (dict(tools=None, tool_choice="required"), "tool_choice"),
    (dict(tool_choice="sometimes"), "tool_choice"),
    (dict(tool_choice=NAMED, response_format={"type": "json_object"}), "tool_choice"),
    (dict(messages=[{"role": "user"}]), "messages"),
    # a pattern nested 30,000 deep: past the grammar bounds, refused before xgrammar's regex converter (which
    # recursed until the process crashed) reads it, under tool_choice "auto" too
    (dict(tools=[{"type": "function", "function": {"name": "deep", "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "pattern": "(" * 30000 + ")" * 30000}}}}}]), "tools"),
    # 15,000 quantifiers stacked on one character (depth 1 to a bracket count) crashed xgrammar's converter,
    # under "none" too, where no grammar uses the schema: refused by the shape check, never parsed
    (dict(tool_choice="none", tools=[{"type": "function", "function": {"name": "q", "parameters": {
        "type": "object", "properties": {"s": {"type": "string", "pattern": "a" + "{1}" * 15000}}}}}]), "tools"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}]),
     "tools"),
]


@pytest.mark.parametrize("changes, field", BAD)
def test_bad_tools_are_a_400_naming_the_field(server, changes, field):
    body = {k: v for k, v in (dict(model=NAME, messages=MESSAGES, tools=TOOLS, max_tokens=4) | changes).items()
            if v is not None}
    reply = post(server, "/v1/chat/completions", body, headers={})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == field, reply.text


def test_tool_schemas_are_parsed_only_for_a_forced_call(server, monkeypatch):
    """tool_choice "none" and "auto" check the tools' shape in plain Python and parse no schema; "required" and a
    named function compile their grammar (in a grammar worker). Catches every tool's schema parsed by xgrammar
    whatever tool_choice said: 128 tools nested 62 deep cost 1.4 s a request under "none", where no grammar is used,
    and eight such requests held another client 10.4 s."""
    grammars, asked = server.serving.grammars, []
    original = grammars.submit  # every parse and compile goes through it
    monkeypatch.setattr(grammars, "submit", lambda spec, *args, **kwargs:
                        asked.append(spec) or original(spec, *args, **kwargs))
    body = dict(model=NAME, messages=MESSAGES, tools=TOOLS, max_tokens=2)
    for tool_choice in ("none", "auto", None):
        reply = post(server, "/v1/chat/completions", body | ({"tool_choice": tool_choice} if tool_choice else {}),
                     headers={})
        assert reply.status_code == 200 and asked == [], (tool_choice, reply.text)
    for tool_choice in ("required", NAMED):
        reply = post(server, "/v1/chat/completions", body | {"tool_choice": tool_choice, "max_tokens": 4}, headers={})
        assert reply.status_code == 200 and asked, (tool_choice, reply.text)  # compiled, then the engine's cache hit
        asked.clear()


def test_tools_on_completions_stay_refused_and_the_server_serves_on(server):
    reply = post(server, "/v1/completions", dict(model=NAME, prompt="Emma", tools=TOOLS), headers={})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "tools"
    reply = httpx.post(server.url + "/v1/chat/completions", json=dict(model=NAME, messages=MESSAGES, max_tokens=3),
                       timeout=60)
    assert reply.status_code == 200 and reply.json()["choices"][0]["finish_reason"] == "length"


@pytest.fixture(scope="module")
def spec_client(model_path):  # noqa: F811
    speculative_config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}
    config = Config.from_kwargs(model_path, **ENGINE, speculative_config=speculative_config)
    server = ServerThread(build_app(LLMEngine(config), NAME, chat_template=TOOLS_TEMPLATE,
                                    tool_call_parser="hermes")).start()
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    server.stop()


def test_speculative_decoding_serves_the_same_calls(client, spec_client):
    """A server with n-gram speculative decoding answers what the plain one does: forced calls (a grammar's
    request takes no drafts), and under "auto" a greedy output whose repetitions the drafts predict, so that
    its deltas carry several tokens, streamed and whole. Catches tool requests served differently under
    speculative decoding (drafts taken by a grammar's request, a formatter that assumes one token per delta);
    the parsers' own chunking is test_tool_parsers.py's."""
    for fields in (dict(tool_choice=NAMED), dict(tool_choice="required", parallel_tool_calls=False),
                   dict(temperature=0, max_tokens=80)):
        expected = chat(client, **fields).choices[0]
        got = chat(spec_client, **fields).choices[0]
        assert (got.message.content, calls_of(got.message)) == (expected.message.content, calls_of(expected.message))
        assert streamed(spec_client, **fields) == (expected.message.content, calls_of(expected.message),
                                                   expected.finish_reason)
    def num_chunks(client) -> int:
        return sum(1 for chunk in chat(client, stream=True, temperature=0, max_tokens=80) if chunk.choices)
    assert num_chunks(spec_client) < num_chunks(client)  # drafts were accepted: some deltas held several tokens
