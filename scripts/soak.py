"""Memory over a long run: the server's RSS per 1,000 mixed requests (plain completions and chats, grammars, tools).

    PYTHONPATH=. python scripts/soak.py [--requests 10000] [--minutes 30] [--threads 4] [--every 1000] [--kinds ...]

Starts `python -m nanoserve.serve` on the bundled model, on 127.0.0.1 (a free port), in a child process, so the RSS
read (/proc/PID/status) is the server's alone; its grammar worker processes are read beside it. The requests, sent
from --threads threads, cycle through a mix: completions and chats, whole and streamed; JSON schemas, regexes,
choices and EBNF grammars, each drawn from 400 variants (more than the grammar cache's 256 entries, so it fills and
evicts as a real server's does); tools under "auto", "required" and a named function. Stops after --requests or
--minutes, whichever comes first, and prints one row per --every requests: requests so far, seconds, the server's
RSS, its workers' RSS, and the answers that were wrong. Hostile requests are in the mix too (HOSTILE): streams the
client drops after a first chunk, requests it gives up on after 50 ms, bodies past 8 MiB (413), bad schemas (400).
At the end it checks /metrics: nothing running or waiting, no KV block in use, and each request the engine saw
counted once as finished. docs/serving.md shows the figures.
"""
import argparse
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

import nanoserve

TEMPLATE = (  # the tools by name, past calls as hermes writes them: short, for the bundled model's context
    "{{ bos_token }}{% if tools %}<|tools|>{% for t in tools %}{{ t.function.name }};{% endfor %}</s>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}")
VARIANTS = 400
KINDS = ["plain", "chat", "json", "regex", "choice", "grammar", "auto", "required", "named"]
HOSTILE = {  # kind: the statuses it may get. "gone" streams are dropped after a first chunk. The client gives up
    # on "timeout" ones after 50 ms (None), unless they finish first (200).
    "gone": (200,), "timeout": (None, 200), "oversized": (413,), "bad_schema": (400,)}


def tools(k: int) -> list[dict]:
    weather = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 4 + k % 20},
                                                "days": {"type": "integer", "minimum": 1, "maximum": 7}},
               "required": ["city", "days"]}
    return [{"type": "function", "function": {"name": "get_weather", "parameters": weather}},
            {"type": "function", "function": {"name": "get_time", "parameters": {
                "type": "object", "properties": {"zone": {"enum": ["GMT", "CET", f"Z{k}"]}}}}}]


def request(kind: str, i: int, rng: random.Random) -> tuple[str, dict]:
    """The i-th request, of one kind of the mix: (path, body)."""
    k = rng.randrange(VARIANTS)  # which variant of a grammar or a tool set
    chat = dict(messages=[{"role": "user", "content": f"Tell me about Bath, {i}."}], max_tokens=12)
    kinds = {
        "plain": ("/v1/completions", dict(prompt=f"It is a truth universally acknowledged {i}", max_tokens=16)),
        "chat": ("/v1/chat/completions", chat),
        "json": ("/v1/completions", dict(prompt="Emma", max_tokens=12, structured_outputs={"json": {
            "type": "object", "properties": {"n": {"type": "integer", "maximum": k}}, "required": ["n"]}})),
        "regex": ("/v1/completions", dict(prompt="Emma", max_tokens=12,
                                          structured_outputs={"regex": f"[a-z]{{1,{k + 2}}}"})),
        "choice": ("/v1/completions", dict(prompt="Emma", max_tokens=4,
                                           structured_outputs={"choice": [f"yes{k}", f"no{k}"]})),
        "grammar": ("/v1/completions", dict(prompt="Emma", max_tokens=8,
                                            structured_outputs={"grammar": f'root ::= "a" [b-z]{{0,{k % 50 + 1}}}'})),
        "auto": ("/v1/chat/completions", chat | dict(tools=tools(k), tool_choice="auto")),
        "required": ("/v1/chat/completions", chat | dict(tools=tools(k), tool_choice="required", max_tokens=40)),
        "named": ("/v1/chat/completions", chat | dict(tools=tools(k), max_tokens=30, tool_choice={
            "type": "function", "function": {"name": "get_weather"}})),
        "gone": ("/v1/completions", dict(prompt=f"Emma {i}", max_tokens=200, stream=True)),
        "timeout": ("/v1/completions", dict(prompt=f"Emma {i}", max_tokens=200, stream=False)),
        "oversized": ("/v1/completions", dict(prompt="a" * (8 * 2**20 + k))),  # past the 8 MiB body limit
        "bad_schema": ("/v1/completions", dict(prompt="Emma", structured_outputs={"json": {"type": f"no-type-{k}"}})),
    }
    path, body = kinds[kind]
    return path, {"model": "soak", "temperature": 0.8, "stream": rng.random() < 0.3, **body}


def send(client: httpx.Client, url: str, kind: str, path: str, body: dict) -> int | None:
    """The answer's status: None for a request the client left (the server must abort it)."""
    if kind == "timeout":
        try:
            return client.post(url + path, json=body, timeout=0.05).status_code
        except httpx.TimeoutException:
            return None
    if not body["stream"]:
        return client.post(url + path, json=body).status_code
    with client.stream("POST", url + path, json=body) as reply:
        if kind == "gone":
            next(reply.iter_bytes(), None)
            return reply.status_code  # leaving the block closes the connection mid-stream
        text = "".join(reply.iter_text())
    return 500 if reply.status_code == 200 and '"error"' in text else reply.status_code  # an error mid-stream


def rss_mb(pid: int) -> float:
    """VmRSS of a process, in MB (0 once it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0.0
    return int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024


def children(pid: int) -> list[int]:
    """The process's descendants (the grammar workers and what they start)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(child) for child in (task / "children").read_text().split()]
        except OSError:
            pass
    return found + [grandchild for child in found for grandchild in children(child)]


def start_server(log: Path) -> tuple[subprocess.Popen, str]:
    command = [sys.executable, "-m", "nanoserve.serve", nanoserve.DEFAULT_MODEL, "--host", "127.0.0.1", "--port", "0",
               "--device", "cpu", "--served-model-name", "soak", "--chat-template", TEMPLATE,
               "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log.open("w"))
    deadline = time.time() + 300
    while time.time() < deadline:
        if found := re.search(r"serving .* at (http://\S+)", log.read_text()):
            return server, found.group(1)
        if server.poll() is not None:
            raise RuntimeError(f"the server exited: {log.read_text()[-2000:]}")
        time.sleep(0.2)
    raise RuntimeError("the server did not start in 300 s")


def read_metrics(url: str) -> dict[str, float]:
    """/metrics as {name: value}, a counter's labelled children summed."""
    found: dict[str, float] = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            name = name.split("{")[0]
            found[name] = found.get(name, 0.0) + float(value)
    return found


def check_metrics(url: str, num_answered: int, num_left: int) -> None:
    """Once the engine is idle: no request running or waiting, and every KV block free. Each request added
    finished once. Finished ones are those answered, and at most num_left more (the client gave up on them)."""
    deadline = time.time() + 60
    while (metrics := read_metrics(url))["vllm:num_requests_running"] + metrics["vllm:num_requests_waiting"]:
        if time.time() > deadline:
            break
        time.sleep(1)
    checks = {"running": metrics["vllm:num_requests_running"] == 0,
              "waiting": metrics["vllm:num_requests_waiting"] == 0,
              "KV blocks in use": metrics["vllm:kv_cache_usage_perc"] == 0,
              "added <= finished": metrics["nanoserve:requests_added_total"] <= metrics["vllm:request_success_total"],
              "finished - answered in [0, left]":
                  0 <= metrics["vllm:request_success_total"] - num_answered <= num_left}
    print(f"/metrics: added {metrics['nanoserve:requests_added_total']:.0f}, finished "
          f"{metrics['vllm:request_success_total']:.0f}, answered {num_answered}, left {num_left}, KV usage "
          f"{metrics['vllm:kv_cache_usage_perc']}, free blocks {metrics['nanoserve:num_free_blocks']:.0f}", flush=True)
    print("/metrics consistent" if all(checks.values()) else
          f"/metrics INCONSISTENT: {[name for name, ok in checks.items() if not ok]}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--every", type=int, default=1000)
    mix = ",".join(KINDS + list(HOSTILE))
    parser.add_argument("--kinds", default=mix, help=f"the mix, taken in turn (default: {mix})")
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    log = Path(tempfile.mkdtemp(prefix="soak-")) / "server.log"
    server, url = start_server(log)
    lock, state = threading.Lock(), dict(sent=0, failed=0, answered=0, left=0)
    wrong: dict[tuple[str, int | None], int] = {}  # (kind, status): how many
    start, deadline = time.perf_counter(), time.perf_counter() + 60 * args.minutes
    print(f"{'requests':>9} {'seconds':>8} {'server MB':>10} {'workers MB':>11} {'wrong':>8}", flush=True)
    print(f"{0:>9} {0:>8.0f} {rss_mb(server.pid):>10.0f} {sum(map(rss_mb, children(server.pid))):>11.0f} {0:>8}",
          flush=True)

    def run(thread: int) -> None:
        rng = random.Random(thread)
        with httpx.Client(timeout=120) as client:
            while time.perf_counter() < deadline:
                with lock:
                    if state["sent"] >= args.requests:
                        return
                    i = state["sent"]
                    state["sent"] += 1
                kind = kinds[i % len(kinds)]
                status = send(client, url, kind, *request(kind, i, rng))
                with lock:
                    if status not in HOSTILE.get(kind, (200,)):
                        state["failed"] += 1
                        wrong[kind, status] = wrong.get((kind, status), 0) + 1
                    state["answered"] += status == 200  # a dropped stream too: it had its first chunk
                    state["left"] += status is None  # left before its answer: it may never have been added
                    if (i + 1) % args.every == 0:  # (a row per --every requests sent, read as they finish)
                        print(f"{i + 1:>9} {time.perf_counter() - start:>8.0f} {rss_mb(server.pid):>10.0f} "
                              f"{sum(map(rss_mb, children(server.pid))):>11.0f} {state['failed']:>8}", flush=True)
    try:
        threads = [threading.Thread(target=run, args=(t,)) for t in range(args.threads)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if wrong:
            print("wrong answers (kind, status): " + ", ".join(f"{k} x{n}" for k, n in sorted(wrong.items(), key=str)))
        check_metrics(url, state["answered"], state["left"])
    finally:
        server.terminate()
        server.wait(30)
    print(f"server log: {log}")


if __name__ == "__main__":
    main()
