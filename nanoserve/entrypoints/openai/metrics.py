"""Prometheus metrics named after vLLM's, each with a model_name label, in the app's own registry.

`Metrics` is the server's stat logger (engine_loop.StatLogger). AsyncLLM's engine thread tells it of
each request added, step run and request finished. It hears before the request's handler does.
/metrics shows the registry. Times count from a request's arrival, the HTTP request's. So they include
its wait for the tokenizer and the engine thread. As vLLM:
- Time to first token is observed at the request's first token. So a running request's shows while it
  runs, and an aborted stream that got a token counts.
- e2e latency is only for requests that ran to the end. An aborted one's says when its client left.
- Queue time runs until the request is first scheduled, and its prompt tokens count from then.
  A request aborted while it waits was never served.
"""
from __future__ import annotations

import functools

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from nanoserve.entrypoints.engine_loop import StatLogger
from nanoserve.outputs import RequestOutput, StepResult


class Metrics(StatLogger):
    """The metrics, and what the engine thread tracks per unfinished request to observe them."""

    def __init__(self, model_name: str, num_usable_blocks: int) -> None:
        self.registry = CollectorRegistry()
        self.model_name, self.num_usable_blocks = model_name, num_usable_blocks
        gauge, counter, histogram = (functools.partial(self.labelled, kind) for kind in (Gauge, Counter, Histogram))
        seconds = functools.partial(histogram, buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 60))
        self.running = gauge("vllm:num_requests_running", "Requests running")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting in the engine")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "Share of the usable KV-cache blocks in use, 0-1")
        self.gpu_cache_usage = gauge("vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc's old name")
        self.free_blocks = gauge("nanoserve:num_free_blocks", "Free KV-cache blocks")
        self.preemptions = counter("vllm:num_preemptions", "Preemptions")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of requests scheduled")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens")
        self.prefix_cache_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.rejected = counter("nanoserve:requests_rejected", "Requests refused with 429: too many in flight")
        self.added = counter("nanoserve:requests_added", "Requests the engine took")
        self.ttft = seconds("vllm:time_to_first_token_seconds", "From arrival to the first token")
        self.itl = seconds("vllm:time_per_output_token_seconds", "Between two tokens of a request")
        self.e2e_latency = seconds("vllm:e2e_request_latency_seconds", "From arrival to finish")
        self.queue_time = seconds("vllm:request_queue_time_seconds", "From arrival to first scheduled")
        # Speculative decoding (spec_decode.py), as vLLM's: steps that verified drafts, draft tokens, accepted ones
        self.spec_counters = {name: counter(f"vllm:spec_decode_{name}", doc) for name, doc in (
            ("num_drafts", "Verifications of a request's drafts"), ("num_draft_tokens", "Draft tokens proposed"),
            ("num_accepted_tokens", "Draft tokens accepted"))}
        self.spec_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens by position",
                                    ["model_name", "position"], registry=self.registry)
        self.success = Counter("vllm:request_success", "Finished requests, by finish reason",
                               ["model_name", "finished_reason"], registry=self.registry)
        # Per unfinished request, on the engine thread only:
        self.unscheduled: dict[str, tuple[float, int]] = {}  # (arrival time, prompt tokens) until first scheduled
        self.no_token_yet: dict[str, float] = {}              # arrival time until the first token
        self.last_token_time: dict[str, float] = {}
        self.seen: dict = dict(num_preemptions=0, num_cached_tokens=0)  # engine.stats() when last read

    def labelled(self, kind: type, name: str, doc: str, **kwargs: object):  # -> the model_name child
        return kind(name, doc, ["model_name"], registry=self.registry, **kwargs).labels(self.model_name)

    def record_added(self, request_id: str, num_prompt_tokens: int, arrival_time: float) -> None:
        self.added.inc()
        self.unscheduled[request_id] = (arrival_time, num_prompt_tokens)
        self.no_token_yet[request_id] = arrival_time

    def record_step(self, result: StepResult, start: float, end: float) -> None:
        for request_id, _ in result.scheduled:
            if request_id in self.unscheduled:
                arrival_time, num_prompt_tokens = self.unscheduled.pop(request_id)
                self.queue_time.observe(start - arrival_time)
                self.prompt_tokens.inc(num_prompt_tokens)  # when scheduled: a prompt aborted before is not served
                self.prefix_cache_queries.inc(num_prompt_tokens)
        for delta in result.deltas:  # a delta carries the token its request sampled in this step
            request_id = delta.request_id
            self.generation_tokens.inc(len(delta.token_ids))
            if request_id in self.no_token_yet:
                self.ttft.observe(end - self.no_token_yet.pop(request_id))
            if request_id in self.last_token_time:
                self.itl.observe(end - self.last_token_time[request_id])
            self.last_token_time[request_id] = end

    def record_finished(self, output: RequestOutput) -> None:
        self.success.labels(self.model_name, output.finish_reason).inc()
        if output.finish_reason != "abort":  # an aborted request's latency says when its client left
            self.e2e_latency.observe(output.latency)
        for table in (self.unscheduled, self.no_token_yet, self.last_token_time):
            table.pop(output.request_id, None)

    def record_engine(self, stats: dict[str, int | list[int]]) -> None:
        usage = 1 - stats["num_free_blocks"] / self.num_usable_blocks
        self.running.set(stats["num_running"])
        self.waiting.set(stats["num_waiting"])
        self.free_blocks.set(stats["num_free_blocks"])
        self.kv_cache_usage.set(usage)
        self.gpu_cache_usage.set(usage)
        # The engine counts since it started; the counters add what is new since the last look.
        self.preemptions.inc(stats["num_preemptions"] - self.seen["num_preemptions"])
        self.prefix_cache_hits.inc(stats["num_cached_tokens"] - self.seen["num_cached_tokens"])
        for name, counter in self.spec_counters.items():  # with speculative decoding only
            counter.inc(stats.get(name, 0) - self.seen.get(name, 0))
        per_pos = stats.get("num_accepted_tokens_per_pos", [])
        seen_per_pos = self.seen.get("num_accepted_tokens_per_pos") or [0] * len(per_pos)
        for position, (num, seen) in enumerate(zip(per_pos, seen_per_pos)):
            self.spec_per_pos.labels(self.model_name, str(position)).inc(num - seen)
        self.seen = dict(stats)
