# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 05 · Structured outputs: the token mask, step by step
#
# A request with `structured_outputs` samples only the tokens its grammar allows next
# (docs/structured-outputs.md). Here the bundled Austen model, which never saw JSON, answers a JSON
# schema, and each step shows how many of its 4,096 tokens the mask left open: many inside a
# free string, a handful where the schema offers a choice, one where it leaves none.

# %%
import matplotlib.pyplot as plt
import torch
import xgrammar as xgr

from nanoserve import DEFAULT_MODEL, LLM, SamplingParams
from nanoserve.extensions.structured_outputs import StructuredOutputsParams

llm = LLM(DEFAULT_MODEL)
engine, tokenizer = llm.engine, llm.engine.tokenizer
schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
          "mood": {"enum": ["glad", "vexed"]}, "age": {"type": "integer", "minimum": 18, "maximum": 99}},
          "required": ["name", "mood", "age"]}
params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=schema))


def num_allowed(seq) -> int:
    """How many tokens the request's grammar allows next: the bits set in its mask row."""
    bitmask = xgr.allocate_token_bitmask(1, engine.vocab_size)
    seq.grammar.start().fill_next_token_bitmask(bitmask, 0)
    logits = torch.zeros(1, engine.vocab_size)
    xgr.apply_token_bitmask_inplace(logits, bitmask)
    return int(logits.isfinite().sum())


request_id = engine.add_request("It is a truth universally acknowledged", params)
seq = engine.requests[request_id]
seq.grammar.compiled.result()  # compiled in the background; wait for it here, to look at its matcher
counts, tokens = [], []
while engine.has_unfinished_requests():
    counts.append(num_allowed(seq))
    engine.step()
    tokens.append(tokenizer.decode([seq.token_ids[-1]]))
for count, token in zip(counts, tokens):
    print(f"{count:5d} allowed -> {token!r}")
print(seq.detokenizer.text, seq.finish_reason)
assert counts[0] == 1 and tokens[0] == "{"  # the schema leaves no choice for the first token
assert counts[-1] == 1 and seq.finish_reason == "stop"  # after the closing brace: only EOS

# %%
plt.figure(figsize=(10, 3))
plt.bar(range(len(counts)), counts)
plt.yscale("log")
plt.xticks(range(len(tokens)), tokens, rotation=90)
plt.ylabel("tokens allowed")
plt.title("the mask before each sampled token")
plt.show()
