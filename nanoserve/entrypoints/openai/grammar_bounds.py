"""The bounds on a request's structured output that the server checks before xgrammar sees it
(docs/serving.md, "Limits"): xgrammar's converters recurse without bound (30,000 nested parentheses in a
schema's pattern crashed the process) and parse a deep schema in time cubic in its depth. One spec at most
`max_bytes` of text and `max_depth` levels of nesting; past either, an InvalidRequest naming structured_outputs.
"""
from __future__ import annotations

import json
from typing import Any, Callable

from nanoserve.extensions.structured_outputs import is_json
from nanoserve.sampler import InvalidRequest


def check_bounds(spec: dict[str, Any], max_bytes: int, max_depth: int) -> None:
    """Before xgrammar sees a spec (StructuredOutputsParams' fields as given): at most `max_bytes` of text
    (the schema as JSON, the regex, the grammar, the choices together) and `max_depth` levels of nesting (of
    the schema's objects and arrays, and of brackets in the regex, the grammar and every string of the schema:
    its patterns). xgrammar's converters recurse without bound: 30,000 nested parentheses in a pattern crashed
    the process, and parsing a schema nested 450 deep took seconds. Past either, an InvalidRequest."""
    def refuse(what: str) -> None:
        raise InvalidRequest("structured_outputs", f"structured_outputs {what}, more than this server takes")
    texts = [spec[name] for name in ("regex", "grammar", "json") if isinstance(spec.get(name), str)]
    texts += [choice for choice in spec.get("choice") or () if isinstance(choice, str)]
    if sum(len(text.encode("utf-8", "surrogatepass")) for text in texts) > max_bytes:
        refuse(f"has over {max_bytes} bytes")
    for name in ("regex", "grammar"):
        if isinstance(spec.get(name), str) and bracket_depth(spec[name]) > max_depth:
            refuse(f"nests {name} brackets over {max_depth} deep")
    schema = spec.get("json")
    if isinstance(schema, str) and is_json(schema):
        schema = json.loads(schema)
    if isinstance(schema, (dict, list)):
        strings = check_json_depth(schema, max_depth, refuse)
        if sum(len(text.encode("utf-8", "surrogatepass")) for text in strings) > max_bytes:
            refuse(f"has over {max_bytes} bytes")
        if any(bracket_depth(text) > max_depth for text in strings):
            refuse(f"nests brackets in a schema's string (a pattern) over {max_depth} deep")


def check_json_depth(value: dict | list, max_depth: int, refuse: Callable[[str], None]) -> list[str]:
    """Walk a JSON value without recursion (it may be nested a thousand deep); refuse past max_depth levels.
    Returns its strings, keys included."""
    strings: list[str] = []
    stack = [(value, 1)]
    while stack:
        value, depth = stack.pop()
        if depth > max_depth:
            refuse(f"nests its schema over {max_depth} deep")
        items = list(value.items()) if isinstance(value, dict) else [(None, item) for item in value]
        for key, item in items:
            strings += [key] if isinstance(key, str) else []
            if isinstance(item, (dict, list)):
                stack.append((item, depth + 1))
            elif isinstance(item, str):
                strings.append(item)
    return strings


def bracket_depth(text: str) -> int:
    """The deepest nesting of (, [ and { in text, an escaped one (after a backslash) not counted."""
    depth = deepest = 0
    escaped = False
    for char in text:
        if escaped:
            escaped = False
        elif char == "\\":
            escaped = True
        elif char in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in ")]}":
            depth = max(0, depth - 1)
    return deepest
