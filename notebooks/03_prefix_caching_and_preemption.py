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
# # 03 · Prefix caching and preemption
#
# Two things the block manager and the scheduler do when memory matters:
#
# 1. **Prefix caching.** Requests that start with the same tokens (a shared system prompt) share the
#    KV blocks of that prefix instead of computing and storing it again. A full block is named by a
#    hash chained over its parent's hash and its own tokens, so one hash names the whole prefix up
#    to that block.
# 2. **Preemption by recompute.** When the cache is too small for every running request to grow,
#    the newest request gives its blocks back and goes to the front of the queue; later it is run
#    again from its tokens (prompt and everything it generated so far). Nothing is lost.

# %%
import torch
from transformers import LlamaConfig

import nanoserve

MODEL = nanoserve.DEFAULT_MODEL  # the bundled trained tiny Llama; prompts are token ids, so no tokenizer is needed

# %%
import random

import matplotlib.pyplot as plt

from block_map import plot_block_map  # notebooks/block_map.py, beside this notebook
from nanoserve import LLM, SamplingParams
from nanoserve.block_manager import hash_block
from nanoserve.entrypoints.trace import format_step

torch.set_num_threads(1)  # a small model: one thread is enough


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


# %% [markdown]
# ## Part 1: a shared system prompt
#
# A 16-token system prompt (four blocks of `block_size=4`) followed by a short question of a few
# tokens. The first request arrives alone; its prefill computes and caches its full blocks.

# %%
rng = random.Random(0)
vocab_size = LlamaConfig.from_pretrained(MODEL).vocab_size
SYSTEM = [rng.randrange(3, vocab_size) for _ in range(16)]
QUESTIONS = [[rng.randrange(3, vocab_size) for _ in range(rng.randint(3, 6))] for _ in range(4)]
PROMPTS = [SYSTEM + question for question in QUESTIONS]

engine = LLM(MODEL, block_size=4, num_kvcache_blocks=16, max_model_len=32).engine
manager = engine.scheduler.block_manager
first = engine.add_request(PROMPTS[0], greedy(8))
print(format_step(engine.step(), 1))

# %% [markdown]
# ### The hash chain
#
# After its prefill the first request's full blocks are registered in the block manager's
# `cached_blocks` (hash -> block id). Each hash covers the parent's hash and the block's tokens,
# so the fourth hash stands for all 16 system-prompt tokens, not only the four of its block. The
# fifth block already holds question tokens; its hash is this request's alone. Each cached block
# also remembers its parent block: a hit is verified against its tokens and that parent, so it
# implies the whole prefix matches even if two hashes ever collided.

# %%
seq = engine.requests[first]
parent = None
for i, block_hash in enumerate(seq.block_hashes):
    tokens = tuple(seq.token_ids[4 * i:4 * i + 4])
    assert hash_block(parent, tokens) == block_hash                   # the chain, recomputed
    assert manager.cached_blocks[block_hash] == seq.block_table[i]    # and findable
    block = manager.blocks[seq.block_table[i]]
    print(f"block {block.block_id}: tokens {tokens}  parent block {block.parent}  "
          f"sha256(parent hash, tokens) = {block_hash.hex()[:16]}...")
    parent = block_hash

# %% [markdown]
# ### Three more requests with the same system prompt
#
# They find the first four blocks in the cache: `find_cached_prefix` walks their hash chain and
# stops at the first miss (block 5 holds the question, different for each). Their block tables
# start with the same four blocks, whose `ref_cnt` becomes 4 (bold in the picture), and they only
# prefill their questions: the step below runs each of them from position 16, next to the first
# request's decode.

# %%
others = [engine.add_request(prompt, greedy(8)) for prompt in PROMPTS[1:]]
result = engine.step()
print(format_step(result, 2))
shared = seq.block_table[:4]
for request_id in others:
    assert engine.requests[request_id].block_table[:4] == shared
    assert engine.requests[request_id].num_cached_tokens == 16
assert [manager.blocks[b].ref_cnt for b in shared] == [4, 4, 4, 4]
print("\nshared blocks", shared, "ref_cnt", [manager.blocks[b].ref_cnt for b in shared])
plot_block_map(manager, engine).set_title("four requests share the system prompt's blocks")
plt.show()


# %% [markdown]
# ### Hit rate and the prefill tokens it saved
#
# `RequestOutput.num_cached_tokens` says how many prompt tokens each request took from the cache.
# The same requests served with `enable_prefix_caching=False` compute every prompt token, and
# produce the same tokens: a cache hit only skips work.

# %%
def serve(prompts: list[list[int]], arrive_first: bool, **config) -> tuple[list, int]:
    # All outputs in request order, and how many prefill tokens the model ran.
    engine = LLM(MODEL, block_size=4, num_kvcache_blocks=64, max_model_len=64, **config).engine  # no preemption
    outputs, num_prefill = {}, 0
    for i, prompt in enumerate(prompts):
        engine.add_request(prompt, greedy(8))
        if i == 0 and arrive_first:  # the first request's prefill runs alone, as above
            num_prefill += engine.step().num_prefill_tokens
    while engine.has_unfinished_requests():
        result = engine.step()
        num_prefill += result.num_prefill_tokens
        outputs.update((o.request_id, o) for o in result.outputs)
    return [outputs[str(i)] for i in range(len(prompts))], num_prefill

cached, cached_prefill = serve(PROMPTS, arrive_first=True)
uncached, uncached_prefill = serve(PROMPTS, arrive_first=True, enable_prefix_caching=False)
assert [o.token_ids for o in cached] == [o.token_ids for o in uncached]
num_prompt_tokens = sum(len(p) for p in PROMPTS)
num_cached = sum(o.num_cached_tokens for o in cached)
print("cached tokens per request:", [o.num_cached_tokens for o in cached])
print(f"cache hit rate: {num_cached} of {num_prompt_tokens} prompt tokens = {num_cached / num_prompt_tokens:.0%}")
print(f"prefill tokens run: {cached_prefill} with prefix caching, {uncached_prefill} without "
      f"({uncached_prefill - cached_prefill} saved)")
assert [o.num_cached_tokens for o in cached] == [0, 16, 16, 16]
assert uncached_prefill - cached_prefill == num_cached == 48

# %% [markdown]
# Had the four requests arrived in the same step, the three later ones would hit just the same: a
# block enters the cache when the step that fills it is scheduled, and every layer stores the
# whole step's K and V before any request attends, so a request may read, in the same step, the
# blocks that one admitted before it fills.

# %%
together, together_prefill = serve(PROMPTS, arrive_first=False)
print("cached tokens per request, all arriving together:", [o.num_cached_tokens for o in together])
assert [o.num_cached_tokens for o in together] == [o.num_cached_tokens for o in cached]
assert [o.token_ids for o in together] == [o.token_ids for o in cached] and together_prefill == cached_prefill

# %% [markdown]
# ## Part 2: a cache too small for the load
#
# Four requests of 6 prompt tokens, each generating 20: each grows to 25 tokens of KV, 7 blocks of
# 4 slots, 28 blocks in all. The cache has 8 (`num_kvcache_blocks=9`, block 0 being the null block).
# Only two are admitted: admission leaves free the blocks that the running requests need for their
# next 2 blocks' worth of tokens (`Scheduler.blocks_to_keep_free`), so requests 2 and 3 wait rather
# than be preempted a few steps later. Requests 0 and 1 then outgrow even that: when the oldest
# needs a new block and none is free, the scheduler preempts the newest running request: frees its
# blocks and puts it back at the front of the waiting queue, its tokens kept. Step by step:

# %%
PROMPTS2 = [[rng.randrange(3, vocab_size) for _ in range(6)] for _ in range(4)]

def serve_all(num_kvcache_blocks: int, show: bool) -> tuple[object, dict]:
    engine = LLM(MODEL, block_size=4, num_kvcache_blocks=num_kvcache_blocks, max_model_len=32).engine
    for prompt in PROMPTS2:
        engine.add_request(prompt, greedy(20))
    scheduler, outputs, step = engine.scheduler, {}, 0
    while engine.has_unfinished_requests():
        result = engine.step()
        step += 1
        history.append((result.scheduled, scheduler.num_preemptions))
        outputs.update((o.request_id, o) for o in result.outputs)
        if show:
            ran = " ".join(f"{r}:{n}" for r, n in result.scheduled)
            print(f"step {step:2}  ran {ran:<16} running {[s.request_id for s in scheduler.running]!s:<21}"
                  f"waiting {[s.request_id for s in scheduler.waiting]!s:<11}"
                  f"free blocks {scheduler.block_manager.num_free_blocks}  preemptions {scheduler.num_preemptions}")
        if show and step == 12:
            plot_block_map(scheduler.block_manager, engine).set_title("step 12: request 1 preempted")
    return engine, outputs

history = []  # (scheduled, num_preemptions) of every step
small, small_outputs = serve_all(num_kvcache_blocks=9, show=True)
plt.show()
assert history[0] == ([("0", 6), ("1", 6)], 0)  # step 1: only two admitted, 2 and 3 wait
assert history[11] == ([("0", 1)], 1)            # step 12: request 1 preempted
assert ([("1", 13)], 1) in history               # its recompute: 6 + 11 tokens, less its own cached block

# %% [markdown]
# In step 12 requests 0 and 1 each need a sixth block. None is free, so request 1 (the newest) is
# preempted: it goes back to the front of `waiting`, its blocks to the free queue. Request 0 runs to
# the end; then request 1 comes back, recomputing its prompt and the 11 tokens it had generated in
# one prefill, and carries on decoding; 2 and 3 come last.
#
# The picture shows one more thing: request 1's full blocks are free but still cached. Those that
# survive until it comes back are found again (`1:13` runs 17 tokens less one block of 4); the
# others were handed to request 0 as it grew, which evicted them. Re-finding its own blocks is no
# prefix-cache hit: `num_cached_tokens` counts only a request's first admission.
#
# Nothing is lost: the outputs equal those of a run with room for everyone.

# %%
roomy, roomy_outputs = serve_all(num_kvcache_blocks=64, show=False)
assert small_outputs["1"].num_cached_tokens == 0  # its own blocks, re-found, are no prefix-cache hit
assert small.scheduler.num_preemptions > 0 and roomy.scheduler.num_preemptions == 0
assert all(len(o.token_ids) == 20 for o in small_outputs.values())
assert {r: o.token_ids for r, o in small_outputs.items()} == {r: o.token_ids for r, o in roomy_outputs.items()}
assert small.scheduler.block_manager.num_free_blocks == 8
print(f"{small.scheduler.num_preemptions} preemptions; all {len(small_outputs)} requests finished; "
      "outputs equal to the roomy run's")

# %% [markdown]
# Preemption by recompute trades compute for memory: the preempted requests' prompts ran twice.
# vLLM can also swap KV out to CPU memory instead; recompute is simpler and, for short sequences,
# often as fast.
