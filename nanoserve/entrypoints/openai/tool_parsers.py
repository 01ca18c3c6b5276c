"""Tool calls read out of a model's text: the hermes format, and the JSON a forced call's grammar writes.

A parser reads one output as it grows (`ToolReader.read(text, final)`). Each time it is given the whole
text so far. It returns the content new since the last reading. It keeps the calls that the text so far
shows for certain. `final` says the text is the whole output. Before that, whatever might still turn into
something else is held back. A "<tool_ca" may become a tag. Trailing whitespace may end up between two
calls. A call's name may not be complete yet.

What a reader shows only grows as the text does: the content, the list of calls, each call's arguments.
So a stream sends the differences (`ToolCallStream`). What it sends adds up to the whole text's parse
(`parse`: one reading of the whole text). That holds however the text was cut into deltas: one token at a
time, or several (speculative decoding).

Each reading goes on where the last one stopped. `JsonScan` (json_scan.py) keeps its place in the JSON,
and a reader its place in the text. So a stream's parsing costs time linear in its output's length.
Parsing the whole text again at each delta cost a 4,900-delta call 16.5 s of event loop, 6.5 ms for its
last delta.

A call's `arguments` is the JSON text of the arguments as the model wrote it (OpenAI's shape: a string).
It is cut short where the output was (max_tokens).

The formats:
- hermes (Qwen2.5/3, Hermes and many fine-tunes): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
  Any number of them; the text around them is content.
- llama3_json (Llama 3.1/3.2): the whole output is one JSON object `{"name": ..., "parameters": {...}}`,
  or several joined by "; ".
- A named function forced (tool_choice {"type": "function", ...}): the output is the arguments.
- tool_choice "required": the output is a JSON array of {"name": ..., "parameters": {...}}.
"""
from __future__ import annotations

import functools
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from nanoserve.entrypoints.openai.json_scan import JsonScan

SEPARATOR = re.compile(r"\s*;\s*\{")  # llama3_json: "; {" begins the next call
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



@dataclass(frozen=True)
class CallRead:
    """A call as read so far: its arguments are text[start:end].

    Where the call has no arguments member, they are `fixed` instead ("{}" once its object is closed).
    So a stream slices only the piece it has not sent."""
    name: str
    start: int
    end: int
    complete: bool
    fixed: str | None = None

    def arguments(self, text: str, num_sent: int = 0) -> str:
        """The arguments past their first num_sent characters."""
        return self.fixed[num_sent:] if self.fixed is not None else text[self.start + num_sent:self.end]

    def tool_call(self, text: str) -> ToolCall:
        return ToolCall(self.name, self.arguments(text), self.complete)



def read_call(text: str, scan: JsonScan, stop: int, arguments_keys: tuple[str, ...]) -> CallRead | None:
    """The call written by the JSON object that `scan` reads (perhaps cut short at stop).

    The object is {"name": ..., <arguments key>: {...}}. None until its name is complete.
    Without an arguments member, a closed object's arguments are {}."""
    name_span = scan.span("name")
    if name_span is None or name_span.end is None:
        return None
    name = scan.value(text, name_span)
    if not isinstance(name, str):
        return None
    closed = scan.end is not None
    arguments = next((span for key in arguments_keys if (span := scan.span(key)) is not None), None)
    if arguments is None:
        return CallRead(name, 0, 0, closed, "{}" if closed else "")
    end = arguments.end if arguments.end is not None else stop
    return CallRead(name, arguments.start, end, arguments.end is not None)


def partial_suffix(text: str, tag: str, start: int = 0) -> int:
    """The length of the longest end of text[start:] that begins `tag` (and may become it)."""
    for size in range(min(len(tag) - 1, len(text) - start), 0, -1):
        if text.endswith(tag[:size], start):
            return size
    return 0


class ToolReader:
    """One output's calls and content, read as the output grows.

    `read(text, final)` takes the whole text so far: each time the last one's text and more. It returns the
    content new since the last reading. `calls` are the calls so far. The last call may still change while
    its JSON is open (`show_call`)."""

    def __init__(self) -> None:
        self.calls: list[CallRead] = []
        self.cut_short = True     # a final text that ends inside a call was cut (max_tokens): the call stays
        self.provisional = False  # the last of `calls` is the open JSON value's, read again at the next reading

    def read(self, text: str, final: bool) -> str:
        raise NotImplementedError

    def show_call(self, call: CallRead | None, settled: bool) -> None:
        """The call of the JSON value read last (None: none yet): `settled` once the value is closed."""
        if self.provisional:
            self.calls.pop()
        if call is not None:
            self.calls.append(call)
        self.provisional = call is not None and not settled


class HermesReader(ToolReader):
    """hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks.

    The text around them is content. So is a block whose JSON has no name, once it is closed. Trailing
    whitespace of the content waits, since it may lie before a call. It is dropped at the end of an output
    with calls."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = 0                     # the text before it is read (content shown or held, closed blocks)
        self.searched = 0                # no tag that the reading looks for begins before it
        self.block: int | None = None    # where the open block's <tool_call> begins
        self.scan = JsonScan(0)          # the open block's JSON
        self.held = ""                   # the content's trailing whitespace, not yet shown

    def read(self, text: str, final: bool) -> str:
        content = []
        while True:
            if self.block is None:
                start = text.find(HERMES_OPEN, max(self.pos, self.searched))
                if start < 0:  # content up to a "<tool_ca" that may become a tag
                    stop = len(text) if final else len(text) - partial_suffix(text, HERMES_OPEN, self.pos)
                    content.append(text[self.pos:stop])
                    self.pos = self.searched = stop
                    break
                content.append(text[self.pos:start])
                self.block, self.pos = start, start + len(HERMES_OPEN)
                self.searched, self.scan = self.pos, JsonScan(self.pos)
            end = text.find(HERMES_CLOSE, self.searched)
            if end < 0:
                stop = len(text) if final else len(text) - partial_suffix(text, HERMES_CLOSE, self.pos)
                self.searched = max(self.pos, len(text) - len(HERMES_CLOSE) + 1)
            self.scan.read(text, end if end >= 0 else stop)
            # A call shows once its JSON object closes: only then is it sure to be one. (A second "name" may
            # come last; a block may end with its braces still open.) An output cut short inside it keeps it.
            whole = self.scan.end is not None or final and end < 0 and self.cut_short
            call = read_call(text, self.scan, end if end >= 0 else stop, ("arguments", "parameters"))
            if not whole or len(self.scan.last) < len(self.scan.values):  # a member twice: which is meant?
                call = None
            self.show_call(call, end >= 0)
            if end < 0:
                if call is None and final:  # no call after all: its text is content
                    content.append(text[self.block:])
                break
            if call is None:
                content.append(text[self.block:end + len(HERMES_CLOSE)])
            self.block, self.pos = None, end + len(HERMES_CLOSE)
            self.searched = self.pos
        return self.hold_back("".join(content), final)

    def hold_back(self, content: str, final: bool) -> str:
        """The new content to show: its trailing whitespace held back, until the end of an output without calls."""
        content = self.held + content
        if final and not self.calls:
            self.held = ""
            return content
        shown = content.rstrip()
        self.held = content[len(shown):]
        return shown


class Llama3JsonReader(ToolReader):
    """llama3_json: an output that begins with '{' is calls; any other output is content.

    The '{' may follow whitespace, or Llama's <|python_tag|>. The calls are {"name": ..., "parameters": {...}}
    objects joined by ";"."""

    def __init__(self) -> None:
        super().__init__()
        self.kind: str | None = None   # "calls" or "content", once the output's first characters say which
        self.num_shown = 0             # content: characters shown
        self.scan = JsonScan(0)        # calls: the last call's JSON

    def read(self, text: str, final: bool) -> str:
        if self.kind is None:
            stripped = text.lstrip()
            if stripped.startswith(PYTHON_TAG):
                stripped = stripped[len(PYTHON_TAG):].lstrip()
            if stripped.startswith("{"):
                self.kind, self.scan = "calls", JsonScan(len(text) - len(stripped))
            elif not final and PYTHON_TAG.startswith(stripped):
                return ""  # undecided
            else:
                self.kind = "content"
        if self.kind == "content":
            content, self.num_shown = text[self.num_shown:], len(text)
            return content
        while True:
            self.scan.read(text, len(text))
            separator = SEPARATOR.match(text, self.scan.end) if self.scan.end is not None else None
            self.show_call(read_call(text, self.scan, len(text), ("parameters", "arguments")), separator is not None)
            if separator is None:
                return ""
            self.scan = JsonScan(separator.end() - 1)


class RequiredReader(ToolReader):
    """tool_choice "required": the grammar's JSON array of {"name": ..., "parameters": {...}}."""

    def __init__(self) -> None:
        super().__init__()
        self.array = JsonScan(0)
        self.num_settled = 0               # items read to their end
        self.item = JsonScan(0)            # the item being read, which begins at item_start
        self.item_start: int | None = None

    def read(self, text: str, final: bool) -> str:
        self.array.read(text, len(text))
        values, open_value = self.array.values, self.array.open_value
        while self.num_settled < len(values) + (open_value is not None):
            span = values[self.num_settled][1] if self.num_settled < len(values) else open_value
            if self.item_start != span.start:
                self.item, self.item_start = JsonScan(span.start), span.start
            stop = span.end if span.end is not None else len(text)
            self.item.read(text, stop)
            self.show_call(read_call(text, self.item, stop, ("parameters",)), span.end is not None)
            if span.end is None:
                break
            self.num_settled += 1
        return ""


class NamedReader(ToolReader):
    """A forced named function: the whole output is its arguments (the grammar writes nothing else)."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name, self.scan = name, JsonScan(0)

    def read(self, text: str, final: bool) -> str:
        self.scan.read(text, len(text))
        self.calls = [CallRead(self.name, 0, len(text), self.scan.end is not None)]
        return ""


Parser = Callable[[], ToolReader]  # makes one output's reader


def named_parser(name: str) -> Parser:
    return functools.partial(NamedReader, name)


PARSERS: dict[str, Parser] = {"hermes": HermesReader, "llama3_json": Llama3JsonReader}  # --tool-call-parser


def parse(parser: Parser, text: str, final: bool = True, cut_short: bool = True) -> Parsed:
    """A whole output's content and calls (a stream's, cut short, with final False). `cut_short` False: the
    model ended the output itself, so a call it left open is no call (hermes)."""
    reader = parser()
    reader.cut_short = cut_short
    content = reader.read(text, final)
    return Parsed(content, [call.tool_call(text) for call in reader.calls])


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolCallStream:
    """One choice's output as a stream sends it.

    The output is read on at each delta, and what is new since the last delta is sent. That is content,
    a call's index, id and name once, then pieces of its arguments. At most `max_calls` calls are sent
    (parallel_tool_calls false: 1). Each delta costs time in its own length, not the output's."""

    def __init__(self, parser: Parser, max_calls: int | None) -> None:
        self.reader, self.max_calls = parser(), max_calls
        self.text = ""
        self.num_arguments_sent: list[int] = []  # per call: characters of its arguments sent
        self.num_done = 0                        # the calls before it are settled and sent whole

    def feed(self, delta: str, final: bool, cut_short: bool = True) -> tuple[str, list[dict]]:
        """The new content and the tool_calls deltas, after `delta` (the output's next piece); `cut_short` as
        `parse` takes it."""
        self.reader.cut_short = cut_short
        text, self.text = self.text, ""  # the one reference: `+=` grows the string in place, no copy per delta
        text += delta
        self.text = text
        content = self.reader.read(text, final)
        calls = self.reader.calls
        num_calls = len(calls) if self.max_calls is None else min(len(calls), self.max_calls)
        deltas = []
        for index in range(self.num_done, num_calls):
            call = calls[index]
            if index == len(self.num_arguments_sent):
                arguments = call.arguments(text)
                function = dict(name=call.name, arguments=arguments)
                deltas.append(dict(index=index, id=new_call_id(), type="function", function=function))
                self.num_arguments_sent.append(len(arguments))
            elif piece := call.arguments(text, self.num_arguments_sent[index]):
                deltas.append(dict(index=index, function=dict(arguments=piece)))
                self.num_arguments_sent[index] += len(piece)
        self.num_done = max(self.num_done, min(len(calls) - 1, num_calls))  # a reader changes only its last call
        return content, deltas

    def tool_calls(self) -> list[ToolCall]:
        """The calls so far, whole (at the end of the output: its finish_reason depends on them)."""
        return [call.tool_call(self.text) for call in self.reader.calls[:self.max_calls]]
