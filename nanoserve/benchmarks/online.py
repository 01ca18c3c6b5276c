"""Online serving in one process. Requests arrive as a Poisson process (`poisson_arrivals`) and join
the running engine. `run_online` does that for continuous and for static batching, at each request rate.
Each request's TTFT, TPOT and latency count from its arrival. `OnlineRun.goodput` counts the requests
per second that meet every SLO, as vLLM's `bench serve --goodput` does. `online_report` finds the rate
where each scheduler's goodput peaks."""
from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

from nanoserve import LLM, SamplingParams
from nanoserve.benchmarks.workload import WARM_UP, Request, percentile


def poisson_arrivals(num_requests: int, rate: float, seed: int) -> list[float]:
    """Seconds from the start at which each request arrives: exponential gaps at `rate` req/s."""
    rng, arrivals, t = random.Random(seed), [], 0.0
    for _ in range(num_requests):
        t += rng.expovariate(rate)
        arrivals.append(t)
    return arrivals


@dataclass
class OnlineRun:
    """One scheduler at one request rate: what each request saw, counted from its arrival."""
    scheduling: str
    rate: float
    ttft: list[float]     # seconds to the first token
    tpot: list[float]     # seconds per output token after the first: (latency - ttft) / (output tokens - 1)
    latency: list[float]  # seconds to the last token
    seconds: float        # from the first arrival to the last request's end

    def goodput(self, slo: dict[str, float]) -> float:
        """vLLM's `bench serve --goodput`: completed requests per second that meet every SLO.
        SLOs are in milliseconds, with keys ttft, tpot and e2el (the latency)."""
        measured = {"ttft": self.ttft, "tpot": self.tpot, "e2el": self.latency}
        good = sum(all(measured[key][i] * 1000 <= limit for key, limit in slo.items()) for i in range(len(self.ttft)))
        return good / self.seconds


def parse_slo(pair: str) -> tuple[str, float]:
    """"ttft:1000" -> ("ttft", 1000.0), as vLLM's --goodput takes it."""
    key, _, value = pair.partition(":")
    try:
        limit = float(value)
    except ValueError:
        limit = -1.0
    if key not in ("ttft", "tpot", "e2el") or limit < 0:
        raise argparse.ArgumentTypeError(f"{pair!r}: an SLO is ttft:MS, tpot:MS or e2el:MS, MS a number >= 0")
    return key, limit


def run_online(path: str, workload: list[Request], rates: list[float], seed: int, config: dict) -> list[OnlineRun]:
    """Requests arrive as a Poisson process at each rate and join the running engine.
    It runs each scheduler at each rate. TTFT and latency count from a request's arrival (`arrival_time`), even
    when it arrived during a step."""
    runs = []
    for scheduling in ("continuous", "static"):
        llm = LLM(path, scheduling=scheduling, **{"enable_prefix_caching": False, **config})
        llm.generate([WARM_UP], SamplingParams(max_tokens=2), use_tqdm=False)
        engine = llm.engine
        for rate in rates:
            arrivals = poisson_arrivals(len(workload), rate, seed)
            outputs, i, start = [], 0, time.perf_counter()
            while i < len(workload) or engine.has_unfinished_requests():
                now = time.perf_counter() - start
                while i < len(workload) and arrivals[i] <= now:  # every request that has arrived joins
                    r = workload[i]
                    engine.add_request(r.prompt, SamplingParams(temperature=r.temperature, max_tokens=r.output_len,
                                                                ignore_eos=True), arrival_time=start + arrivals[i])
                    i += 1
                if engine.has_unfinished_requests():
                    outputs += engine.step().outputs
                else:
                    time.sleep(max(0.0, arrivals[i] - now))
            runs.append(OnlineRun(scheduling, rate, [o.ttft for o in outputs],
                                  [(o.latency - o.ttft) / max(1, len(o.token_ids) - 1) for o in outputs],
                                  [o.latency for o in outputs], time.perf_counter() - start - arrivals[0]))
        llm.close()
    return runs


def online_report(runs: list[OnlineRun], slo: dict[str, float]) -> str:
    """The table, then where each scheduler's goodput peaks. Past that rate it saturates: requests queue
    and miss their SLOs. Last comes the ratio of the two at static batching's peak rate."""
    slos = ", ".join(f"{key} <= {limit:g} ms" for key, limit in slo.items())
    lines = ["| scheduling | rate (req/s) | TTFT p50 / p99 (s) | TPOT p50 / p99 (ms) "
             f"| goodput (req/s; {slos}) | seconds |", "|---|---|---|---|---|---|"]
    for r in runs:
        lines.append(f"| {r.scheduling} | {r.rate:g} | {percentile(r.ttft, 50):.2f} / {percentile(r.ttft, 99):.2f} | "
                     f"{1000 * percentile(r.tpot, 50):.1f} / {1000 * percentile(r.tpot, 99):.1f} | "
                     f"{r.goodput(slo):.2f} | {r.seconds:.1f} |")
    peaks, lines = {}, lines + [""]
    for scheduling in ("continuous", "static"):
        mine = [r for r in runs if r.scheduling == scheduling]
        peaks[scheduling] = max(mine, key=lambda r: (r.goodput(slo), -r.rate))  # the lowest rate of the best
        lines.append(f"{scheduling}: goodput peaks at {peaks[scheduling].goodput(slo):.2f} req/s, offered "
                     f"{peaks[scheduling].rate:g} req/s")
    at_static_peak = next(r for r in runs if r.scheduling == "continuous" and r.rate == peaks["static"].rate)
    static_goodput = peaks["static"].goodput(slo)
    ratio = f"{at_static_peak.goodput(slo) / static_goodput:.2f}x" if static_goodput else "inf (static meets no SLO)"
    lines.append(f"at {peaks['static'].rate:g} req/s, static batching's peak: continuous ÷ static goodput = {ratio}")
    return "\n".join(lines)

