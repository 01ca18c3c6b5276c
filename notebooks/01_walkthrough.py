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
# # 01 · The walkthrough, replayed
#
# [The walkthrough](../docs/walkthrough.md) follows vLLM's example step by step: three prompts,
# `block_size=4`, one prefill step, one decode step. Here nanoserve runs exactly that example, prints
# each step's flat batch with `nanoserve.entrypoints.trace.format_step`, draws the KV cache with `plot_block_map`,
# and then goes one step further than the document: a request finishes, its blocks are freed, and a new
# request joins mid-flight and takes them. That is continuous batching.
#
# Every number below is also an `assert`: if the engine ever stops producing the walkthrough's
# numbers, this notebook fails in CI.

# %%
import nanoserve

MODEL = nanoserve.DEFAULT_MODEL  # the bundled trained tiny Llama; prompts are token ids, so no tokenizer is needed

# %%
import matplotlib.pyplot as plt

from block_map import plot_block_map  # notebooks/block_map.py, beside this notebook
from nanoserve import LLM, SamplingParams
from nanoserve.entrypoints.trace import format_step

# %% [markdown]
# ## The setup
#
# The three prompts of the walkthrough, as token ids: "Hi, my name is" (5 tokens), "Today is a
# beautiful summer day" (7) and "Hello there" (3). The KV cache is deliberately tiny so that every
# block is visible: `num_kvcache_blocks=8` blocks of `block_size=4` slots. Block 0 is the null block
# (it pads block tables and is never handed out), so blocks 1-7 (28 slots) hold KV. `max_model_len`
# must fit in those, so it is 16 here.
#
# `ignore_eos=True` makes each request produce exactly `max_tokens` tokens: request 0 stops after
# 3, requests 1 and 2 after 6. That choice is what makes request 0 finish at step 3.

# %%
engine = LLM(MODEL, block_size=4, num_kvcache_blocks=8, max_model_len=16).engine
PROMPTS = [[1, 2, 3, 4, 5], [1, 6, 5, 7, 8, 9, 10], [1, 12, 13]]
for prompt, max_tokens in zip(PROMPTS, [3, 6, 6]):
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
seqs = dict(engine.requests)  # request id -> its Sequence, kept after they finish
print(seqs)

# %% [markdown]
# ## Step 1: prefill, three prompts flattened into one batch of 15 tokens
#
# There is no batch dimension: the three prompts are laid end to end. `positions` restart at 0 for
# every request, and `query_start_loc` says where each request's tokens start in the flat batch.

# %%
step1 = engine.step()
print(format_step(step1, 1))
batch = step1.batch
assert batch.input_ids.tolist() == [1, 2, 3, 4, 5, 1, 6, 5, 7, 8, 9, 10, 1, 12, 13]
assert batch.positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2]
assert batch.slot_mapping.tolist() == [4, 5, 6, 7, 8, 12, 13, 14, 15, 16, 17, 18, 20, 21, 22]
assert batch.query_start_loc.tolist() == [0, 5, 12, 15]
assert batch.seq_lens.tolist() == [5, 7, 3]
assert [seqs[r].block_table for r in "012"] == [[1, 2], [3, 4], [5]]

# %% [markdown]
# ### Reading `slot_mapping`
#
# The KV cache is one big array of `num_blocks * block_size` slots. Token at position `p` of a
# request lives in block `block_table[p // block_size]`, at offset `p % block_size`, so its slot is
#
#     slot = block_table[p // block_size] * block_size + p % block_size
#
# Request 1 ("Today is a beautiful summer day", 7 tokens) got blocks 3 and 4: its first four
# tokens go to slots 12-15 (block 3), the other three to 16-18 (block 4). The model never sees
# block ids, only slots: it writes each token's K and V at its slot and attends over the slots of
# its request's block table. The free queue hands out blocks first-in first-out, so the first
# request got blocks 1 and 2, the second 3 and 4, the third 5.
#
# The formula, checked against the engine's `slot_mapping`:

# %%
starts = batch.query_start_loc.tolist()
by_hand = []
for r, request_id in enumerate("012"):
    table = seqs[request_id].block_table
    for p in batch.positions[starts[r]:starts[r + 1]].tolist():
        by_hand.append(table[p // 4] * 4 + p % 4)
print(by_hand)
assert by_hand == batch.slot_mapping.tolist()

# %% [markdown]
# The KV cache after step 1. Each row is a block, each cell a slot, labelled with its token id.
# A solid cell holds computed KV; a pale one is reserved but still empty. The token shown in the
# pale cell right after each prompt is the one step 1 just sampled: its KV is computed when it is
# fed back in, in step 2. `ref_cnt` counts the block tables that hold a block.

# %%
plot_block_map(engine.scheduler.block_manager, engine).set_title("after step 1")
plt.show()

# %% [markdown]
# ## Step 2: decode, one new token per request
#
# Each request now feeds back the token it sampled: three tokens in all (the walkthrough calls them
# 14, 15, 16; here they are whatever the model sampled). They sit at positions 5, 7 and 3 and are
# written to slots 9 (block 2), 19 (block 4) and 23 (block 5). Attention reads the earlier tokens'
# K and V from the cache; nothing of the prompts is recomputed. `seq_lens` grows by one.

# %%
sampled = [seqs[r].token_ids[-1] for r in "012"]
step2 = engine.step()
print(format_step(step2, 2))
batch = step2.batch
assert batch.input_ids.tolist() == sampled
assert batch.positions.tolist() == [5, 7, 3]
assert batch.slot_mapping.tolist() == [9, 19, 23]
assert batch.query_start_loc.tolist() == [0, 1, 2, 3]
assert batch.seq_lens.tolist() == [6, 8, 4]
assert (step2.num_prefill_tokens, step2.num_decode_tokens) == (0, 3)

# %% [markdown]
# ## Step 3: blocks are allocated as requests grow, and request 0 finishes
#
# Request 1 writes position 8 and request 2 position 4: both have filled their last block, so each
# takes a new one from the free queue (blocks 6 and 7). The cache is now full. Request 0 samples its
# third token and finishes; its blocks go back to the free queue at once, last block first (the
# tail of a sequence is the least likely to be shared, so it should be evicted first): the queue is
# now `[2, 1]`.
#
# Block 1 is full and its KV is still there, so it stays in the prefix cache: a later request with
# the prompt `[1, 2, 3, 4, ...]` could reuse it. Block 2 was never full, so it is just free.

# %%
step3 = engine.step()
print(format_step(step3, 3))
manager = engine.scheduler.block_manager
assert step3.batch.positions.tolist() == [6, 8, 4]
assert step3.batch.slot_mapping.tolist() == [10, 24, 28]
assert [seqs[r].block_table for r in "12"] == [[3, 4, 6], [5, 7]]
assert [o.request_id for o in step3.outputs] == ["0"] and len(step3.outputs[0].token_ids) == 3
assert list(manager.free_queue) == [2, 1]
assert manager.blocks[1].hash is not None and manager.blocks[2].hash is None
print("free queue:", list(manager.free_queue))
plot_block_map(manager, engine).set_title("after step 3: request 0 finished")
plt.show()

# %% [markdown]
# ## Step 4: a new request joins mid-flight and takes the freed blocks
#
# A static batch would now leave request 0's seat empty until requests 1 and 2 are done. With
# continuous batching a request that arrives now is admitted in the very next step, next to the two
# decodes: the step mixes two decode tokens with a 6-token prefill.
#
# The newcomer needs two blocks and the free queue holds exactly `[2, 1]`, so its block table is
# `[2, 1]`: the order is the free queue's, not the cache's. Positions 0-3 go to block 2 (slots
# 8-11), positions 4-5 to block 1 (slots 4-5). Its first block `[1, 20, 21, 22]` is not block 1's
# `[1, 2, 3, 4]`, so there is no prefix-cache hit, and handing block 1 out evicts its cached KV.

# %%
engine.add_request([1, 20, 21, 22, 23, 24], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
seqs.update(engine.requests)
step4 = engine.step()
print(format_step(step4, 4))
batch = step4.batch
assert step4.scheduled == [("1", 1), ("2", 1), ("3", 6)]
assert batch.positions.tolist() == [9, 5, 0, 1, 2, 3, 4, 5]
assert batch.slot_mapping.tolist() == [25, 29, 8, 9, 10, 11, 4, 5]
assert batch.query_start_loc.tolist() == [0, 1, 2, 8]
assert batch.seq_lens.tolist() == [10, 6, 6]
assert seqs["3"].block_table == [2, 1]
assert (step4.num_prefill_tokens, step4.num_decode_tokens) == (6, 2)
assert manager.num_free_blocks == 0 and manager.blocks[1].hash is None
plot_block_map(manager, engine).set_title("after step 4: request 3 joined")
plt.show()

# %% [markdown]
# ## To the end
#
# The remaining steps are all decodes. Every request stops at its own `max_tokens`, and every block
# comes back: seven free blocks. Each was full when it was freed, so each stays in the prefix
# cache (grey, with its tokens) until it is handed out again.

# %%
step_index = 4
while engine.has_unfinished_requests():
    step_index += 1
    result = engine.step()
    print(format_step(result, step_index), end="\n\n")
assert [len(seqs[r].output_token_ids) for r in "0123"] == [3, 6, 6, 3]
assert manager.num_free_blocks == 7
assert all(manager.blocks[b].hash is not None for b in range(1, 8))  # all full, all still cached
plot_block_map(manager, []).set_title("all finished")
plt.show()

# %% [markdown]
# ## What to take away
#
# - One step = one flat batch: prefill chunks and decode tokens of different requests side by side,
#   described by `positions`, `slot_mapping`, `query_start_loc`, `seq_lens` and `block_tables`.
# - KV lives in fixed-size blocks; a request's block table maps its positions to slots, so its KV
#   need not be contiguous, or even in order (`[2, 1]`).
# - Blocks are taken one at a time as a request grows and returned the moment it finishes, so a new
#   request can take them in the next step.
