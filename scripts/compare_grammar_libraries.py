"""xgrammar against llguidance on one model's tokenizer (docs/structured-outputs.md, "Why xgrammar"): the time
to read the vocabulary, to compile a typical JSON schema, and to fill one request's token mask at each step of
a valid answer (mean and worst step). One thread each. Then, for xgrammar, the longest pause of the main
thread while another thread reads the vocabulary or compiles (does it hold the GIL?).

    pip install xgrammar llguidance
    python scripts/compare_grammar_libraries.py build/smollm2
"""
import json
import sys
import threading
import time

import llguidance
import llguidance.hf
import llguidance.torch
import xgrammar as xgr
from transformers import AutoTokenizer

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
    "address": {"type": "object", "required": ["city", "zip"], "properties": {
        "city": {"type": "string"}, "zip": {"type": "string", "pattern": "[0-9]{5}"}}}},
    "required": ["name", "age", "tags", "address"]}
ANSWER = {"name": "Ann", "age": 31, "tags": ["a", "c"], "address": {"city": "Bath", "zip": "12345"}}


def seconds(start: float) -> str:
    return f"{1000 * (time.perf_counter() - start):.0f} ms"


def mask_times(fill, accept, token_ids: list[int]) -> str:
    """Fill the mask, then accept the answer's next token, along the whole answer."""
    times = []
    for token in token_ids:
        start = time.perf_counter()
        fill()
        times.append(time.perf_counter() - start)
        assert accept(token), token
    return f"mask per step: mean {1e6 * sum(times) / len(times):.0f} us, worst {1e6 * max(times):.0f} us"


def longest_pause(work) -> str:
    """Run `work` in a thread; meanwhile the main thread ticks every millisecond: its longest gap."""
    thread, gaps, last = threading.Thread(target=work), [], time.perf_counter()
    thread.start()
    while thread.is_alive():
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
        time.sleep(0.001)
    return f"{1000 * max(gaps):.1f} ms"


def main() -> None:
    tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
    vocab_size = len(tokenizer)
    token_ids = tokenizer.encode(json.dumps(ANSWER), add_special_tokens=False)
    print(f"vocabulary {vocab_size} tokens; the answer has {len(token_ids)} tokens")

    start = time.perf_counter()
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size), max_threads=1)
    vocabulary = seconds(start)
    start = time.perf_counter()
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA)))
    compiled = seconds(start)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    times = mask_times(lambda: matcher.fill_next_token_bitmask(bitmask, 0), matcher.accept_token, token_ids)
    print(f"xgrammar: vocabulary {vocabulary}, compile {compiled}, {times}")

    start = time.perf_counter()
    ll_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    vocabulary = seconds(start)
    start = time.perf_counter()
    ll_matcher = llguidance.LLMatcher(ll_tokenizer, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA))
    compiled = seconds(start)
    ll_bitmask = llguidance.torch.allocate_token_bitmask(1, ll_tokenizer.vocab_size)
    times = mask_times(lambda: llguidance.torch.fill_next_token_bitmask(ll_matcher, ll_bitmask, 0),
                       ll_matcher.consume_token, token_ids)
    other = xgr.Grammar.from_json_schema(SCHEMA | {"required": ["name"]})
    print(f"xgrammar in a thread: the main thread's longest pause while it reads the vocabulary "
          f"{longest_pause(lambda: xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size))}, "
          f"while it compiles {longest_pause(lambda: compiler.compile_grammar(other))}")
    print(f"llguidance: vocabulary {vocabulary}, compile {compiled} (it compiles lazily, as it goes), {times}")


if __name__ == "__main__":
    main()
