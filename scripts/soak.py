"""Memory over a long run: the server's RSS per 1,000 mixed requests (plain completions and chats, grammars, tools).

    PYTHONPATH=. python scripts/soak.py [--requests 10000] [--minutes 30] [--threads 4] [--every 1000] [--kinds ...]

Starts `python -m nanoserve.serve` on the bundled model, on 127.0.0.1 (a free port), in a child process, so the RSS
read (/proc/PID/status) is the server's alone; its grammar worker processes are read beside it. The requests, sent
from --threads threads, cycle through a mix: completions and chats, whole and streamed; JSON schemas, regexes,
choices and EBNF grammars, each drawn from 400 variants (more than the grammar cache's 256 entries, so it fills and
evicts as a real server's does); tools under "auto", "required" and a named function. Stops after --requests or
--minutes, whichever comes first, and prints one row per --every requests: requests so far, seconds, the server's
RSS, its workers' RSS, and the answers that were not 200. docs/serving.md shows the figures.
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
    }
    path, body = kinds[kind]
    return path, {**body, "model": "soak", "temperature": 0.8, "stream": rng.random() < 0.3}


def send(client: httpx.Client, url: str, path: str, body: dict) -> int:
    if not body["stream"]:
        return client.post(url + path, json=body).status_code
    with client.stream("POST", url + path, json=body) as reply:
        text = "".join(reply.iter_text())
    return 500 if '"error"' in text else reply.status_code


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=10_000)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--every", type=int, default=1000)
    parser.add_argument("--kinds", default=",".join(KINDS), help=f"the mix, taken in turn (default: {','.join(KINDS)})")
    args = parser.parse_args()
    kinds = args.kinds.split(",")
    log = Path(tempfile.mkdtemp(prefix="soak-")) / "server.log"
    server, url = start_server(log)
    lock, state = threading.Lock(), dict(sent=0, failed=0)
    start, deadline = time.perf_counter(), time.perf_counter() + 60 * args.minutes
    print(f"{'requests':>9} {'seconds':>8} {'server MB':>10} {'workers MB':>11} {'not 200':>8}", flush=True)
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
                status = send(client, url, *request(kinds[i % len(kinds)], i, rng))
                with lock:
                    state["failed"] += status != 200
                    if (i + 1) % args.every == 0:  # (a row per --every requests sent, read as they finish)
                        print(f"{i + 1:>9} {time.perf_counter() - start:>8.0f} {rss_mb(server.pid):>10.0f} "
                              f"{sum(map(rss_mb, children(server.pid))):>11.0f} {state['failed']:>8}", flush=True)
    try:
        threads = [threading.Thread(target=run, args=(t,)) for t in range(args.threads)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        server.terminate()
        server.wait(30)
    print(f"server log: {log}")


if __name__ == "__main__":
    main()
