"""Write the notebooks in this folder from the cells below: edit here, then run

    python notebooks/make_notebooks.py

The .ipynb files are stored without outputs; tests/test_notebooks.py executes every one of them, so
each `assert` in a notebook is a test. Notebooks import nanoserve and never redefine its logic.
"""
from pathlib import Path
from textwrap import dedent

import nbformat

HERE = Path(__file__).resolve().parent

# Every notebook runs on the bundled trained model when this checkout has one, else on a tiny random
# Llama built on the spot. Prompts are token ids, so no tokenizer is needed either way.
MODEL_CELL = '''
import os
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import nanoserve

MODEL = getattr(nanoserve, "DEFAULT_MODEL", None)
if MODEL is None or not os.path.isdir(MODEL):  # no bundled model: a tiny random Llama (numbers, not language)
    torch.manual_seed(0)
    MODEL = tempfile.mkdtemp()
    LlamaForCausalLM(LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 intermediate_size=128, vocab_size=256, max_position_embeddings=256)).save_pretrained(MODEL)
print("model:", MODEL)
'''


def notebook(*cells: str) -> nbformat.NotebookNode:
    """Cells are strings; one that starts with "md:" is markdown, any other is code."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    for cell in cells:
        if cell.startswith("md:"):
            nb.cells.append(nbformat.v4.new_markdown_cell(dedent(cell[3:]).strip()))
        else:
            nb.cells.append(nbformat.v4.new_code_cell(dedent(cell).strip()))
    return nb


WALKTHROUGH = notebook(
    """md:
    # 01 · The walkthrough, replayed

    The walkthrough document follows vLLM's example step by step: three prompts, `block_size=4`,
    one prefill step, one decode step. Here nanoserve runs exactly that example, prints each step's
    flat batch with `nanoserve.trace.format_step`, draws the KV cache with `plot_block_map`, and then
    goes one step further than the document: a request finishes, its blocks are freed, and a new
    request joins mid-flight and takes them. That is continuous batching.

    Every number below is also an `assert`: if the engine ever stops producing the walkthrough's
    numbers, this notebook fails in CI.
    """,
    MODEL_CELL,
    """
    import matplotlib.pyplot as plt

    from nanoserve import LLM, SamplingParams
    from nanoserve.trace import format_step, plot_block_map
    """,
    """md:
    ## The setup

    The three prompts of the walkthrough, as token ids: "Hi, my name is" (5 tokens), "Today is a
    beautiful summer day" (7) and "Hello there" (3). The KV cache is deliberately tiny so that every
    block is visible: `num_kvcache_blocks=8` blocks of `block_size=4` slots. Block 0 is the null block
    (it pads block tables and is never handed out), so blocks 1-7 (28 slots) hold KV. `max_model_len`
    must fit in those, so it is 16 here.

    `ignore_eos=True` makes each request produce exactly `max_tokens` tokens: request 0 stops after
    3, requests 1 and 2 after 6. That choice is what makes request 0 finish at step 3.
    """,
    """
    engine = LLM(MODEL, block_size=4, num_kvcache_blocks=8, max_model_len=16).engine
    PROMPTS = [[1, 2, 3, 4, 5], [1, 6, 5, 7, 8, 9, 10], [1, 12, 13]]
    for prompt, max_tokens in zip(PROMPTS, [3, 6, 6]):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    seqs = dict(engine.requests)  # request id -> its Sequence, kept after they finish
    print(seqs)
    """,
    """md:
    ## Step 1: prefill, three prompts flattened into one batch of 15 tokens

    There is no batch dimension: the three prompts are laid end to end. `positions` restart at 0 for
    every request, and `query_start_loc` says where each request's tokens start in the flat batch.
    """,
    """
    step1 = engine.step()
    print(format_step(step1, 1))
    batch = step1.batch
    assert batch.input_ids.tolist() == [1, 2, 3, 4, 5, 1, 6, 5, 7, 8, 9, 10, 1, 12, 13]
    assert batch.positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2]
    assert batch.slot_mapping.tolist() == [4, 5, 6, 7, 8, 12, 13, 14, 15, 16, 17, 18, 20, 21, 22]
    assert batch.query_start_loc.tolist() == [0, 5, 12, 15]
    assert batch.seq_lens.tolist() == [5, 7, 3]
    assert [seqs[r].block_table for r in "012"] == [[1, 2], [3, 4], [5]]
    """,
    """md:
    ### Reading `slot_mapping`

    The KV cache is one big array of `num_blocks * block_size` slots. Token at position `p` of a
    request lives in block `block_table[p // block_size]`, at offset `p % block_size`, so its slot is

        slot = block_table[p // block_size] * block_size + p % block_size

    Request 1 ("Today is a beautiful summer day", 7 tokens) got blocks 3 and 4: its first four
    tokens go to slots 12-15 (block 3), the other three to 16-18 (block 4). The model never sees
    block ids, only slots: it writes each token's K and V at its slot and attends over the slots of
    its request's block table. The free queue hands out blocks first-in first-out, so the first
    request got blocks 1 and 2, the second 3 and 4, the third 5.

    The formula, checked against the engine's `slot_mapping`:
    """,
    """
    starts = batch.query_start_loc.tolist()
    by_hand = []
    for r, request_id in enumerate("012"):
        table = seqs[request_id].block_table
        for p in batch.positions[starts[r]:starts[r + 1]].tolist():
            by_hand.append(table[p // 4] * 4 + p % 4)
    print(by_hand)
    assert by_hand == batch.slot_mapping.tolist()
    """,
    """md:
    The KV cache after step 1. Each row is a block, each cell a slot, labelled with its token id.
    A solid cell holds computed KV; a pale one is reserved but still empty. The token shown in the
    pale cell right after each prompt is the one step 1 just sampled: its KV is computed when it is
    fed back in, in step 2. `ref_cnt` counts the block tables that hold a block.
    """,
    """
    plot_block_map(engine.scheduler.block_manager, engine).set_title("after step 1")
    plt.show()
    """,
    """md:
    ## Step 2: decode, one new token per request

    Each request now feeds back the token it sampled: three tokens in all (the walkthrough calls them
    14, 15, 16; here they are whatever the model sampled). They sit at positions 5, 7 and 3 and are
    written to slots 9 (block 2), 19 (block 4) and 23 (block 5). Attention reads the earlier tokens'
    K and V from the cache; nothing of the prompts is recomputed. `seq_lens` grows by one.
    """,
    """
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
    """,
    """md:
    ## Step 3: blocks are allocated as requests grow, and request 0 finishes

    Request 1 writes position 8 and request 2 position 4: both have filled their last block, so each
    takes a new one from the free queue (blocks 6 and 7). The cache is now full. Request 0 samples its
    third token and finishes; its blocks go back to the free queue at once, last block first (the
    tail of a sequence is the least likely to be shared, so it should be evicted first): the queue is
    now `[2, 1]`.

    Block 1 is full and its KV is still there, so it stays in the prefix cache: a later request with
    the prompt `[1, 2, 3, 4, ...]` could reuse it. Block 2 was never full, so it is just free.
    """,
    """
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
    """,
    """md:
    ## Step 4: a new request joins mid-flight and takes the freed blocks

    A static batch would now leave request 0's seat empty until requests 1 and 2 are done. With
    continuous batching a request that arrives now is admitted in the very next step, next to the two
    decodes: the step mixes two decode tokens with a 6-token prefill.

    The newcomer needs two blocks and the free queue holds exactly `[2, 1]`, so its block table is
    `[2, 1]`: the order is the free queue's, not the cache's. Positions 0-3 go to block 2 (slots
    8-11), positions 4-5 to block 1 (slots 4-5). Its first block `[1, 20, 21, 22]` is not block 1's
    `[1, 2, 3, 4]`, so there is no prefix-cache hit, and handing block 1 out evicts its cached KV.
    """,
    """
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
    """,
    """md:
    ## To the end

    The remaining steps are all decodes. Every request stops at its own `max_tokens`, and every block
    comes back: seven free blocks. Each was full when it was freed, so each stays in the prefix
    cache (grey, with its tokens) until it is handed out again.
    """,
    """
    step_index = 4
    while engine.has_unfinished_requests():
        step_index += 1
        result = engine.step()
        print(format_step(result, step_index), end="\\n\\n")
    assert [len(seqs[r].output_token_ids) for r in "0123"] == [3, 6, 6, 3]
    assert manager.num_free_blocks == 7
    assert all(manager.blocks[b].hash is not None for b in range(1, 8))  # all full, all still cached
    plot_block_map(manager, []).set_title("all finished")
    plt.show()
    """,
    """md:
    ## What to take away

    - One step = one flat batch: prefill chunks and decode tokens of different requests side by side,
      described by `positions`, `slot_mapping`, `query_start_loc`, `seq_lens` and `block_tables`.
    - KV lives in fixed-size blocks; a request's block table maps its positions to slots, so its KV
      need not be contiguous, or even in order (`[2, 1]`).
    - Blocks are taken one at a time as a request grows and returned the moment it finishes, so a new
      request can take them in the next step.
    """,
)

STATIC_VS_CONTINUOUS = notebook(
    """md:
    # 02 · Static vs continuous batching, measured

    The seed chapter claims that continuous batching raises throughput 3-5x over static batching and
    KV-cache utilisation from 40% to 85%. This notebook runs one workload both ways on this machine
    and measures: batch occupancy per step, KV slots in use vs reserved, per-request time to first
    token (TTFT) and latency, and throughput.

    Both runs use the same engine, model and `max_num_seqs`; only `scheduling` differs:

    - `"static"`: a batch of up to `max_num_seqs` requests is admitted only when the previous batch has
      completely finished, and each request reserves KV for its prompt plus `max_tokens` up front.
    - `"continuous"`: every step, finished requests leave and waiting ones join; KV blocks are taken
      one at a time as requests grow.
    """,
    MODEL_CELL,
    """
    import random
    import statistics
    import time

    import matplotlib.pyplot as plt

    from nanoserve import LLM, SamplingParams

    # The model is small: on a CPU, more threads mostly add synchronisation (and noise when the
    # machine is shared), so both runs use one.
    torch.set_num_threads(1)
    """,
    """md:
    ## The workload

    32 requests, all queued at once. Prompts of 4-48 tokens; output lengths drawn from a long-tailed
    (log-normal) distribution, as chat answers are: most short, a few long. `ignore_eos=True` makes
    every request produce exactly its `max_tokens`, so both runs do the same work and the static
    baseline gets the best case: it knows each request's true length and reserves exactly that.
    """,
    """
    MAX_NUM_SEQS, BLOCK_SIZE = 8, 8
    vocab_size = LlamaConfig.from_pretrained(MODEL).vocab_size
    rng = random.Random(0)
    prompts = [[rng.randrange(3, vocab_size) for _ in range(rng.randint(4, 48))] for _ in range(32)]
    output_lens = [min(160, max(4, int(rng.lognormvariate(3.0, 0.9)))) for _ in prompts]
    print("output lengths:", sorted(output_lens))
    """,
    """
    def run(scheduling: str) -> dict:
        # Serve the workload; record every step's batch and KV cache, and every request's output.
        engine = LLM(MODEL, scheduling=scheduling, max_num_seqs=MAX_NUM_SEQS, block_size=BLOCK_SIZE,
                     enable_prefix_caching=False).engine
        for prompt, n in zip(prompts, output_lens):
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        steps, outputs = [], {}
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            result = engine.step()
            running = engine.scheduler.running
            steps.append(dict(
                num_requests=len(result.scheduled),
                kv_in_use=sum(seq.num_computed_tokens for seq in running),           # slots holding KV
                kv_reserved=sum(len(seq.block_table) for seq in running) * BLOCK_SIZE))  # slots held
            outputs.update((o.request_id, o) for o in result.outputs)
        seconds = time.perf_counter() - start
        outputs = [outputs[str(i)] for i in range(len(prompts))]
        return dict(steps=steps, outputs=outputs, seconds=seconds,
                    tokens=sum(len(o.token_ids) for o in outputs))

    # Steps and tokens are deterministic; wall-clock time is not: keep the faster of two runs of each.
    runs = {scheduling: min((run(scheduling) for _ in range(2)), key=lambda r: r["seconds"])
            for scheduling in ("static", "continuous")}
    assert runs["static"]["tokens"] == runs["continuous"]["tokens"] == sum(output_lens)
    assert [o.token_ids for o in runs["static"]["outputs"]] == [o.token_ids for o in runs["continuous"]["outputs"]]
    """,
    """md:
    Both runs produced the same tokens (greedy): scheduling changes when work happens, never the answer.

    ## Batch occupancy per step

    How many requests each step ran. Static batching starts each batch full, then the seats of
    requests that finished stay empty until the longest request of the batch is done. Continuous
    batching refills a seat in the step after it frees, so it stays full until the queue runs dry.
    """,
    """
    fig, ax = plt.subplots(figsize=(9, 3))
    for name, r in runs.items():
        ax.plot([s["num_requests"] for s in r["steps"]], label=f"{name}: {len(r['steps'])} steps", drawstyle="steps-post")
    ax.axhline(MAX_NUM_SEQS, color="gray", linestyle=":", label="max_num_seqs")
    ax.set(xlabel="step", ylabel="requests in the batch", title="batch occupancy")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
    plt.show()
    """,
    """md:
    ## KV-cache slots in use vs reserved

    *In use*: slots that hold a computed token's K and V. *Reserved*: slots in blocks that running
    requests hold. The gap is memory that no other request can use. Static batching reserves every
    request's full length at admission, so the gap is largest right after a batch starts; continuous
    batching only ever holds the partly filled last block of each request.
    """,
    """
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.2), sharey=True)
    for ax, (name, r) in zip(axes, runs.items()):
        in_use = [s["kv_in_use"] for s in r["steps"]]
        reserved = [s["kv_reserved"] for s in r["steps"]]
        ax.fill_between(range(len(reserved)), in_use, reserved, color="tab:red", alpha=0.3, step="post", label="reserved, empty")
        ax.plot(reserved, color="tab:red", drawstyle="steps-post", label="reserved")
        ax.plot(in_use, color="tab:blue", drawstyle="steps-post", label="in use")
        ax.set(title=f"{name}: KV utilisation {sum(in_use) / sum(reserved):.0%}", xlabel="step")
    axes[0].set_ylabel("KV slots")
    axes[0].legend()
    plt.show()
    """,
    """md:
    ## Time to first token and latency, per request

    All requests arrive at once, in order. Under static batching a request in the second batch waits
    for the whole first batch, including its longest request, before its prompt is even read.
    """,
    """
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.2))
    for name, r in runs.items():
        axes[0].plot([o.ttft * 1000 for o in r["outputs"]], "o-", markersize=3, label=name)
        axes[1].plot([o.latency * 1000 for o in r["outputs"]], "o-", markersize=3, label=name)
    axes[0].set(title="time to first token", xlabel="request (arrival order)", ylabel="ms")
    axes[1].set(title="latency (arrival to last token)", xlabel="request (arrival order)", ylabel="ms")
    axes[0].legend()
    plt.show()
    """,
    """md:
    ## The numbers, next to the seed chapter's claims
    """,
    """
    def summary(r: dict) -> dict:
        steps = r["steps"]
        return {
            "steps": len(steps),
            "seconds": r["seconds"],
            "mean step time (ms)": 1000 * r["seconds"] / len(steps),
            "output tokens/s": r["tokens"] / r["seconds"],
            "mean batch occupancy": statistics.mean(s["num_requests"] for s in steps) / MAX_NUM_SEQS,
            "KV utilisation": sum(s["kv_in_use"] for s in steps) / sum(s["kv_reserved"] for s in steps),
            "mean TTFT (ms)": 1000 * statistics.mean(o.ttft for o in r["outputs"]),
            "mean latency (ms)": 1000 * statistics.mean(o.latency for o in r["outputs"]),
        }

    table = {name: summary(r) for name, r in runs.items()}
    print(f"{'':24}{'static':>12}{'continuous':>12}")
    for key in table["static"]:
        print(f"{key:24}{table['static'][key]:12.4g}{table['continuous'][key]:12.4g}")
    throughput_ratio = table["continuous"]["output tokens/s"] / table["static"]["output tokens/s"]
    step_ratio = table["static"]["steps"] / table["continuous"]["steps"]
    print(f"\\nthroughput, continuous / static: {throughput_ratio:.2f}x measured here   (seed chapter: 3-5x)")
    print(f"steps, static / continuous:      {step_ratio:.2f}x")
    print(f"KV utilisation, static -> continuous: {table['static']['KV utilisation']:.0%} -> "
          f"{table['continuous']['KV utilisation']:.0%}   (seed chapter: 40% -> 85%)")
    assert table["continuous"]["steps"] < table["static"]["steps"]
    assert table["continuous"]["KV utilisation"] > table["static"]["KV utilisation"]
    """,
    """md:
    ## Reading the numbers honestly

    The two asserted facts do not depend on the machine: continuous batching needs fewer steps for the
    same tokens (no seat stays empty while requests wait), and it wastes less reserved KV. How much
    each is worth does depend on things the seed chapter does not state:

    - **Throughput follows steps only where a step's cost hardly depends on its batch size.** That is
      the case the seed has in mind: a large model on a GPU, where a decode step is memory-bound (it
      reads all the weights whether it serves 1 request or 8; see notebook 04). A CPU core's ridge
      point is low: a few decodes per step already make it compute-bound, so a step of 8 requests costs
      more than a step of 2 (compare the mean step times above), the static run's thin steps are
      cheaper, and the wall-clock ratio can fall well below the step ratio. With a model so small that
      fixed per-step overhead dominates, the two stay close. The step ratio is what a memory-bound GPU
      would turn into throughput; timings on a shared machine are also noisy.
    - **The gain grows with the spread of output lengths and with the batch size.** Static batching
      loses, per batch, the gap between its longest request and its average one. Raise the log-normal's
      sigma or `MAX_NUM_SEQS` above and the ratio grows; give every request the same length and it
      falls to about 1.
    - **This static baseline is generous.** It knows each request's exact length and reserves just
      that, and it returns a finished request's blocks at once. A real static server does not know
      when a request will stop, so it reserves up to `max_model_len` and pads every request to the
      longest: its KV utilisation is far lower, which is where figures like the seed's 40% come from.
    - **The seed's 3-5x and 40% -> 85% are claims about production workloads and GPUs**, not laws:
      treat the printed ratios as what this workload, this model and this machine give.
    """,
)

PREFIX_CACHING_AND_PREEMPTION = notebook(
    """md:
    # 03 · Prefix caching and preemption

    Two things the block manager and the scheduler do when memory matters:

    1. **Prefix caching.** Requests that start with the same tokens (a shared system prompt) share the
       KV blocks of that prefix instead of computing and storing it again. A full block is named by a
       hash chained over its parent's hash and its own tokens, so one hash names the whole prefix up
       to that block.
    2. **Preemption by recompute.** When the cache is too small for every running request to grow,
       the newest request gives its blocks back and goes to the front of the queue; later it is run
       again from its tokens (prompt and everything it generated so far). Nothing is lost.
    """,
    MODEL_CELL,
    """
    import random

    import matplotlib.pyplot as plt

    from nanoserve import LLM, SamplingParams
    from nanoserve.block_manager import hash_block
    from nanoserve.trace import format_step, plot_block_map

    torch.set_num_threads(1)  # a small model: one thread is enough


    def greedy(max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    """,
    """md:
    ## Part 1: a shared system prompt

    A 16-token system prompt (four blocks of `block_size=4`) followed by a short question of a few
    tokens. The first request arrives alone; its prefill computes and caches its full blocks.
    """,
    """
    rng = random.Random(0)
    vocab_size = LlamaConfig.from_pretrained(MODEL).vocab_size
    SYSTEM = [rng.randrange(3, vocab_size) for _ in range(16)]
    QUESTIONS = [[rng.randrange(3, vocab_size) for _ in range(rng.randint(3, 6))] for _ in range(4)]
    PROMPTS = [SYSTEM + question for question in QUESTIONS]

    engine = LLM(MODEL, block_size=4, num_kvcache_blocks=16, max_model_len=32).engine
    manager = engine.scheduler.block_manager
    first = engine.add_request(PROMPTS[0], greedy(8))
    print(format_step(engine.step(), 1))
    """,
    """md:
    ### The hash chain

    After its prefill the first request's full blocks are registered in the block manager's
    `cached_blocks` (hash -> block id). Each hash covers the parent's hash and the block's tokens,
    so the fourth hash stands for all 16 system-prompt tokens, not only the four of its block. The
    fifth block already holds question tokens; its hash is this request's alone.
    """,
    """
    seq = engine.requests[first]
    parent = None
    for i, block_hash in enumerate(seq.block_hashes):
        tokens = tuple(seq.token_ids[4 * i:4 * i + 4])
        assert hash_block(parent, tokens) == block_hash                   # the chain, recomputed
        assert manager.cached_blocks[block_hash] == seq.block_table[i]    # and findable
        print(f"block {seq.block_table[i]}: tokens {tokens}  hash(parent, tokens) = {block_hash:#x}")
        parent = block_hash
    """,
    """md:
    ### Three more requests with the same system prompt

    They find the first four blocks in the cache: `find_cached_prefix` walks their hash chain and
    stops at the first miss (block 5 holds the question, different for each). Their block tables
    start with the same four blocks, whose `ref_cnt` becomes 4 (bold in the picture), and they only
    prefill their questions: the step below runs each of them from position 16, next to the first
    request's decode.
    """,
    """
    others = [engine.add_request(prompt, greedy(8)) for prompt in PROMPTS[1:]]
    result = engine.step()
    print(format_step(result, 2))
    shared = seq.block_table[:4]
    for request_id in others:
        assert engine.requests[request_id].block_table[:4] == shared
        assert engine.requests[request_id].num_cached_tokens == 16
    assert [manager.blocks[b].ref_cnt for b in shared] == [4, 4, 4, 4]
    print("\\nshared blocks", shared, "ref_cnt", [manager.blocks[b].ref_cnt for b in shared])
    plot_block_map(manager, engine).set_title("four requests share the system prompt's blocks")
    plt.show()
    """,
    """md:
    ### Hit rate and the prefill tokens it saved

    `RequestOutput.num_cached_tokens` says how many prompt tokens each request took from the cache.
    The same requests served with `enable_prefix_caching=False` compute every prompt token, and
    produce the same tokens: a cache hit only skips work.
    """,
    """
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
    """,
    """md:
    Had the four requests arrived in the same step, none would have hit: blocks enter the cache only
    once their KV is computed, at the end of the step that computes them.
    """,
    """
    together, _ = serve(PROMPTS, arrive_first=False)
    print("cached tokens per request, all arriving together:", [o.num_cached_tokens for o in together])
    assert sum(o.num_cached_tokens for o in together) == 0
    """,
    """md:
    ## Part 2: a cache too small for the load

    Four requests of 6 prompt tokens, each generating 10: each grows to 15 tokens of KV, 4 blocks of
    4 slots, 16 blocks in all. The cache has 8 (`num_kvcache_blocks=9`, block 0 being the null block).
    All four are admitted, since their prompts fit; when the oldest needs a new block and none is free,
    the scheduler preempts the newest running request: frees its blocks and puts it back at the front
    of the waiting queue, its tokens kept. Step by step:
    """,
    """
    PROMPTS2 = [[rng.randrange(3, vocab_size) for _ in range(6)] for _ in range(4)]

    def serve_all(num_kvcache_blocks: int, show: bool) -> tuple[object, dict]:
        engine = LLM(MODEL, block_size=4, num_kvcache_blocks=num_kvcache_blocks, max_model_len=32).engine
        for prompt in PROMPTS2:
            engine.add_request(prompt, greedy(10))
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
            if show and step == 4:
                plot_block_map(scheduler.block_manager, engine).set_title("step 4: requests 2 and 3 preempted")
        return engine, outputs

    history = []  # (scheduled, num_preemptions) of every step
    small, small_outputs = serve_all(num_kvcache_blocks=9, show=True)
    plt.show()
    assert history[3] == ([("0", 1), ("1", 1)], 2)  # step 4: requests 3 and 2 preempted
    assert ([("2", 9), ("3", 9)], 2) in history      # their recompute: prompt + 3 tokens generated
    """,
    """md:
    In step 4 requests 0 and 1 each need a third block. None is free, so request 3 (the newest) is
    preempted, then request 2: both go back to `waiting`, their blocks to the free queue. Requests 0
    and 1 run to the end; then 2 and 3 come back, each recomputing its prompt and the tokens it had
    already generated in one prefill (`2:9`, `3:9`), and carry on decoding.

    The picture shows one more thing: blocks 5 and 6, request 2's full blocks, are free but still
    cached. Had they survived until request 2 came back, its recompute would have been a prefix-cache
    hit; here requests 0 and 1 need them in step 8, which evicts them.

    Nothing is lost: the outputs equal those of a run with room for everyone.
    """,
    """
    roomy, roomy_outputs = serve_all(num_kvcache_blocks=64, show=False)
    assert small_outputs["2"].num_cached_tokens == 0  # blocks 5 and 6 were evicted before it came back
    assert small.scheduler.num_preemptions > 0 and roomy.scheduler.num_preemptions == 0
    assert all(len(o.token_ids) == 10 for o in small_outputs.values())
    assert {r: o.token_ids for r, o in small_outputs.items()} == {r: o.token_ids for r, o in roomy_outputs.items()}
    assert small.scheduler.block_manager.num_free_blocks == 8
    print(f"{small.scheduler.num_preemptions} preemptions; all {len(small_outputs)} requests finished; "
          "outputs equal to the roomy run's")
    """,
    """md:
    Preemption by recompute trades compute for memory: the preempted requests' prompts ran twice.
    vLLM can also swap KV out to CPU memory instead; recompute is simpler and, for short sequences,
    often as fast.
    """,
)

ROOFLINE = notebook(
    """md:
    # 04 · The roofline: why decode wants a batch

    Section 3 of the walkthrough in numbers. For a piece of work:

    - $\\pi$: the machine's peak compute, FLOP/s; $\\beta$: its memory bandwidth, bytes/s;
    - $\\pi_t$: the work's FLOPs; $\\beta_t$: the bytes it must move;
    - $T = \\max(T_{cal}, T_{load}) = \\max(\\pi_t / \\pi,\\; \\beta_t / \\beta)$: computing and loading overlap.

    The work is **memory-bound** when its arithmetic intensity $\\pi_t / \\beta_t$ is below the
    machine's ridge point $\\pi / \\beta$, **compute-bound** above it.

    For a transformer step the FLOPs are about 2 per weight per token, while the weights are read
    once per step however many tokens share it. A decode step of a batch of $B$ requests runs $B$
    tokens; a prefill step of a $T$-token prompt runs $T$. In float32 (4 bytes per weight) the
    intensity is about $B/2$ or $T/2$ FLOP/byte: a prefill is compute-bound, a lone decode is
    memory-bound, and batching decodes is what moves them towards the ridge.

    This notebook measures $\\pi$ and $\\beta$ on this machine, computes each engine step's FLOPs and
    bytes from its `Batch`, times real engine steps, and puts them on the roofline.
    """,
    """
    import random
    import tempfile
    import time

    import matplotlib.pyplot as plt
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from nanoserve import LLM, SamplingParams

    # One core: the measurements stay steady on a shared or busy machine. More cores raise both roofs.
    torch.set_num_threads(1)
    """,
    """md:
    ## The model

    The roofline needs weights larger than the CPU's caches, or "memory" bandwidth would really be
    cache bandwidth. The bundled tiny model (if any) fits in a large L3 cache, so this notebook builds a
    random Llama of about 32M parameters (~130 MB in float32). Random weights are fine: speed does
    not depend on their values.
    """,
    """
    torch.manual_seed(0)
    MODEL = tempfile.mkdtemp()
    LlamaForCausalLM(LlamaConfig(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                                 intermediate_size=1408, vocab_size=8192, max_position_embeddings=1024)).save_pretrained(MODEL)
    engine = LLM(MODEL, block_size=16, max_num_seqs=256, max_num_batched_tokens=4096, num_kvcache_blocks=600,
                 max_model_len=512, enable_prefix_caching=False).engine
    model = engine.model_runner.model
    config = model.config
    BYTES = engine.model_runner.dtype.itemsize
    # Weights every step reads whole: each layer's projections, and lm_head (the embedding is only
    # gathered, one row per token).
    layer_params = sum(p.numel() for name, p in model.named_parameters() if "layers." in name)
    lm_head_params = model.lm_head.weight.numel()
    kv_bytes_per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * BYTES  # K and V, all layers
    print(f"layers {layer_params / 1e6:.1f}M params, lm_head {lm_head_params / 1e6:.1f}M, "
          f"{(layer_params + lm_head_params) * BYTES / 1e6:.0f} MB read per step; KV {kv_bytes_per_token} bytes/token")
    """,
    """md:
    ## FLOPs and bytes of one step, from its `Batch`

    Everything the count needs is in the batch: `N` tokens run through every layer's matmuls, only the
    `logits_indices` rows go through `lm_head`, and each token attends over its request's context
    (`seq_lens`). Activations are left out of the bytes: at these sizes they are small next to the
    weights.
    """,
    """
    def step_cost(batch) -> tuple[float, float]:
        # (FLOPs, bytes) of one engine step.
        num_tokens = batch.input_ids.numel()
        query_lens = (batch.query_start_loc[1:] - batch.query_start_loc[:-1]).double()
        seq_lens = batch.seq_lens.double()
        # Causal attention: the j-th of q new tokens of a request sees seq_len - q + j + 1 keys.
        num_scores = (query_lens * seq_lens - query_lens * (query_lens - 1) / 2).sum().item()
        attention = 2 * 2 * model.num_layers * config.num_attention_heads * model.head_dim * num_scores  # QK^T and PV
        flops = 2 * num_tokens * layer_params + 2 * batch.logits_indices.numel() * lm_head_params + attention
        weights = (layer_params + lm_head_params) * BYTES
        kv = seq_lens.sum().item() * kv_bytes_per_token  # read every cached K, V (this step's are written too)
        return flops, weights + kv
    """,
    """md:
    ## This machine's roofs: peak FLOP/s and memory bandwidth

    A large float32 matmul for $\\pi$, a copy of a 256 MB tensor (read and write) for $\\beta$; best of a
    few runs each, a couple of seconds in all.
    """,
    """
    def best_time(fn, repeats: int = 5) -> float:
        fn()  # warm up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    n = 1024
    a, b = torch.randn(n, n), torch.randn(n, n)
    PEAK = 2 * n ** 3 / best_time(lambda: torch.mm(a, b), 10)
    src = torch.ones(64 * 2 ** 20)  # 256 MB
    dst = torch.empty_like(src)
    BANDWIDTH = 2 * src.numel() * 4 / best_time(lambda: dst.copy_(src))
    RIDGE = PEAK / BANDWIDTH
    print(f"peak {PEAK / 1e9:.0f} GFLOP/s, bandwidth {BANDWIDTH / 1e9:.1f} GB/s, ridge point {RIDGE:.1f} FLOP/byte")
    """,
    """md:
    ## Timing real engine steps

    Decode steps: `B` requests with 8-token prompts are prefilled, then the next steps are pure decodes
    of `B` tokens; the fastest of three is kept. Prefill steps: one prompt of `T` tokens.
    """,
    """
    rng = random.Random(0)

    def random_prompt(length: int) -> list[int]:
        return [rng.randrange(3, config.vocab_size) for _ in range(length)]

    decode = {}  # batch size -> (seconds, flops, bytes)
    for B in [1, 2, 4, 8, 16, 32, 64, 128, 256]:
        for _ in range(B):
            engine.add_request(random_prompt(8), SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
        engine.step()  # the prefill
        engine.step()  # one decode to warm up
        timings = []
        for _ in range(3):
            start = time.perf_counter()
            result = engine.step()
            timings.append((time.perf_counter() - start, *step_cost(result.batch)))
            assert result.num_decode_tokens == B and result.num_prefill_tokens == 0
        decode[B] = min(timings)
        while engine.has_unfinished_requests():
            engine.step()

    prefill = {}  # prompt length -> (seconds, flops, bytes)
    for T in [32, 128, 512]:
        engine.add_request(random_prompt(T), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        start = time.perf_counter()
        result = engine.step()
        prefill[T] = (time.perf_counter() - start, *step_cost(result.batch))
        assert result.num_prefill_tokens == T

    print(f"{'step':>14} {'FLOP/byte':>10} {'ms':>8} {'GFLOP/s':>8} {'tokens/s':>9}  bound by")
    for label, tokens, (seconds, flops, nbytes) in ([(f"decode B={B}", B, v) for B, v in decode.items()]
                                                   + [(f"prefill T={T}", T, v) for T, v in prefill.items()]):
        bound = "memory" if flops / nbytes < RIDGE else "compute"
        print(f"{label:>14} {flops / nbytes:10.1f} {seconds * 1000:8.1f} {flops / seconds / 1e9:8.1f} "
              f"{tokens / seconds:9.0f}  {bound}")
    """,
    """md:
    ## The roofline

    The roof is $\\min(\\pi,\\; \\beta \\cdot I)$: the best FLOP/s any work of intensity $I$ can reach.
    Each point is a measured step, at the intensity its batch gives it. Left of the ridge, a step is
    paid for by bytes: adding requests to a decode step adds FLOPs almost for free. Right of it, a step
    is paid for by FLOPs, and more tokens per step no longer help.

    The measured steps sit below the roof: a real step also pays costs the roofline does not model
    (Python scheduling, many small kernels, attention over gathered KV blocks), and a matrix-vector
    product rarely streams memory as fast as a plain copy. The shape is what the roofline predicts:
    achieved FLOP/s climbs with the batch, then flattens near the compute roof.
    """,
    """
    intensities = [2 ** (k / 4) for k in range(-8, 44)]
    fig, ax = plt.subplots(figsize=(8, 5))
    ax.loglog(intensities, [min(PEAK, BANDWIDTH * i) for i in intensities], color="black", label="roofline: min(π, β·I)")
    ax.axvline(RIDGE, color="gray", linestyle=":", label=f"ridge π/β = {RIDGE:.1f} FLOP/byte")
    for points, marker, name in ((decode, "o", "decode, batch B"), (prefill, "s", "prefill, prompt T")):
        xs = [flops / nbytes for _, flops, nbytes in points.values()]
        ys = [flops / seconds for seconds, flops, _ in points.values()]
        ax.loglog(xs, ys, marker, label=f"{name} (measured)")
        for size, x, y in zip(points, xs, ys):
            ax.annotate(str(size), (x, y), textcoords="offset points", xytext=(4, -10), fontsize=8)
    ax.set(xlabel="arithmetic intensity (FLOP/byte)", ylabel="FLOP/s", title="engine steps on this machine's roofline")
    ax.legend(loc="lower right")
    plt.show()
    """,
    """md:
    ## Decode step time and throughput as the batch grows

    The roofline's prediction for a step is $T = \\max(\\pi_t / \\pi,\\; \\beta_t / \\beta)$. While loading
    the weights dominates (left of the ridge), a step of a few requests costs little more than a step
    of one, so tokens per second grow almost linearly with the batch; past the ridge the step time
    grows with the batch and throughput levels off. The measured steps also carry the fixed costs
    named above, which is why they sit above the predicted time.
    """,
    """
    sizes = list(decode)
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    axes[0].loglog(sizes, [decode[B][0] * 1000 for B in sizes], "o-", label="measured")
    axes[0].loglog(sizes, [1000 * decode[B][2] / BANDWIDTH for B in sizes], "--", label="load time β_t/β")
    axes[0].loglog(sizes, [1000 * decode[B][1] / PEAK for B in sizes], "--", label="compute time π_t/π")
    axes[0].set(xlabel="decode batch size B", ylabel="ms per step", title="decode step time")
    axes[0].legend()
    axes[1].semilogx(sizes, [B / decode[B][0] for B in sizes], "o-", label="measured")
    axes[1].semilogx(sizes, [B / max(decode[B][1] / PEAK, decode[B][2] / BANDWIDTH) for B in sizes], "--",
                     label="roofline bound")
    axes[1].set(xlabel="decode batch size B", ylabel="tokens / s", title="decode throughput")
    axes[1].legend()
    plt.show()

    crossing = next((B for B in sizes if decode[B][1] / decode[B][2] >= RIDGE), None)
    print(f"decode steps reach the ridge ({RIDGE:.1f} FLOP/byte) at batch size {crossing} on this machine")
    speedup = (sizes[-1] / decode[sizes[-1]][0]) / (1 / decode[1][0])
    print(f"decode throughput at B={sizes[-1]} is {speedup:.0f}x that at B=1")
    assert all(decode[a][1] / decode[a][2] < decode[b][1] / decode[b][2] for a, b in zip(sizes, sizes[1:]))
    assert speedup > 2  # batching decodes pays, whatever the machine
    """,
    """md:
    ## What this means for serving

    - A decode step's intensity is about $B$ FLOPs per 2 bytes of float32 weight here (about $B$ per
      byte in bfloat16): one request alone leaves most of the compute idle. That is why continuous
      batching keeps as many decodes in every step as memory allows, and why the KV cache's size,
      which bounds how many requests can run at once, bounds throughput.
    - A CPU core's ridge sits at a few FLOP/byte (this one's is printed above), so decode turns
      compute-bound after a batch of a few requests (the printed crossing). A datacenter GPU has roughly a hundred times more compute
      but only tens of times more bandwidth (around 1000 TFLOP/s of bfloat16 against 3-5 TB/s): its
      ridge is a few hundred FLOP/byte, so decode stays memory-bound up to batches of hundreds.
    - A prefill of a few hundred tokens is compute-bound on either: chunked prefill mixes prompt chunks
      with decodes so that every step does useful FLOPs while it reads the weights once.
    """,
)

NOTEBOOKS = {
    "01_walkthrough.ipynb": WALKTHROUGH,
    "02_static_vs_continuous.ipynb": STATIC_VS_CONTINUOUS,
    "03_prefix_caching_and_preemption.ipynb": PREFIX_CACHING_AND_PREEMPTION,
    "04_roofline.ipynb": ROOFLINE,
}

if __name__ == "__main__":
    for name, nb in NOTEBOOKS.items():
        nbformat.validate(nb)
        nbformat.write(nb, HERE / name)
        print("wrote", HERE / name)
