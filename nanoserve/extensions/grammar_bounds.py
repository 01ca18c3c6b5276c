"""The cheap bounds on a grammar spec, checked before xgrammar sees it (docs/serving.md, "Limits").

They are checked wherever a spec enters:
- `GrammarCompiler.submit`, so LLM, AsyncLLM and the server all have them;
- the server's handlers, with the server's own limits.

Why: xgrammar's converters recurse without bound. 30,000 nested parentheses in a schema's pattern crashed
the process. So did 13,000 quantifiers stacked on one character (`a{1}{1}{1}...`, depth 1 to a bracket
count). And a deep schema parses in time cubic in its depth. The bounds make the common hostile shapes a
quick refusal. The child process that parses and compiles (grammar_workers.py) keeps the shapes they miss
from taking anything down. Past a bound, the spec is refused with an InvalidRequest naming structured_outputs.
"""
from __future__ import annotations

import json
import re
from itertools import combinations
from typing import Any

from nanoserve.sampling_params import InvalidRequest

MAX_BYTES = 64 * 1024  # of one spec's text: its schema as JSON, regex, grammar or choices together
MAX_DEPTH = 64         # levels of nesting: of a schema, of brackets, of quantifiers stacked on one another
MAX_QUANTIFIERS = 1024  # quantifiers in one spec's regex, grammar and patterns together (each a repetition to build)
# A regex read as atoms and quantifiers: an escaped character, a character class (up to its "]", escapes
# included) and any other character are atoms; *, +, ?, {n}, {n,}, {,m}, {n,m} are quantifiers.
REGEX_TOKEN = re.compile(r"\\.|\[(?:\\.|[^\]\\])*\]?|(?P<quantifier>[*+?]|\{\d*,?\d*\})|.", re.DOTALL)


def refuse(what: str) -> None:
    raise InvalidRequest("structured_outputs", f"structured_outputs {what}")


def check_bounds(spec: dict[str, Any], max_bytes: int = MAX_BYTES, max_depth: int = MAX_DEPTH) -> None:
    """Check a spec before xgrammar sees it (StructuredOutputsParams' fields as given). Past any bound,
    raise an InvalidRequest. The bounds:
    - At most `max_bytes` of text: the schema as JSON, the regex, the grammar, the choices together.
    - At most `max_depth` levels of nesting. That counts the schema's objects and arrays, and brackets in
      the regex, the grammar and every string of the schema.
    - At most `max_depth` quantifiers stacked on one atom, and MAX_QUANTIFIERS in all. That counts the regex,
      the grammar and the schema's patterns."""
    patterns = [typed(spec, name, str) for name in ("regex", "grammar")]
    schema = spec.get("json")
    texts = patterns + [text for text in (schema, *(spec.get("choice") or ())) if isinstance(text, str)]
    check_bytes(texts, max_bytes)
    schema = read_json(schema) if isinstance(schema, str) else schema
    strings, schema_patterns = walk_schema(schema, max_depth) if isinstance(schema, (dict, list)) else ([], [])
    check_bytes(strings, max_bytes)
    # the texts whose brackets nest: the regex, the grammar, the schema's strings
    if any(bracket_depth(text) > max_depth for text in patterns + strings):
        refuse(f"nests brackets over {max_depth} deep, more than this server takes")
    counts = [count_quantifiers(text) for text in patterns + schema_patterns]
    if any(stacked > max_depth for _, stacked in counts):
        refuse(f"stacks over {max_depth} quantifiers on one atom (as a{{1}}{{1}}...), more than this server takes")
    if sum(total for total, _ in counts) > MAX_QUANTIFIERS:
        refuse(f"has over {MAX_QUANTIFIERS} quantifiers in its regex, grammar or patterns, more than this server takes")


def check_bytes(texts: list[str], max_bytes: int) -> None:
    if sum(len(text.encode("utf-8", "surrogatepass")) for text in texts) > max_bytes:
        refuse(f"has over {max_bytes} bytes, more than this server takes")


def read_json(text: str) -> Any:
    """A schema given as text, or None where it is no JSON (nested past Python's recursion limit included)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


# Where a schema's members are not schemas: data (enum values, a const...), and maps and lists of schemas.
DATA_KEYWORDS = {"enum", "const", "default", "examples"}
SCHEMA_MAPS = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"}
SCHEMA_LISTS = {"allOf", "anyOf", "oneOf", "prefixItems", "items"}


def walk_schema(schema: dict | list, max_depth: int) -> tuple[list[str], list[str]]:
    """Walk a JSON schema without recursion, since it may be nested a thousand deep.

    It refuses past max_depth levels. It also refuses each schema in it that no output can satisfy
    (`check_keywords`). Returns its strings, keys included, and its patterns (a `pattern`'s value,
    `patternProperties`' keys)."""
    strings: list[str] = []
    patterns: list[str] = []
    stack = [(schema, 1, "schema")]  # (value, depth, what it is: a schema, a map or list of schemas, or data)
    while stack:
        value, depth, role = stack.pop()
        if depth > max_depth:
            refuse(f"nests its schema over {max_depth} deep, more than this server takes")
        if role == "schema" and isinstance(value, dict):
            check_keywords(value)
            patterns += [typed(value, "pattern", str)]
            patterns += [key for key in typed(value, "patternProperties", dict) if isinstance(key, str)]
        for key, item in value.items() if isinstance(value, dict) else enumerate(value):
            strings += [text for text in (key, item) if isinstance(text, str)]
            if isinstance(item, (dict, list)):
                stack.append((item, depth + 1, child_role(role, key, item)))
    return strings, patterns


def child_role(role: str, key: Any, item: dict | list) -> str:
    """What a member of a schema, of a map or list of schemas, or of data is: a schema, schemas, or data."""
    if role != "schema":
        return "data" if role == "data" else "schema"
    if key in DATA_KEYWORDS:
        return "data"
    if key in SCHEMA_MAPS or key in SCHEMA_LISTS and isinstance(item, list):
        return "schemas"
    return "data" if isinstance(item, list) else "schema"


def check_keywords(schema: dict) -> None:
    """Refuse (InvalidRequest) the keywords xgrammar ignores where ignoring them lets an output break the
    schema. They are `not`, `uniqueItems`, `contains`, `if`, a lookahead in `pattern`, a `oneOf` whose
    members may overlap (xgrammar takes any one), a `$ref` outside the schema, and bounds no value fits."""
    for keyword in ("not", "contains", "minContains", "maxContains", "if"):
        if keyword in schema:
            refuse(f"uses the keyword {keyword}, which this server cannot enforce")
    if schema.get("uniqueItems") is True:
        refuse("uses the keyword uniqueItems, which this server cannot enforce")
    if re.search(r"\(\?<?[=!]", typed(schema, "pattern", str)):
        refuse("has a lookahead or lookbehind in a pattern, which this server cannot enforce")
    ref = typed(schema, "$ref", str)
    if ref and not ref.startswith("#"):
        refuse("has a $ref outside the schema (a remote one), which this server does not fetch")
    if not all(disjoint(a, b) for a, b in combinations(typed(schema, "oneOf", list), 2)):
        refuse("has a oneOf whose members may overlap, which this server enforces as anyOf")
    check_satisfiable(schema)


def check_satisfiable(schema: dict) -> None:
    """Refuse a schema no value fits: an empty type or enum, a minimum over its maximum, an allOf of types that
    exclude one another, a required property that additionalProperties false forbids."""
    for keyword in ("type", "enum"):
        if schema.get(keyword) == []:
            refuse(f"gives an empty {keyword}: no value fits it")
    for low, high in (("minimum", "maximum"), ("minLength", "maxLength"), ("minItems", "maxItems"),
                      ("minProperties", "maxProperties")):
        if all(isinstance(schema.get(k), (int, float)) for k in (low, high)) and schema[low] > schema[high]:
            refuse(f"has {low} over {high}: no value fits it")
    types = [type_set(m["type"]) for m in typed(schema, "allOf", list)
             if isinstance(m, dict) and isinstance(m.get("type"), (str, list))]
    if types and not set.intersection(*types):
        refuse("has an allOf whose types exclude one another: no value fits it")
    properties, required = typed(schema, "properties", dict), typed(schema, "required", list)
    if schema.get("additionalProperties") is False and any(name not in properties for name in required):
        refuse("has required properties that additionalProperties false forbids: no value fits it")


def disjoint(a: Any, b: Any) -> bool:
    """Two oneOf members no value fits both of: their types exclude one another, or a property both require
    takes different const or enum values in each (a tagged union)."""
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    if isinstance(a.get("type"), (str, list)) and isinstance(b.get("type"), (str, list)):
        if not type_set(a["type"]) & type_set(b["type"]):
            return True
    return any(values_of(a, name).isdisjoint(values_of(b, name)) for name in required_of(a) & required_of(b)
               if values_of(a, name) and values_of(b, name))


def required_of(schema: dict) -> set[str]:
    return {name for name in schema.get("required") or () if isinstance(name, str)}


def values_of(schema: dict, name: str) -> set[str]:
    """The values a property may take, where its schema lists them (const or enum; as JSON text); else empty."""
    prop = typed(schema, "properties", dict).get(name)
    if not isinstance(prop, dict):
        return set()
    values = [prop["const"]] if "const" in prop else typed(prop, "enum", list)
    return {json.dumps(value, sort_keys=True) for value in values}


def typed(fields: dict, key: str, kind: type) -> Any:
    """fields[key] where it is a `kind` (str, list or dict); else an empty one, as if it were missing."""
    value = fields.get(key)
    return value if isinstance(value, kind) else kind()


def type_set(types: str | list) -> set[str]:
    """A schema's `type` as a set; a number may be an integer."""
    names = {types} if isinstance(types, str) else {name for name in types if isinstance(name, str)}
    return names | {"integer"} if "number" in names else names


def bracket_depth(text: str) -> int:
    """The deepest nesting of (, [ and { in text. An escaped one (after a backslash) is not counted.
    An unmatched closing bracket never lowers it below 0, so `)))(((` is 3 deep."""
    depth = deepest = 0
    for char in re.sub(r"\\.", "", text, flags=re.DOTALL):  # escaped characters dropped
        if char in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in ")]}":
            depth = max(0, depth - 1)
    return deepest


def count_quantifiers(text: str) -> tuple[int, int]:
    """(the quantifiers in a regex, the longest run of them stacked on one atom). `a{1}{1}` stacks two: each
    nests the one before, as a bracket would. Escaped characters and character classes (`[*+?]`) are atoms."""
    total = stacked = longest = 0
    for token in REGEX_TOKEN.finditer(text):
        if token["quantifier"]:
            total, stacked = total + 1, stacked + 1
            longest = max(longest, stacked)
        else:
            stacked = 0
    return total, longest
