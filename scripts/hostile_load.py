"""A bystander's time to first token while hostile fan-outs are queued, on the bundled model.

    python scripts/hostile_load.py [--hostile-requests 4] [--prompts 2] [--n 128] [--max-tokens 16]

Starts the server in this process on 127.0.0.1 (a free port), sends `--hostile-requests` requests of
`--prompts` prompts x `--n` completions each (by default 3 x 256: the largest fan-outs the default
limits take while leaving the bystander room among 1,024 in flight), and once the engine holds them a
bystander's streamed one-token request; prints the bystander's time to first token and the time the
hostile requests took. Run from a checkout (`PYTHONPATH=.`): the nanoserve it imports is the one
measured. docs/serving.md shows the figures.
"""
import argparse
import json
import threading
import time

import httpx

import nanoserve
from nanoserve import LLMEngine
from nanoserve.config import Config
from nanoserve.entrypoints.openai.api_server import ServerThread, build_app


def hostile(url: str, prompts: int, n: int, max_tokens: int, done: list[float]) -> None:
    body = dict(prompt=["It is a truth universally acknowledged"] * prompts, n=n, max_tokens=max_tokens,
                ignore_eos=True)
    reply = httpx.post(url + "/v1/completions", json=body, timeout=3600)
    assert reply.status_code == 200, reply.text[:300]
    done.append(time.perf_counter())


def first_token_seconds(url: str) -> float:
    body = dict(prompt="Elizabeth", max_tokens=1, stream=True)
    start = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=3600) as stream:
        if stream.status_code != 200:
            raise RuntimeError(f"the bystander got {stream.status_code}: {stream.read()[:300]!r}")
        for line in stream.iter_lines():
            if line.startswith("data: {"):
                assert "error" not in json.loads(line[6:]), line
                return time.perf_counter() - start
    raise RuntimeError("no token came")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hostile-requests", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--n", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    engine = LLMEngine(Config.from_kwargs(nanoserve.DEFAULT_MODEL, device="cpu"))
    server = ServerThread(build_app(engine, "tiny")).start()
    try:
        first_token_seconds(server.url)  # warm up
        start, done = time.perf_counter(), []
        threads = [threading.Thread(target=hostile, args=(server.url, args.prompts, args.n, args.max_tokens, done))
                   for _ in range(args.hostile_requests)]
        for thread in threads:
            thread.start()
        total = args.hostile_requests * args.prompts * args.n
        while engine.stats()["num_running"] == 0:  # the hostile requests are in (racy reads: monitoring only)
            time.sleep(0.01)
        ttft = first_token_seconds(server.url)
        for thread in threads:
            thread.join()
        print(f"{args.hostile_requests} hostile requests x {args.prompts} prompts x n={args.n} ({total} completions, "
              f"max_tokens {args.max_tokens}): bystander's first token {ttft:.2f} s; hostile requests done after "
              f"{max(done) - start:.2f} s")
    finally:
        server.stop()


if __name__ == "__main__":
    main()
