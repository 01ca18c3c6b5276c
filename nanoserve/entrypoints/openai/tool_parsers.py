"""Tool calls read out of a model's text: the hermes format, and the JSON a forced call's grammar writes.

A parser is a pure function `parse(text, final) -> Parsed`: the content and the calls that the text so far
shows for certain. `final` says the text is the whole output; before that, whatever might still turn
into something else is held back (a "<tool_ca" that may become a tag, trailing whitespace that may end up
between two calls, a call whose name is not complete). What a parser shows only grows as the text does:
each later `Parsed` extends the one before (the content, the list of calls, each call's arguments). So a
stream can send the differences (`ToolCallStream`), and what it sends adds up to the whole text's parse,
however the text was cut into deltas: one token at a time, or several (speculative decoding).

A call's `arguments` is the JSON text of the arguments as the model wrote it (OpenAI's shape: a string),
cut short where the output was (max_tokens).

The formats:
- hermes (Qwen2.5/3, Hermes and many fine-tunes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  any number of them, text around them is content;
- llama3_json (Llama 3.1/3.2): the whole output one JSON object `{"name": ..., "parameters": {...}}`, or
  several joined by "; ";
- a named function forced (tool_choice {"type": "function", ...}): the output is the arguments;
- tool_choice "required": the output is a JSON array of {"name": ..., "parameters": {...}}.
The JSON is read by `top_level_values`, which finds the spans of an object's members (or an array's items)
in a text that may stop anywhere, from a regex's tokens.
"""
from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass

# One JSON token: a string (its closing quote in the group `closed`, absent while the text stops inside
# it), a punctuation mark, a literal (number, true, false, null) or a run of whitespace.
TOKEN = re.compile(r'"(?:[^"\\]|\\.)*(?P<closed>")?|[{}\[\]:,]|[^\s{}\[\]:,"]+|\s+', re.DOTALL)
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str   # JSON text as the model wrote it; a prefix of it while the output is cut short
    complete: bool   # the arguments are a whole JSON value


@dataclass(frozen=True)
class Parsed:
    content: str
    calls: list[ToolCall]


Parser = Callable[[str, bool], Parsed]


@dataclass(frozen=True)
class Span:
    """Where one JSON value lies in a text: [start, end); end None while the text stops inside it."""
    start: int
    end: int | None


def top_level_values(text: str) -> tuple[list[tuple[str | None, Span]], int | None]:
    """The members of the JSON object (key, span) or the items of the array (None, span) that `text`
    begins, as far as the text goes, and where the container ends (None: not closed). Nested values are
    skipped by counting brackets outside strings. Invalid JSON stops the reading where it goes wrong."""
    values: list[tuple[str | None, Span]] = []
    depth, key, state, is_object = 0, None, "open", False
    for match in TOKEN.finditer(text):
        token = match.group()
        if token.isspace():
            continue
        is_string = token.startswith('"')
        unclosed_string = is_string and match.group("closed") is None
        open_literal = not is_string and token not in "{}[]:," and match.end() == len(text)  # may go on: "tru"
        if unclosed_string or open_literal:  # the text stops inside this token
            if depth == 1 and state == "value":  # a member's value begins with it
                values.append((key, Span(match.start(), None)))
            break
        if state == "open":  # the first token: the container itself
            if token not in ("{", "["):
                break
            is_object = token == "{"
            depth, state = 1, "key" if is_object else "value"
        elif depth > 1:  # inside a nested value: only brackets count
            depth += (token in ("{", "[")) - (token in ("}", "]"))
            if depth == 1:
                values[-1] = (key, Span(values[-1][1].start, match.end()))
                state = "after"
        elif token in ("}", "]"):  # the container closes ("{}" and "[]" too)
            return values, match.end()
        elif state == "key" and is_string:
            key, state = json.loads(token), "colon"
        elif state == "colon" and token == ":":
            state = "value"
        elif state == "value" and token in ("{", "["):
            depth = 2
            values.append((key, Span(match.start(), None)))
        elif state == "value" and token not in ":,":
            values.append((key, Span(match.start(), match.end())))
            state = "after"
        elif state == "after" and token == ",":
            state = "key" if is_object else "value"
        else:  # invalid JSON: read no further
            break
    return values, None


def read_call(text: str, arguments_keys: tuple[str, ...]) -> ToolCall | None:
    """The call that the JSON object in `text` (perhaps cut short) writes: {"name": ..., <arguments key>: {...}};
    None until its name is complete. Without an arguments member, a closed object's arguments are {}."""
    members, end = top_level_values(text)
    closed = end is not None
    spans = dict(members)
    name_span = spans.get("name")
    if name_span is None or name_span.end is None:
        return None
    name = json.loads(text[name_span.start:name_span.end])
    if not isinstance(name, str):
        return None
    arguments_span = next((spans[key] for key in arguments_keys if key in spans), None)
    if arguments_span is None:
        return ToolCall(name, "{}" if closed else "", closed)
    end = arguments_span.end if arguments_span.end is not None else len(text)
    return ToolCall(name, text[arguments_span.start:end], arguments_span.end is not None)


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (and may become it)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def held_back(content: str, final: bool, calls: list[ToolCall]) -> str:
    """Content as shown so far: trailing whitespace waits (it may turn out to lie before a call), and is
    dropped at the end of an output with calls."""
    return content.rstrip() if not final or calls else content


def parse_hermes(text: str, final: bool) -> Parsed:
    """hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks; the text around them is
    content, and so is a block whose JSON has no name once it is closed."""
    content, calls, pos = [], [], 0
    while True:
        start = text.find(HERMES_OPEN, pos)
        if start < 0:
            rest = text[pos:]
            content.append(rest if final else rest[:len(rest) - partial_suffix(rest, HERMES_OPEN)])
            break
        content.append(text[pos:start])
        body_start = start + len(HERMES_OPEN)
        end = text.find(HERMES_CLOSE, body_start)
        body = text[body_start:end] if end >= 0 else text[body_start:]
        if end < 0 and not final:
            body = body[:len(body) - partial_suffix(body, HERMES_CLOSE)]
        call = read_call(body, ("arguments", "parameters"))
        if call is not None:
            calls.append(call)
        elif end >= 0 or final:  # no call after all: its text is content
            content.append(text[start:end + len(HERMES_CLOSE)] if end >= 0 else text[start:])
        if end < 0:
            break
        pos = end + len(HERMES_CLOSE)
    return Parsed(held_back("".join(content), final, calls), calls)


def parse_llama3_json(text: str, final: bool) -> Parsed:
    """llama3_json: an output that begins with '{' (after whitespace, or Llama's <|python_tag|>) is calls,
    {"name": ..., "parameters": {...}} objects joined by ";"; any other output is content."""
    stripped = text.lstrip()
    if stripped.startswith(PYTHON_TAG):
        stripped = stripped[len(PYTHON_TAG):].lstrip()
    if not stripped.startswith("{"):  # content, once its first characters say so
        undecided = not final and PYTHON_TAG.startswith(stripped)
        return Parsed("" if undecided else text, [])
    calls, pos = [], len(text) - len(stripped)
    while True:
        call = read_call(text[pos:], ("parameters", "arguments"))
        if call is not None:
            calls.append(call)
        _, end = top_level_values(text[pos:])
        if end is None:
            break
        separator = re.match(r"\s*;\s*\{", text[pos + end:])  # "; {" begins the next call
        if separator is None:
            break
        pos += end + separator.end() - 1
    return Parsed("", calls)


def named_parser(name: str) -> Parser:
    """A forced named function: the whole output is its arguments (the grammar writes nothing else)."""
    def parse(text: str, final: bool) -> Parsed:
        return Parsed("", [ToolCall(name, text, top_level_values(text)[1] is not None)])
    return parse


def parse_required(text: str, final: bool) -> Parsed:
    """tool_choice "required": the grammar's JSON array of {"name": ..., "parameters": {...}}."""
    items, _ = top_level_values(text)
    calls = []
    for _, span in items:
        call = read_call(text[span.start:span.end if span.end is not None else len(text)], ("parameters",))
        if call is not None:
            calls.append(call)
    return Parsed("", calls)


PARSERS: dict[str, Parser] = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}  # --tool-call-parser


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallStream:
    """One choice's output as a stream sends it: the text so far is parsed again at each delta (a call's
    cost grows with the square of its length: the price of a result that cannot depend on how the text
    was cut), and what is new since the last delta is sent: content, a call's index, id and name once,
    then pieces of its arguments. At most `max_calls` calls (parallel_tool_calls false: 1)."""

    def __init__(self, parse: Parser, max_calls: int | None) -> None:
        self.parse, self.max_calls = parse, max_calls
        self.text = ""
        self.num_content_sent = 0
        self.num_arguments_sent: list[int] = []  # per call: characters of its arguments sent
        self.calls: list[ToolCall] = []          # the calls so far, as last parsed

    def feed(self, text: str, final: bool) -> tuple[str, list[dict]]:
        """The new content and the tool_calls deltas, after `text` (the output's next piece)."""
        self.text += text
        parsed = self.parse(self.text, final)
        self.calls = parsed.calls[:self.max_calls]
        content = parsed.content[self.num_content_sent:]
        self.num_content_sent = len(parsed.content)
        deltas = []
        for index, call in enumerate(self.calls):
            if index == len(self.num_arguments_sent):
                function = dict(name=call.name, arguments=call.arguments)
                deltas.append(dict(index=index, id=new_call_id(), type="function", function=function))
                self.num_arguments_sent.append(len(call.arguments))
            elif len(call.arguments) > self.num_arguments_sent[index]:
                piece = call.arguments[self.num_arguments_sent[index]:]
                deltas.append(dict(index=index, function=dict(arguments=piece)))
                self.num_arguments_sent[index] = len(call.arguments)
        return content, deltas
