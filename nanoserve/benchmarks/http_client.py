"""The online load over HTTP. `run_http` sends `run_online`'s Poisson arrivals (online.py) to a
running OpenAI-compatible server, one thread per request. `stream_completion` times one streamed
completion's SSE chunks as the client sees them: TTFT, and the gaps between chunks (ITL).
No engine runs in this process. Only what the server sends back is measured."""
from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from nanoserve.benchmarks.online import poisson_arrivals
from nanoserve.benchmarks.workload import Request, percentile

if TYPE_CHECKING:
    import httpx


@dataclass
class Stream:
    """One streamed completion as the client saw it."""
    ttft: float | None    # seconds from its scheduled arrival to the first chunk with text
    itl: list[float]      # seconds between successive chunks with text
    output_tokens: int    # the server's usage count (chunks with text, if it sends no usage)


def stream_completion(client: httpx.Client, model: str, request: Request, arrival: float) -> Stream:
    """POST one request with `stream: true` and time its SSE chunks against `arrival` (perf_counter)."""
    body = dict(model=model, prompt=request.prompt, max_tokens=request.output_len, temperature=0,
                ignore_eos=True, stream=True, stream_options=dict(include_usage=True))
    stamps, usage = [], None
    with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue  # blank lines and ": keep-alive" comments carry no tokens
            chunk = json.loads(line[len("data: "):])
            usage = chunk.get("usage") or usage
            if any(choice.get("text") for choice in chunk["choices"]):
                stamps.append(time.perf_counter())
    return Stream(stamps[0] - arrival if stamps else None, [b - a for a, b in zip(stamps, stamps[1:])],
                  usage["completion_tokens"] if usage else len(stamps))


def run_http(url: str, workload: list[Request], rates: list[float], seed: int, api_key: str | None) -> str:
    """`run_online`'s Poisson load sent to a running OpenAI-compatible server, one thread per request."""
    import httpx  # not one of nanoserve's dependencies: only this mode needs it
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    lines = ["| rate (req/s) | TTFT p50 / p99 (s) | ITL p50 / p99 (ms) | output tok/s | seconds |",
             "|---|---|---|---|---|"]
    with httpx.Client(base_url=url, headers=headers, timeout=600, limits=httpx.Limits(max_connections=None)) as client:
        model = client.get("/v1/models").raise_for_status().json()["data"][0]["id"]
        stream_completion(client, model, Request(workload[0].prompt, 2), time.perf_counter())  # warm-up
        for rate in rates:
            arrivals, start = poisson_arrivals(len(workload), rate, seed), time.perf_counter()

            def send(i: int, start: float = start, arrivals: list[float] = arrivals) -> Stream:
                time.sleep(max(0.0, start + arrivals[i] - time.perf_counter()))
                return stream_completion(client, model, workload[i], start + arrivals[i])

            with ThreadPoolExecutor(len(workload)) as pool:
                streams = list(pool.map(send, range(len(workload))))
            seconds = time.perf_counter() - start
            ttft = [s.ttft for s in streams if s.ttft is not None]
            itl = [gap for s in streams for gap in s.itl]
            lines.append(f"| {rate:g} | {percentile(ttft, 50):.2f} / {percentile(ttft, 99):.2f} | "
                         f"{1000 * percentile(itl, 50):.1f} / {1000 * percentile(itl, 99):.1f} | "
                         f"{sum(s.output_tokens for s in streams) / seconds:.0f} | {seconds:.1f} |")
    return "\n".join(lines)

