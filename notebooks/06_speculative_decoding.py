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
# # 06 · Speculative decoding: draft, verify, accept
#
# With `speculative_config` (docs/speculative-decoding.md), a decoding request whose context ends
# in an n-gram seen before gets the tokens that followed it as **drafts**: they run behind its last
# token as one varlen row of 1 + k query tokens, every position is sampled, and the drafts are kept
# while they equal the samples, plus one **bonus** token. Here the bundled model, `block_size` 4,
# k = 3, on a prompt that repeats itself; each step prints the walkthrough's arrays.

# %%
from nanoserve import DEFAULT_MODEL, LLM, SamplingParams
from nanoserve.entrypoints.trace import format_step

spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
setup = dict(block_size=4, num_kvcache_blocks=12, max_model_len=32)
engine = LLM(DEFAULT_MODEL, speculative_config=spec, **setup).engine
prompt = engine.tokenizer.encode("a very respectable man, and a very respectable man, and a very")
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
engine.add_request(prompt, params)
tokens_per_step, outputs, step = [], [], 0
while engine.has_unfinished_requests():
    step += 1
    result = engine.step()
    print(format_step(result, step))
    tokens_per_step.append(sum(len(delta.token_ids) for delta in result.deltas))
    outputs += result.outputs
    engine.assert_invariants()  # every block and request accounted for, after each step

# %% [markdown]
# A step that verified drafts shows them in its `decode` line ("+ 3 drafts, 1 accepted"): its
# row has 4 `input_ids`, 4 `positions` and 4 `slot_mapping` entries, and it made 1 + accepted
# tokens. The output is token for token what decoding without drafts makes:

# %%
stats = engine.stats()
print(f"tokens per step: {tokens_per_step}")
print({name: stats[name] for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")})
plain = LLM(DEFAULT_MODEL, **setup).generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
print(f"with drafts: {outputs[0].token_ids}\nwithout:     {plain}")
assert outputs[0].token_ids == plain
assert sum(tokens_per_step) == 8 and len(tokens_per_step) < 8  # fewer steps than tokens: drafts were kept
assert stats["num_accepted_tokens"] > 0 and stats["num_draft_tokens"] > stats["num_accepted_tokens"]
