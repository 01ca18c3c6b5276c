"""One client (the address 127.0.0.2) holds 300 streams of 240 tokens, read to the end, each with a random
`user` and a random Bearer value (which make no new client: the server checks no key); then a lone client's
streamed request from 127.0.0.3: prints its first token's time and its status. The bundled model, the server's
default settings. Linux (any 127.x.y.z address is the loopback).

    PYTHONPATH=. python scripts/client_fairness.py
"""
import asyncio
import json
import secrets
import time

import httpx

import nanoserve
from nanoserve import LLMEngine
from nanoserve.config import Config
from nanoserve.entrypoints.openai.api_server import ServerThread, build_app


async def stream(client: httpx.AsyncClient, url: str, body: dict, to_end: bool = False,
                 headers: dict | None = None) -> float | None:
    """Seconds to the stream's first text; read to the end if `to_end` (closing it early aborts it)."""
    start, first = time.perf_counter(), None
    async with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"status {r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                first = time.perf_counter() - start
                if not to_end:
                    return first
    return first


def client_from(address: str) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    return httpx.AsyncClient(timeout=300, limits=limits, transport=httpx.AsyncHTTPTransport(local_address=address,
                                                                                            limits=limits))


async def measure(url: str, engine: LLMEngine) -> None:
    async with client_from("127.0.0.2") as hog_client, client_from("127.0.0.3") as lone_client:
        body = dict(model="m", prompt="It is a truth", max_tokens=240, ignore_eos=True)
        hog = [asyncio.create_task(stream(hog_client, url, {**body, "user": secrets.token_hex(8)}, to_end=True,
                                          headers={"Authorization": f"Bearer {secrets.token_hex(8)}"}))
               for _ in range(300)]
        await asyncio.sleep(2)  # the hog's streams running
        stats = engine.stats()  # read from this thread: for a print only
        print(f"engine: {stats['num_running']} running, {stats['num_waiting']} waiting")
        lone = await stream(lone_client, url, dict(model="m", prompt="Emma", max_tokens=4, user="lone"))
        print(f"lone client's first token: {lone:.2f} s (status 200)")
        for task in hog:
            task.cancel()


if __name__ == "__main__":
    engine = LLMEngine(Config.from_kwargs(nanoserve.DEFAULT_MODEL, device="cpu"))
    server = ServerThread(build_app(engine, "m")).start()
    try:
        asyncio.run(measure(server.url, engine))
    finally:
        server.stop()
