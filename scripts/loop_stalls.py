"""How long the server's event loop stalls under hostile requests, and what a kept-alive request costs.

    python scripts/loop_stalls.py [--model PATH] [--tree DIR]

Starts `python -m nanoserve.serve MODEL` on 127.0.0.1 (from --tree, default this checkout), then for
each attack below probes GET /health every 10 ms on its own connection while the attack runs: the
longest probe is how long the server answered no one (every stream and /health freeze with it: the
event loop busy, or another thread (engine, tokenizer) holding the GIL).
Last, the median of 20 kept-alive completions with max_tokens 1, against 20 each on a new connection.
Every loop is bounded; nothing listens past 127.0.0.1. The figures are in docs/serving.md.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx

import nanoserve

HEALTH_PERIOD = 0.01  # seconds between /health probes


def attacks() -> dict[str, tuple[str, dict]]:
    """name -> (path, body): the bodies that held the event loop for seconds."""
    many_logprobs = dict(prompt="Mr. Darcy", n=128, logprobs=20, max_tokens=64, temperature=1.0, ignore_eos=True)
    return {
        "n=128 x 64 tokens, logprobs 20": ("/v1/completions", many_logprobs),
        "/detokenize of 1.5M ids": ("/detokenize", dict(tokens=[5] * 1_500_000)),
        "/tokenize of 1 MB": ("/tokenize", dict(prompt="Mr. Darcy " * 100_000)),
        # n=0: refused once the body is read and checked, so that this measures reading it alone
        "200,000 prompts (then n=0)": ("/v1/completions", dict(prompt=[[5, 6]] * 200_000, max_tokens=1, n=0)),
    }


def start_server(model: str, tree: str) -> tuple[subprocess.Popen, str]:
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    process = subprocess.Popen([sys.executable, "-m", "nanoserve.serve", model, "--port", "0", "--device", "cpu"],
                               cwd=tree, stdout=subprocess.DEVNULL, stderr=log, env={**os.environ, "PYTHONPATH": tree})
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and process.poll() is None:
        if found := re.search(r"serving .* at (http://\S+)", open(log.name).read()):
            return process, found[1]
        time.sleep(0.2)
    process.kill()
    sys.exit(f"the server did not start:\n{open(log.name).read()}")


def longest_stall(url: str, path: str, body: dict) -> tuple[float, int, float]:
    """(the longest /health probe while the attack ran, the attack's status, the attack's seconds)."""
    done, probes = threading.Event(), []

    def probe() -> None:
        with httpx.Client(timeout=120) as client:
            while not done.is_set():
                start = time.perf_counter()
                client.get(url + "/health")
                probes.append(time.perf_counter() - start)
                time.sleep(HEALTH_PERIOD)
    prober = threading.Thread(target=probe)
    prober.start()
    time.sleep(0.2)  # a few probes before: the baseline
    content = json.dumps(body).encode()
    start = time.perf_counter()
    status = httpx.post(url + path, content=content, headers={"Content-Type": "application/json"},
                        timeout=300).status_code
    seconds = time.perf_counter() - start
    time.sleep(0.2)
    done.set()
    prober.join()
    return max(probes), status, seconds


def kept_alive_latency(url: str) -> tuple[float, float]:
    """Medians of 20 completions with max_tokens 1: on one kept-alive connection, each on a new one."""
    body = dict(prompt="Hi", max_tokens=1)

    def median_time(client: httpx.Client) -> float:
        times = []
        for _ in range(20):
            start = time.perf_counter()
            client.post(url + "/v1/completions", json=body)
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    with httpx.Client(timeout=60) as client:
        client.post(url + "/v1/completions", json=body)
        kept_alive = median_time(client)
    with httpx.Client(timeout=60, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        return kept_alive, median_time(client)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=nanoserve.DEFAULT_MODEL)
    parser.add_argument("--tree", default=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        help="the checkout whose nanoserve serves (to compare with another commit)")
    args = parser.parse_args()
    process, url = start_server(args.model, args.tree)
    try:
        for name, (path, body) in attacks().items():
            stall, status, seconds = longest_stall(url, path, body)
            print(f"{name:32} {status}  in {seconds:6.2f} s; longest /health: {stall * 1000:7.1f} ms", flush=True)
        kept_alive, new_connections = kept_alive_latency(url)
        print(f"completion, max_tokens 1: kept alive {kept_alive * 1000:.1f} ms, "
              f"new connections {new_connections * 1000:.1f} ms (medians of 20)")
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=30)


if __name__ == "__main__":
    main()
