"""Tools on /v1/chat/completions, and on /v1/responses, which reuses them.

This file holds the checks, the tools as the chat template takes them, and the grammar of a forced call.
It also holds `ToolChatAPI`, the chat choices with tool calls.

tool_choice says how a choice's text is read (OpenAI's names, vLLM's behaviour).
- "none": plain text, never parsed. The tools still reach the chat template.
- "auto" (the default with tools): read by the server's tool parser (--enable-auto-tool-choice
  --tool-call-parser hermes). Without a parser, plain text.
- "required", or a named function ({"type": "function", "function": {"name": ...}}). The output follows a
  grammar built from the tools' JSON schemas (structured_outputs.py). So the call always parses, and its
  arguments match the schema. A named function's output is its arguments alone. "required"'s output is a
  JSON array of {"name": ..., "parameters": {...}}, one item if parallel_tool_calls is false.

The calls themselves are read by tool_parsers.py. A choice with calls ends with finish_reason "tool_calls"
where the output stopped by itself with every call's arguments whole. "length" stays "length", the last
call's arguments cut short (as OpenAI answers).
"""
from __future__ import annotations

import json
import re

from nanoserve.entrypoints.openai.chat_api import ChatAPI
from nanoserve.entrypoints.openai.protocol import (
    APIError,
    ChatBody,
    FunctionDefinition,
    Limits,
    NamedToolChoice,
    StructuredOutputsBody,
    Tool,
    shorten,
)
from nanoserve.entrypoints.openai.serving_engine import Shown
from nanoserve.entrypoints.openai.tool_parsers import (
    HermesReader,
    Llama3JsonReader,
    Parser,
    RequiredReader,
    ToolCall,
    ToolCallStream,
    named_parser,
    new_call_id,
    parse,
)
from nanoserve.extensions.grammar_bounds import check_bounds
from nanoserve.sampling_params import InvalidRequest

MAX_TOOLS = 128                                # tools in one request: OpenAI's limit
MAX_TOOLS_BYTES = 2**18                        # their JSON together; more: 400
TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # OpenAI's rule for a function's name


def parameters_schema(function: FunctionDefinition) -> dict:
    """A function's parameters as a JSON schema; none given: an empty object."""
    return function.parameters if function.parameters is not None else {"type": "object", "properties": {}}


def is_forced(body: ChatBody) -> bool:
    return body.tool_choice == "required" or isinstance(body.tool_choice, NamedToolChoice)


def check_tools(body: ChatBody) -> None:
    """On the event loop: tools and tool_choice as OpenAI takes them, and within this server's bounds.

    Else a 400 names the field. Each schema's shape is checked in the tokenizer thread (`check_tool_schemas`)."""
    tools = body.tools or []
    if len(tools) > MAX_TOOLS:
        raise APIError(f"tools has {len(tools)} entries; this server takes at most {MAX_TOOLS}", param="tools")
    num_bytes = len(json.dumps([tool.model_dump(exclude_none=True) for tool in tools]))
    if num_bytes > MAX_TOOLS_BYTES:
        raise APIError(f"tools has {num_bytes} bytes of JSON; this server takes at most {MAX_TOOLS_BYTES}",
                       param="tools")
    names = [tool.function.name for tool in tools]
    for i, name in enumerate(names):
        if not TOOL_NAME.fullmatch(name):
            raise APIError(f"tools.{i}.function.name {shorten(repr(name))} must be 1 to 64 letters, digits, "
                           "underscores or dashes", param="tools")
    if len(set(names)) < len(names):
        raise APIError("tools: two functions have the same name", param="tools")
    choice = body.tool_choice
    if choice is not None and choice != "none" and not tools:
        raise APIError("tool_choice needs tools", param="tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise APIError(f"tool_choice names the function {shorten(repr(choice.function.name))}, which is not in "
                       "tools", param="tool_choice")
    format_type = body.response_format.type if body.response_format is not None else "text"
    if is_forced(body) and (format_type != "text" or body.structured_outputs is not None):
        raise APIError("a forced tool_choice (required, or a named function) cannot be combined with "
                       "response_format or structured_outputs: the call's grammar decides the output",
                       param="tool_choice")


JSON_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}


def check_tool_schemas(tools: list[Tool] | None, limits: Limits) -> None:
    """In the tokenizer thread: check each function's parameters, else a 400.

    They must be shaped as a JSON schema: an object whose `type` names JSON types. They must be within the
    grammar bounds (grammar_bounds.py: bytes, depth, quantifiers, keywords no output can satisfy).
    The check is plain Python, in time linear in the tools' bytes (MAX_TOOLS_BYTES: at most ~0.2 s).
    No schema is parsed by xgrammar here. Only a forced tool_choice's grammar is. It is compiled in a
    grammar worker's process like any other. Parsing every tool under "none" took 1.4 s a request, for
    128 tools nested 62 deep."""
    for i, tool in enumerate(tools or []):
        schema, where = parameters_schema(tool.function), f"tools.{i}.function.parameters"
        types = schema.get("type", "object")
        names = [types] if isinstance(types, str) else types if isinstance(types, list) else [None]
        if not all(isinstance(name, str) and name in JSON_TYPES for name in names):
            raise APIError(f"{where}.type {shorten(repr(types))} is not a JSON type ({', '.join(sorted(JSON_TYPES))})",
                           param="tools")
        try:
            check_bounds({"json": schema}, limits.max_grammar_bytes, limits.max_grammar_depth)
        except InvalidRequest as error:
            raise APIError(f"{where} is not a JSON schema this server can follow: it "
                           f"{str(error).removeprefix('structured_outputs ')}", param="tools") from None


def forced_schema(body: ChatBody) -> dict | None:
    """The JSON schema the output must follow for a forced tool_choice; None for none and auto."""
    choice = body.tool_choice
    if isinstance(choice, NamedToolChoice):
        function = next(tool.function for tool in body.tools if tool.function.name == choice.function.name)
        return parameters_schema(function)
    if choice != "required":
        return None
    # name first: a stream can send it before the arguments
    calls = [{"type": "object", "properties": {"name": {"const": tool.function.name},
                                               "parameters": parameters_schema(tool.function)},
              "required": ["name", "parameters"], "additionalProperties": False} for tool in body.tools]
    schema = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if body.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return schema


def prepare_tools(body: ChatBody, auto_parser: str | None) -> tuple[ChatBody, type[ChatAPI]]:
    """The checked body, with a forced call's grammar as its structured_outputs, and its formatter.

    The formatter shows the body's choices. It is ChatAPI without tools, else the ToolChatAPI of the
    server's parser for "auto"."""
    check_tools(body)
    if not body.tools:
        return body, ChatAPI
    schema = forced_schema(body)
    if schema is not None:
        body = body.model_copy(update={"structured_outputs": StructuredOutputsBody(json=schema)})
    return body, TOOL_CHAT_APIS[auto_parser]


def template_tools(body: ChatBody) -> list[dict] | None:
    """The tools as transformers' apply_chat_template(tools=...) takes them: OpenAI's JSON."""
    return [tool.model_dump(exclude_none=True) for tool in body.tools] if body.tools else None


def tool_finish_reason(engine_reason: str | None, calls: list[ToolCall]) -> str | None:
    """"tool_calls" where the output stopped by itself with every call whole; else the engine's reason."""
    if engine_reason == "stop" and calls and all(call.complete for call in calls):
        return "tool_calls"
    return engine_reason


class ToolChatAPI(ChatAPI):
    """/v1/chat/completions' choices, streamed or whole, with tool calls read from each choice's text.

    The module's docstring says how. A subclass per --tool-call-parser names the parser of "auto"."""
    auto_parser: Parser | None = None  # tool_choice "auto": None answers plain text

    def __init__(self, body: ChatBody, *args: object) -> None:
        super().__init__(body, *args)
        self.parse = self.choose_parser(body)
        self.max_calls = 1 if body.parallel_tool_calls is False else None
        # "auto": the model wrote the calls freely; one that is no call of a declared tool is text
        self.checks_calls = given_choice(body) == "auto"
        self.declared = {tool.function.name for tool in body.tools or []}
        self.streams: dict[int, ToolCallStream] = {}  # a stream's choices: each its own

    def choose_parser(self, body: ChatBody) -> Parser | None:
        choice = given_choice(body)
        if isinstance(choice, NamedToolChoice):
            return named_parser(choice.function.name)
        if choice == "required":
            return RequiredReader
        if choice == "auto":
            return self.auto_parser
        return None  # "none": never parsed

    def choice(self, index: int, shown: Shown) -> dict:
        if self.parse is None or shown.text is None:
            return super().choice(index, shown)
        parsed = parse(self.parse, shown.text, cut_short=shown.finish_reason != "stop")
        calls = parsed.calls[:self.max_calls]
        if not self.are_calls(calls):  # the whole text as content, finish_reason the engine's
            return super().choice(index, shown)
        message = dict(role="assistant", content=parsed.content if parsed.content or not calls else None)
        if calls:
            message["tool_calls"] = [dict(id=new_call_id(), type="function",
                                          function=dict(name=call.name, arguments=call.arguments)) for call in calls]
        return dict(index=index, message=message, logprobs=self.logprobs_object(shown),
                    finish_reason=tool_finish_reason(shown.finish_reason, calls))

    def chunk_choice(self, index: int, shown: Shown) -> dict | None:
        if self.parse is None or shown.text is None:
            return super().chunk_choice(index, shown)
        stream = self.streams.setdefault(index, ToolCallStream(self.parse, self.max_calls))
        content, tool_calls = stream.feed(shown.text, final=shown.finish_reason is not None,
                                          cut_short=shown.finish_reason != "stop")
        delta = {}
        if content:
            delta["content"] = content
        if tool_calls:
            delta["tool_calls"] = tool_calls
        logprobs = self.logprobs_object(shown)
        if not delta and shown.finish_reason is None and logprobs is None:
            return None  # all of it held back
        finish_reason = shown.finish_reason
        if finish_reason is not None and self.are_calls(calls := stream.tool_calls()):
            finish_reason = tool_finish_reason(finish_reason, calls)
        # (calls already streamed cannot be taken back; the reason at least is true)
        return dict(index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason)

    def are_calls(self, calls: list[ToolCall]) -> bool:
        """Under "auto": each whole call names a declared tool, and its arguments are a JSON object.

        Else the output is no call. Without this check, `{"city": Bath}`, `{"city": "Bath",}` and an
        undeclared function came back as calls, with finish_reason "tool_calls". A call cut short
        (max_tokens) stays a call, as OpenAI answers."""
        return not self.checks_calls or all(not call.complete or call.name in self.declared
                                            and is_json_object(call.arguments) for call in calls)


def is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        return False


def given_choice(body: ChatBody) -> str | NamedToolChoice:
    """tool_choice as given, "auto" by default (tools given: OpenAI's default)."""
    return body.tool_choice if body.tool_choice is not None else "auto"


class HermesChatAPI(ToolChatAPI):
    auto_parser = HermesReader


class Llama3JsonChatAPI(ToolChatAPI):
    auto_parser = Llama3JsonReader


# The formatter of a request with tools, by the server's --tool-call-parser (None: "auto" answers text).
TOOL_CHAT_APIS: dict[str | None, type[ToolChatAPI]] = {None: ToolChatAPI, "hermes": HermesChatAPI,
                                                      "llama3_json": Llama3JsonChatAPI}
