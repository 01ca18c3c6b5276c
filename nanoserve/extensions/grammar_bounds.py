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
    # the spec's texts: the regex, the grammar, the schema as JSON text, the choices
    check_bytes(patterns + [text for text in (schema, *(spec.get("choice") or ())) if isinstance(text, str)], max_bytes)
    strings, schema_patterns = walk_schema(read_json(schema) if isinstance(schema, str) else schema, max_depth)
    check_bytes(strings, max_bytes)
    # the texts whose brackets nest: the regex, the grammar, the schema's strings
    if max(map(bracket_depth, patterns + strings)) > max_depth:
        refuse(f"nests brackets over {max_depth} deep, more than this server takes")
    totals, stacks = zip(*map(count_quantifiers, patterns + schema_patterns))  # per text: (total, longest stack)
    if max(stacks) > max_depth:
        refuse(f"stacks over {max_depth} quantifiers on one atom (as a{{1}}{{1}}...), more than this server takes")
    if sum(totals) > MAX_QUANTIFIERS:
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
# The bounds whose low one over the high one leaves no value to fit
BOUNDS = {"minimum": "maximum", "minLength": "maxLength", "minItems": "maxItems", "minProperties": "maxProperties"}


def walk_schema(schema: Any, max_depth: int) -> tuple[list[str], list[str]]:
    """Walk a JSON schema without recursion, since it may be nested a thousand deep.

    It refuses past max_depth levels. It also refuses each schema in it that no output can satisfy
    (`check_keywords`). Returns its strings, keys included, and its patterns (a `pattern`'s value,
    `patternProperties`' keys)."""
    strings, patterns = [], []
    # (value, depth, what it is: a schema, a map or list of schemas, or data). It starts as a list of one schema
    # at depth 0, so that a schema with nothing in it to walk (a bool, None) is never pushed.
    stack = [([schema], 0, "schemas")]
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
    members may overlap (xgrammar takes any one), and a `$ref` outside the schema.

    Refuse too a schema no value fits. That is an empty type or enum, or a minimum over its maximum. So is an
    allOf of types that exclude one another, or a required property that additionalProperties false forbids."""
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
    # what no value fits
    for keyword in ("type", "enum"):
        if schema.get(keyword) == []:
            refuse(f"gives an empty {keyword}: no value fits it")
    for low, high in BOUNDS.items():
        if all(isinstance(schema.get(k), (int, float)) for k in (low, high)) and schema[low] > schema[high]:
            refuse(f"has {low} over {high}: no value fits it")
    if not types_meet(typed(schema, "allOf", list)):
        refuse("has an allOf whose types exclude one another: no value fits it")
    properties, required = typed(schema, "properties", dict), typed(schema, "required", list)
    if schema.get("additionalProperties") is False and any(name not in properties for name in required):
        refuse("has required properties that additionalProperties false forbids: no value fits it")


def disjoint(a: Any, b: Any) -> bool:
    """Two oneOf members no value fits both of: their types exclude one another, or a property both require
    takes different const or enum values in each (a tagged union)."""
    if not types_meet([a, b]):
        return True
    return any(values_of(a, name) and values_of(b, name) and values_of(a, name).isdisjoint(values_of(b, name))
               for name in typed(a, "properties", dict))


def values_of(schema: Any, name: Any) -> set[str]:
    """The values a required property may take, where its schema lists them (const or enum; as JSON text);
    else empty."""
    prop = typed(schema, "properties", dict).get(name)
    if not isinstance(prop, dict) or name not in typed(schema, "required", list):
        return set()
    values = [prop["const"]] if "const" in prop else typed(prop, "enum", list)
    return {json.dumps(value, sort_keys=True) for value in values}


def typed(fields: Any, key: str, kind: type) -> Any:
    """fields[key] where fields is a dict and the value a `kind` (str, list or dict). Else an empty `kind`, as
    if it were missing."""
    value = fields.get(key) if isinstance(fields, dict) else None
    return value if isinstance(value, kind) else kind()


def types_meet(schemas: list) -> bool:
    """Whether one type fits every schema in `schemas` that gives its `type`. A number may be an integer."""
    types = []
    for schema in schemas:
        given = schema.get("type") if isinstance(schema, dict) else None
        if isinstance(given, (str, list)):
            names = {given} if isinstance(given, str) else {name for name in given if isinstance(name, str)}
            types.append(names | {"integer"} if "number" in names else names)
    return not types or bool(set.intersection(*types))


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
    stacks = [0]  # the quantifiers stacked on each atom in turn (the first count: those before any atom)
    for token in REGEX_TOKEN.finditer(text):
        if token["quantifier"]:
            stacks[-1] += 1
        else:
            stacks.append(0)
    return sum(stacks), max(stacks)
