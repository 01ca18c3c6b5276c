"""A JSON value read as its text grows: the members of an object, or the items of an array.

The tool-call parsers (tool_parsers.py) read a model's output while it is still being written.
`JsonScan` keeps its place between readings, so a growing text is read once in all.
A `Span` says where one value lies in the text.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

# The rest of a JSON token after its first character: a string's, a literal's, or a run of whitespace.
# A string's closing quote is in the group `closed`, absent while the text stops inside the string.
# A literal is a number, true, false or null.
STRING_REST = re.compile(r'(?:[^"\\]|\\.)*(?P<closed>")?', re.DOTALL)
LITERAL_REST = re.compile(r'[^\s{}\[\]:,"]*')
WHITESPACE = re.compile(r"\s+")
PUNCTUATION = "{}[]:,"


@dataclass(frozen=True)
class Span:
    """Where one JSON value lies in a text: [start, end); end None while the text stops inside it."""
    start: int
    end: int | None



class JsonScan:
    """The members of a JSON object (key, span), or the items of an array (None, span), in a text that grows.

    The container begins at `start`. The scan reads as far as the text goes (up to `stop`). It also says
    where the container ends (`end`; None: not closed). Nested values are skipped by counting brackets
    outside strings. Invalid JSON stops the reading where it goes wrong, for good. Each `read` goes on from
    the last one's place. A token the text stopped inside is taken up where its reading got to. Such a
    token is a string not yet closed, or a literal such as "tru". So a growing text is read once in all."""

    def __init__(self, start: int) -> None:
        self.pos = start                         # the next token begins here
        self.resume: int | None = None           # the token at pos is read up to here (the text stopped inside it)
        self.state = "open"                      # open, key, colon, value, after; closed or failed: read no more
        self.depth, self.key, self.is_object = 0, None, False
        self.values: list[tuple[str | None, Span]] = []
        self.last: dict[str | None, int] = {}    # key -> index in values of its last value (as dict(values))
        self.open_value: Span | None = None      # a value at depth 1 whose only token the text stops inside
        self.end: int | None = None
        self.decoded: dict[Span, Any] = {}       # json.loads of a value's span, once

    def read(self, text: str, stop: int) -> None:
        self.open_value = None
        while self.pos < stop and self.state not in ("closed", "failed"):
            end = self.token_end(text, stop)
            if end is None:  # the text stops inside this token
                if self.depth == 1 and self.state == "value":  # a member's value begins with it
                    self.open_value = Span(self.pos, None)
                return
            self.take(text, self.pos, end)
            self.pos, self.resume = end, None

    def token_end(self, text: str, stop: int) -> int | None:
        """Where the token at pos ends, or None if the text (up to stop) ends inside it."""
        first = text[self.pos]
        if first in PUNCTUATION:
            return self.pos + 1
        if first.isspace():
            return WHITESPACE.match(text, self.pos, stop).end()
        is_string = first == '"'
        if self.resume is None:
            self.resume = self.pos + 1 if is_string else self.pos
        match = (STRING_REST if is_string else LITERAL_REST).match(text, self.resume, stop)
        if is_string and match.group("closed") is not None or not is_string and match.end() < stop:
            return match.end()
        self.resume = match.end()  # never after a lone backslash: `\\.` left it unmatched
        return None

    def take(self, text: str, start: int, end: int) -> None:
        """One whole token, text[start:end]."""
        token = text[start:end]
        if token.isspace():
            return
        if self.state == "open":  # the first token: the container itself
            self.is_object = token == "{"
            self.depth, self.state = 1, ("key" if self.is_object else "value") if token in ("{", "[") else "failed"
        elif self.depth > 1:  # inside a nested value: only brackets count
            self.depth += (token in ("{", "[")) - (token in ("}", "]"))
            if self.depth == 1:
                self.add_value(self.values[-1][1].start, end, replace=True)
                self.state = "after"
        elif token in ("}", "]"):  # the container closes ("{}" and "[]" too)
            self.end, self.state = end, "closed"
        elif self.state == "key" and token.startswith('"'):
            self.key, self.state = self.read_key(token)
        elif self.state == "colon" and token == ":":
            self.state = "value"
        elif self.state == "value" and token in ("{", "["):
            self.depth = 2
            self.add_value(start, None)
        elif self.state == "value" and token not in (":", ","):
            self.add_value(start, end)
            self.state = "after"
        elif self.state == "after" and token == ",":
            self.state = "key" if self.is_object else "value"
        else:  # invalid JSON: read no further
            self.state = "failed"

    @staticmethod
    def read_key(token: str) -> tuple[str | None, str]:
        """A member's key and the state after it; a string that is no JSON (a bad escape, "\\x") fails the reading."""
        try:
            return json.loads(token), "colon"
        except ValueError:
            return None, "failed"

    def add_value(self, start: int, end: int | None, replace: bool = False) -> None:
        if replace:
            self.values.pop()
        self.last[self.key] = len(self.values)
        self.values.append((self.key, Span(start, end)))

    def items(self) -> list[tuple[str | None, Span]]:
        """The values read so far, the one the text stops inside last."""
        return self.values + ([(self.key, self.open_value)] if self.open_value is not None else [])

    def span(self, key: str) -> Span | None:
        """The span of key's last value."""
        if self.open_value is not None and self.key == key:
            return self.open_value
        return self.values[self.last[key]][1] if key in self.last else None

    def value(self, text: str, span: Span) -> Any:
        """A whole value's JSON, decoded once (None where it is no JSON)."""
        if span not in self.decoded:
            try:
                self.decoded[span] = json.loads(text[span.start:span.end])
            except (ValueError, RecursionError):
                self.decoded[span] = None
        return self.decoded[span]
