"""The decode profile (`--profile-decode N`): where one decode step of N requests spends its time.
It sets attention against the rest, and gives the matmuls', SDPA's and the KV gather's shares."""
from __future__ import annotations

import random
import time
from collections import defaultdict

import torch

import nanoserve.engine
import nanoserve.model_runner
from nanoserve import LLM, SamplingParams


def profile_decode(path: str, num_requests: int, vocab_size: int, config: dict) -> str:
    """Where one decode step's time goes: `num_requests` requests past their prompts (100-200
    tokens each). Attention (writing K/V, gathering blocks, SDPA) is timed around every layer's call of
    the attention backend, over 5 steps. The median step is reported. Op shares come from torch.profiler
    on one more step. The host's share is everything but the forward: schedule, build_batch, sample and
    update. Each is timed over the same steps. The ops that Python called in one step are counted.
    The step's time outside them is Python's and the dispatcher's."""
    # room for all: each request reaches at most 232 tokens, 15 blocks of 16; the cache must also
    # hold one max_model_len request, so that is 256 here, not the model's (8192 for SmolLM2)
    config = config | dict(num_kvcache_blocks=num_requests * 18 + 1, max_model_len=256)
    engine = LLM(path, enable_prefix_caching=False, **config).engine
    rng = random.Random(0)
    for _ in range(num_requests):
        engine.add_request([rng.randrange(3, vocab_size) for _ in range(rng.randint(100, 200))],
                           SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    while engine.step().num_prefill_tokens:  # until every request decodes
        pass
    attention: list[float] = []
    backend = engine.model_runner.model.model.attention  # one backend, called by every layer
    forward = backend.forward

    def timed_forward(*args: object) -> torch.Tensor:
        start = time.perf_counter()
        out = forward(*args)
        attention.append(time.perf_counter() - start)
        return out
    if not engine.model_runner.compiled:  # replacing a compiled model's attention would recompile it
        backend.forward = timed_forward
    host: dict[str, float] = defaultdict(float)
    for owner, name in ((engine.scheduler, "schedule"), (nanoserve.engine, "build_batch"),
                        (nanoserve.model_runner, "sample"), (engine.scheduler, "update")):
        time_calls(owner, name, host)
    steps = []
    for _ in range(5):
        attention.clear()
        host.clear()
        start = time.perf_counter()
        engine.step()
        steps.append((time.perf_counter() - start, sum(attention), dict(host)))
    step, attend, host_times = sorted(steps, key=lambda s: s[0])[2]
    with torch.profiler.profile() as prof:
        start = time.perf_counter()
        engine.step()
        profiled = time.perf_counter() - start
    # the ops the step's Python called (not the ops inside them): their count, and their time against the
    # step's, the rest being Python (the model's, the engine's) and the dispatcher between them
    top = [e for e in prof.events() if e.cpu_parent is None]
    in_ops = sum(e.cpu_time_total for e in top) / 1e6
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    share = lambda *names: 100 * sum(e.self_cpu_time_total for e in events if e.key in names) / total  # noqa: E731
    return ("| dtype | requests | step (ms) | attention | matmuls | SDPA | index_select (KV gather) |\n"
            "|---|---|---|---|---|---|---|\n"
            f"| {config['dtype']} | {num_requests} | {1000 * step:.1f} | {100 * attend / step:.0f}% | "
            f"{share('aten::mm', 'aten::addmm', 'mkldnn::_linear_pointwise', 'aten::_weight_int8pack_mm'):.0f}% | "
            f"{share('aten::_scaled_dot_product_flash_attention_for_cpu'):.0f}% | "
            f"{share('aten::index_select'):.0f}% |\n\n"
            "| ops per step (called from Python) | time in them | Python and dispatch between them |\n"
            "|---|---|---|\n"
            f"| {len(top)} | {100 * in_ops / profiled:.0f}% | {100 * (1 - in_ops / profiled):.0f}% |\n\n"
            "| host, ms (share of the step) | schedule | build_batch | sample | update |\n"
            "|---|---|---|---|---|\n| " + f"{sum(host_times.values()) * 1000:.2f} "
            f"({100 * sum(host_times.values()) / step:.1f}%) | " +
            " | ".join(f"{1000 * host_times.get(name, 0.0):.2f}" for name in ("schedule", "build_batch", "sample")) +
            f" | {1000 * (host_times.get('update', 0.0)):.2f} |")


def time_calls(owner: object, name: str, into: dict[str, float]) -> None:
    """Add the time of every call of `owner.name` to `into[name]`, for the rest of the process."""
    function = getattr(owner, name)

    def timed(*args: object, **kwargs: object) -> object:
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            into[name] += time.perf_counter() - start
    setattr(owner, name, timed)

