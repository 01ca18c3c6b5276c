"""The tool-call parsers (nanoserve/entrypoints/openai/tool_parsers.py) without a server: a stream of the
output cut into deltas any way (whole, one token at a time, several tokens at a time as speculative
decoding gives them, one character at a time) must send the calls and content that the whole text parses
to, and for well-formed outputs the calls an independent reading (a regex and json.loads) finds."""
import json
import random
import re

import pytest
from transformers import AutoTokenizer

import nanoserve
from nanoserve.entrypoints.openai import json_scan
from nanoserve.entrypoints.openai.tool_parsers import (
    HermesReader,
    Llama3JsonReader,
    RequiredReader,
    ToolCallStream,
    named_parser,
    parse,
)

WELL_FORMED = [
    'Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Bath", "days": 3}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"zone": "Europe/London", "nested": {"a": [1, 2.5, '
    '{"b": "x}y]"}], "ok": true, "none": null}}}\n</tool_call>',
    '<tool_call>{"name": "say", "arguments": {"text": "a \\"quoted\\" {brace} and \\u00e9 \\\\ end"}}</tool_call> done',
    '<tool_call>{"arguments": {"x": [1, {"y": 2}]}, "name": "late_name"}</tool_call>',
    "No tools here: 3 < 4 and <tool> is no tag, nor is <tool_call without its end.",
    'Two <tool_call>{"name": "a", "arguments": {}}</tool_call> and <tool_call>{"name": "b"}</tool_call> then text  ',
]
CUT_SHORT = [
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Ba',  # max_tokens inside the arguments
    'Hello <tool_call>{"na',                                          # inside the name: no call yet
    '<tool_call>not json</tool_call> after',                          # no name: the block is content
    'Done. <tool_ca',                                                 # half a tag at the end
    '<tool_call>{"name": "f", "arguments": {"a": [1</tool_call> after',  # braces never closed: the tag ends it
]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(nanoserve.DEFAULT_MODEL)


def token_pieces(tokenizer, text: str) -> list[str]:
    """The text as a stream sends it, one token's new text at a time (empty pieces dropped)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    decoded = [tokenizer.decode(ids[:i]) for i in range(len(ids) + 1)]
    assert decoded[-1] == text, "the bundled tokenizer writes the text back as it was"
    return [piece for a, b in zip(decoded, decoded[1:]) if (piece := b[len(a):])]


def chunkings(pieces: list[str]) -> dict[str, list[str]]:
    """The same output cut the ways a stream may cut it: whole, per token, k tokens per delta (speculative
    decoding's accepted drafts), random sizes, per character."""
    text = "".join(pieces)
    rng = random.Random(0)
    cuts = {"whole": [text], "per token": pieces, "per character": list(text)}
    for k in (2, 3, 5):
        cuts[f"{k} tokens"] = ["".join(pieces[i:i + k]) for i in range(0, len(pieces), k)]
    random_cut, i = [], 0
    while i < len(pieces):
        size = rng.randint(1, 6)
        random_cut.append("".join(pieces[i:i + size]))
        i += size
    cuts["random"] = random_cut
    return cuts


def stream(parser, deltas: list[str], max_calls=None, cut_short=True) -> tuple[str, list[tuple[str, str]]]:
    """What a client puts together from the stream: the content, and each call's (name, arguments). Each
    call must come with its id and name once, first, then only argument pieces."""
    reader = ToolCallStream(parser, max_calls)
    content, calls = "", {}
    for i, delta in enumerate(deltas):
        new_content, tool_calls = reader.feed(delta, final=i == len(deltas) - 1, cut_short=cut_short)
        content += new_content
        for call in tool_calls:
            if call["index"] not in calls:
                assert call["id"].startswith("call_") and call["type"] == "function" and call["function"]["name"]
                assert call["index"] == len(calls), "calls come in index order"
                calls[call["index"]] = [call["function"]["name"], call["function"]["arguments"]]
            else:
                assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
                calls[call["index"]][1] += call["function"]["arguments"]
    return content, [tuple(calls[i]) for i in range(len(calls))]


def whole(parser, text: str) -> tuple[str, list[tuple[str, str]]]:
    parsed = parse(parser, text)
    return parsed.content, [(call.name, call.arguments) for call in parsed.calls]


def independent_hermes(text: str) -> tuple[str, list[tuple[str, dict]]]:
    """A well-formed hermes output read another way: the blocks by a regex, their JSON by json.loads, the
    content what is left, its trailing whitespace dropped where there were calls."""
    blocks = re.findall(r"<tool_call>(.*?)</tool_call>", text, re.DOTALL)
    calls = [(json.loads(b)["name"], json.loads(b).get("arguments", {})) for b in blocks]
    content = re.sub(r"<tool_call>.*?</tool_call>", "", text, flags=re.DOTALL)
    return (content.rstrip() if calls else content), calls


@pytest.mark.parametrize("text", WELL_FORMED + CUT_SHORT)
def test_hermes_streams_add_up_to_the_whole_parse(tokenizer, text):
    """Catches a parser that depends on where deltas end: a tag split over two deltas missed or leaked into
    the content, a name sent before it is complete, argument pieces lost when one delta carries several
    tokens (sglang's multi-token bug), the whole arguments sent again instead of the new piece."""
    expected = whole(HermesReader, text)
    for name, deltas in chunkings(token_pieces(tokenizer, text)).items():
        assert stream(HermesReader, deltas) == expected, name


@pytest.mark.parametrize("text", WELL_FORMED)
def test_hermes_reads_what_an_independent_reading_reads(text):
    """Catches a wrong reading shared by the whole and the streamed parse (both use HermesReader): nested
    braces or a brace in a string ending the arguments early, an escaped quote ending a string, arguments
    given before the name, text around the calls dropped or kept twice."""
    content, calls = whole(HermesReader, text)
    expected_content, expected_calls = independent_hermes(text)
    assert content == expected_content
    assert [(name, json.loads(arguments)) for name, arguments in calls] == expected_calls


def test_hermes_cut_short():
    """max_tokens inside the arguments keeps their prefix (OpenAI's "length" answer); a block without a
    name is content; half a tag at the end of the output is content."""
    assert whole(HermesReader, CUT_SHORT[0]) == ("", [("get_weather", '{"city": "Ba')])
    assert whole(HermesReader, CUT_SHORT[1]) == ('Hello <tool_call>{"na', [])
    assert whole(HermesReader, CUT_SHORT[2]) == ("<tool_call>not json</tool_call> after", [])
    assert whole(HermesReader, CUT_SHORT[3]) == ("Done. <tool_ca", [])
    assert parse(HermesReader, CUT_SHORT[0]).calls[0].complete is False
    assert parse(HermesReader, WELL_FORMED[0]).calls[1].complete is True


@pytest.mark.parametrize("text, cut_short", [
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Bath"}, "name": "delete_file"}</tool_call>', True),
    ('<tool_call>{"name": "get_weather", "name": "delete_file", "arguments": {}}</tool_call>', True),
    ('<tool_call>{"name": "f", "arguments": {"a": 1}, "arguments": {"a": 2}}</tool_call>', True),
    (CUT_SHORT[4], True),    # the block ends with its braces open
    (CUT_SHORT[0], False),   # the model ended the output itself (finish_reason "stop") inside the call
])
def test_a_hermes_call_that_is_not_sure_is_text_streamed_or_whole(tokenizer, text, cut_short):
    """Catches: a call object with two "name" members streamed as the first and answered whole as the last
    (get_weather, then delete_file); a call whose JSON never closes answered as a call with broken arguments
    and finish_reason "stop". Each is the model's text, streamed or whole."""
    parsed = parse(HermesReader, text, cut_short=cut_short)
    assert (parsed.content, parsed.calls) == (text, [])
    for name, deltas in chunkings(token_pieces(tokenizer, text)).items():
        assert stream(HermesReader, deltas, cut_short=cut_short) == (text, []), name


def test_forced_and_llama3_outputs_stream_as_they_parse(tokenizer):
    """The JSON a forced call's grammar writes (a named function's arguments; "required"'s array) and
    llama3_json: streamed any way, the same calls as parsed whole, and as json.loads reads them. Catches
    the array's items split wrongly ("parameters" of one call read into the next), a stream of a named
    call that loses or repeats argument pieces."""
    required = '[{"name": "get_weather", "parameters": {"city": "Bath"}}, {"name": "get_time", "parameters": {}}]'
    named = '{"city": "Bath", "days": [1, 2]}'
    llama3 = '{"name": "get_weather", "parameters": {"city": "Bath"}}; {"name": "get_time", "parameters": {"z": 1}}'
    cases = [(RequiredReader, required, [(c["name"], c["parameters"]) for c in json.loads(required)]),
             (named_parser("get_weather"), named, [("get_weather", json.loads(named))]),
             (Llama3JsonReader, llama3, [(json.loads(p)["name"], json.loads(p)["parameters"])
                                          for p in llama3.split("; ")])]
    for parser, text, expected in cases:
        content, calls = whole(parser, text)
        assert content == "" and [(name, json.loads(arguments)) for name, arguments in calls] == expected
        for name, deltas in chunkings(token_pieces(tokenizer, text)).items():
            assert stream(parser, deltas) == (content, calls), (text, name)
    assert whole(Llama3JsonReader, "Plain text, no call.") == ("Plain text, no call.", [])


def test_parallel_tool_calls_false_keeps_the_first_call(tokenizer):
    """max_calls=1 (parallel_tool_calls false): the second call is never sent."""
    content, calls = stream(HermesReader, token_pieces(tokenizer, WELL_FORMED[0]), max_calls=1)
    assert [name for name, _ in calls] == ["get_weather"]


class Counting:
    """A token pattern of json_scan.py (the parsers' JSON reader) that counts the characters its matches consume."""

    def __init__(self, pattern: re.Pattern) -> None:
        self.pattern, self.num_chars = pattern, 0

    def match(self, text: str, pos: int, endpos: int) -> re.Match:
        match = self.pattern.match(text, pos, endpos)
        self.num_chars += match.end() - pos
        return match


@pytest.mark.parametrize("parser, text", [
    (HermesReader, 'Sure. <tool_call>{"name": "f", "arguments": {"items": [%s], "note": "%s"}}</tool_call>'
     % (", ".join(f'{{"k": "v{i}"}}' for i in range(300)), "x\\\"y" * 1000)),
    (RequiredReader, '[%s]' % ", ".join(f'{{"name": "f", "parameters": {{"k": [{i}, "{"z" * 40}"]}}}}'
                                        for i in range(100))),
    (Llama3JsonReader, "; ".join(f'{{"name": "f", "parameters": {{"s": "{"w" * 300}"}}}}' for i in range(20))),
    (named_parser("f"), '{"s": "%s", "n": [%s]}' % ("q" * 5000, ", ".join(map(str, range(1000))))),
])
def test_a_stream_reads_each_character_once(monkeypatch, parser, text):
    """Streamed one character at a time, the readers' token patterns consume each character of the output a
    bounded number of times (twice: "required"'s array and its item), and the stream still adds up to the whole
    parse. Catches the quadratic stream: the whole text parsed again at each delta (a 4,900-delta call cost
    16.5 s of event loop), and a string that the text stopped inside read again from its opening quote at each
    delta (quadratic in a long string argument)."""
    counters = {name: Counting(getattr(json_scan, name)) for name in ("STRING_REST", "LITERAL_REST", "WHITESPACE")}
    for name, counter in counters.items():
        monkeypatch.setattr(json_scan, name, counter)
    assert stream(parser, list(text)) == whole(parser, text)
    assert sum(counter.num_chars for counter in counters.values()) <= 4 * len(text)  # stream and whole: 2 readings
