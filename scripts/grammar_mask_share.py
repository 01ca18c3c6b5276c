"""How much of a decode step the structured-output token masks take (docs/performance.md, "Structured outputs").

    python scripts/grammar_mask_share.py build/smollm2 [--requests 48 --constrained 32]

`--requests` requests decode together, `--constrained` of them with a JSON schema. Over 10 decode steps it
times the step, the bitmask work before sampling (filling one row per constrained request from its
matcher, and setting the forbidden logits to -inf: structured_outputs.apply_grammar_masks) and advancing
the matchers with the sampled tokens (RequestGrammar.accept). Also: the schema's compile time, cold.
"""
from __future__ import annotations

import argparse
import time

import torch

import nanoserve.extensions.logits_processors as logits_processors
from nanoserve import LLM, SamplingParams
from nanoserve.extensions.structured_outputs import RequestGrammar, StructuredOutputsParams

# A long answer: the requests are still inside the grammar over the timed steps.
SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40},
    "year": {"type": "integer", "minimum": 1700, "maximum": 2100},
    "genre": {"enum": ["novel", "poem", "letter"]},
    "characters": {"type": "array", "minItems": 20, "items": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["name", "age"]}}},
    "required": ["title", "year", "genre", "characters"]}


def timed(function, spent: list[float]):
    def wrapper(*args):
        start = time.perf_counter()
        result = function(*args)
        spent.append(time.perf_counter() - start)
        return result
    return wrapper


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--constrained", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    llm = LLM(args.model, max_model_len=512, enable_prefix_caching=False)
    engine = llm.engine
    spec = StructuredOutputsParams(json=SCHEMA)
    start = time.perf_counter()
    engine.grammars.compile(spec).compiled.result()  # cold: xgrammar's tokenizer info, then the schema
    cold = time.perf_counter() - start
    start = time.perf_counter()
    engine.grammars.compile(StructuredOutputsParams(json=SCHEMA | {"required": ["title", "year"]})).compiled.result()
    compile_time = time.perf_counter() - start
    prompts = [f"Write a JSON record of a novel, number {i}, with its characters." for i in range(args.requests)]
    for i, prompt in enumerate(prompts):
        constrained = i % args.requests < args.constrained
        engine.add_request(prompt, SamplingParams(temperature=0.8, seed=i, max_tokens=400, ignore_eos=True,
                                                  structured_outputs=spec if constrained else None))
    while engine.step().num_prefill_tokens:
        pass
    for _ in range(3):  # warm up the decode path
        engine.step()
    masks: list[float] = []
    accepts: list[float] = []
    logits_processors.apply_grammar_masks = timed(logits_processors.apply_grammar_masks, masks)
    RequestGrammar.accept = timed(RequestGrammar.accept, accepts)
    steps = []
    for _ in range(args.steps):
        masks.clear()
        accepts.clear()
        start = time.perf_counter()
        result = engine.step()
        steps.append((time.perf_counter() - start, sum(masks), sum(accepts), len(result.decode_ids)))
    step, mask, accept, rows = sorted(steps)[len(steps) // 2]
    running = sum(1 for seq in engine.scheduler.running if seq.grammar is not None)
    print(f"torch threads {torch.get_num_threads()}; grammar compile: {1000 * cold:.0f} ms cold (with the "
          f"tokenizer's vocabulary), {1000 * compile_time:.0f} ms for another schema")
    print(f"decode step of {rows} requests ({running} constrained still running): median {1000 * step:.1f} ms; "
          f"bitmask fill + apply {1000 * mask:.2f} ms ({100 * mask / step:.1f}%), matcher advance "
          f"{1000 * accept:.2f} ms ({100 * accept / step:.1f}%)")


if __name__ == "__main__":
    main()
