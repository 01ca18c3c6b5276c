"""One client (the body's user "hog") holds 300 streams of 240 tokens, read to the end; then a lone client's
streamed request: prints its first token's time. The bundled model, the server's default settings.

    PYTHONPATH=. python scripts/client_fairness.py [HOG_USER]
"""
import asyncio
import json
import sys
import time

import httpx

import nanoserve
from nanoserve import LLMEngine
from nanoserve.config import Config
from nanoserve.entrypoints.openai.api_server import ServerThread, build_app


async def stream(client: httpx.AsyncClient, url: str, body: dict, to_end: bool = False) -> float | None:
    """Seconds to the stream's first text; read to the end if `to_end` (closing it early aborts it)."""
    start, first = time.perf_counter(), None
    async with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                first = time.perf_counter() - start
                if not to_end:
                    return first
    return first


async def measure(url: str, engine: LLMEngine, hog_user: str) -> None:
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=1000)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        body = dict(model="m", prompt="It is a truth", max_tokens=240, ignore_eos=True, user=hog_user)
        hog = [asyncio.create_task(stream(client, url, body, to_end=True)) for _ in range(300)]
        await asyncio.sleep(2)  # the hog's streams running
        stats = engine.stats()  # read from this thread: for a print only
        print(f"engine: {stats['num_running']} running, {stats['num_waiting']} waiting")
        lone = await stream(client, url, dict(model="m", prompt="Emma", max_tokens=4, user="lone"))
        print(f"lone client's first token: {lone:.2f} s")
        for task in hog:
            task.cancel()


if __name__ == "__main__":
    engine = LLMEngine(Config.from_kwargs(nanoserve.DEFAULT_MODEL, device="cpu"))
    server = ServerThread(build_app(engine, "m")).start()
    try:
        asyncio.run(measure(server.url, engine, sys.argv[1] if len(sys.argv) > 1 else "hog"))
    finally:
        server.stop()
