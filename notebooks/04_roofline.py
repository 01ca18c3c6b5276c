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
# # 04 · The roofline: why decode wants a batch
#
# The roofline of [the walkthrough](../docs/walkthrough.md), in numbers. For a piece of work:
#
# - $\pi$: the machine's peak compute, FLOP/s; $\beta$: its memory bandwidth, bytes/s;
# - $\pi_t$: the work's FLOPs; $\beta_t$: the bytes it must move;
# - $T = \max(T_{cal}, T_{load}) = \max(\pi_t / \pi,\; \beta_t / \beta)$: computing and loading overlap.
#
# The work is **memory-bound** when its arithmetic intensity $\pi_t / \beta_t$ is below the
# machine's ridge point $\pi / \beta$, **compute-bound** above it.
#
# For a transformer step the FLOPs are about 2 per weight per token, while the weights are read
# once per step however many tokens share it. A decode step of a batch of $B$ requests runs $B$
# tokens; a prefill step of a $T$-token prompt runs $T$. In float32 (4 bytes per weight) the
# intensity is about $B/2$ or $T/2$ FLOP/byte: a prefill is compute-bound, a lone decode is
# memory-bound, and batching decodes is what moves them towards the ridge.
#
# This notebook measures $\pi$ and $\beta$ on this machine, computes each engine step's FLOPs and
# bytes from its `Batch`, times real engine steps, and puts them on the roofline.

# %%
import random
import tempfile
import time

import matplotlib.pyplot as plt
import torch
from transformers import AutoConfig

from nanoserve import LLM, SamplingParams
from nanoserve.benchmarks.workload import build_default_model

# One core: the measurements stay steady on a shared or busy machine. More cores raise both roofs.
torch.set_num_threads(1)

# %% [markdown]
# ## The model
#
# The roofline needs weights larger than the CPU's caches, or "memory" bandwidth would really be
# cache bandwidth. The bundled tiny model fits in a large L3 cache, so this notebook builds the
# benchmark's random Llama (`python -m nanoserve.bench`'s default: about 40M parameters, ~170 MB in
# float32), so that its numbers and docs/performance.md's tables describe the same model. Random
# weights are fine: speed does not depend on their values.

# %%
MODEL = build_default_model(tempfile.mkdtemp())
engine = LLM(MODEL, block_size=16, max_num_seqs=256, max_num_batched_tokens=4096, num_kvcache_blocks=600,
             max_model_len=512, enable_prefix_caching=False).engine
model = engine.model_runner.model
config = AutoConfig.from_pretrained(MODEL)  # the checkpoint's config.json
BYTES = engine.model_runner.dtype.itemsize
# Weights every step reads whole: each layer's projections, and lm_head (the embedding is only
# gathered, one row per token).
# (a CPU linear may hold its weight packed for oneDNN, as a buffer: `layers/linear.py`)
layer_params = sum(t.numel() for name, t in [*model.named_parameters(), *model.named_buffers()] if "layers." in name)
lm_head_params = model.model.embed_tokens.weight.numel()  # vocab x hidden, as lm_head
kv_bytes_per_token = 2 * model.num_layers * model.num_kv_heads * model.head_dim * BYTES  # K and V, all layers
print(f"layers {layer_params / 1e6:.1f}M params, lm_head {lm_head_params / 1e6:.1f}M, "
      f"{(layer_params + lm_head_params) * BYTES / 1e6:.0f} MB read per step; KV {kv_bytes_per_token} bytes/token")


# %% [markdown]
# ## FLOPs and bytes of one step, from its `Batch`
#
# Everything the count needs is in the batch: `N` tokens run through every layer's matmuls, only the
# `logits_indices` rows go through `lm_head`, and each token attends over its request's context
# (`seq_lens`). Activations are left out of the bytes: at these sizes they are small next to the
# weights.

# %%
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


# %% [markdown]
# ## This machine's roofs: peak FLOP/s and memory bandwidth
#
# A large float32 matmul for $\pi$, a copy of a 256 MB tensor (read and write) for $\beta$; best of a
# few runs each, a couple of seconds in all.

# %%
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

# %% [markdown]
# ## Timing real engine steps
#
# Decode steps: `B` requests with 8-token prompts are prefilled, then the next steps are pure decodes
# of `B` tokens; the fastest of three is kept. Prefill steps: one prompt of `T` tokens.

# %%
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

# %% [markdown]
# ## The roofline
#
# The roof is $\min(\pi,\; \beta \cdot I)$: the best FLOP/s any work of intensity $I$ can reach.
# Each point is a measured step, at the intensity its batch gives it. Left of the ridge, a step is
# paid for by bytes: adding requests to a decode step adds FLOPs almost for free. Right of it, a step
# is paid for by FLOPs, and more tokens per step no longer help.
#
# The measured steps sit below the roof: a real step also pays costs the roofline does not model
# (Python scheduling, many small kernels, attention over gathered KV blocks), and a matrix-vector
# product rarely streams memory as fast as a plain copy. The shape is what the roofline predicts:
# achieved FLOP/s climbs with the batch, then flattens near the compute roof.

# %%
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

# %% [markdown]
# ## Decode step time and throughput as the batch grows
#
# The roofline's prediction for a step is $T = \max(\pi_t / \pi,\; \beta_t / \beta)$. While loading
# the weights dominates (left of the ridge), a step of a few requests costs little more than a step
# of one, so tokens per second grow almost linearly with the batch; past the ridge the step time
# grows with the batch and throughput levels off. The measured steps also carry the fixed costs
# named above, which is why they sit above the predicted time.

# %%
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

# %% [markdown]
# ## What this means for serving
#
# - A decode step's intensity is about $B$ FLOPs per 2 bytes of float32 weight here (about $B$ per
#   byte in bfloat16): one request alone leaves most of the compute idle. That is why continuous
#   batching keeps as many decodes in every step as memory allows, and why the KV cache's size,
#   which bounds how many requests can run at once, bounds throughput.
# - A CPU core's ridge sits at a few FLOP/byte (this one's is printed above), so decode turns
#   compute-bound after a batch of a few requests (the printed crossing). A datacenter GPU has roughly
#   a hundred times more compute
#   but only tens of times more bandwidth (around 1000 TFLOP/s of bfloat16 against 3-5 TB/s): its
#   ridge is a few hundred FLOP/byte, so decode stays memory-bound up to batches of hundreds.
# - A prefill of a few hundred tokens is compute-bound on either: chunked prefill mixes prompt chunks
#   with decodes so that every step does useful FLOPs while it reads the weights once.
