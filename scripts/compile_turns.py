"""Client A (one API key) sends two 3 KB schemas at once: 60 `format: email` strings each, ~18 s to compile.
0.5 s later client B (another key) sends a 176-character schema. It prints B's time to its 200, five times.
Each try has new schemas, so none is cached. The bundled tiny model serves them. A first request starts
the workers (seconds), so no try pays for that.

    PYTHONPATH=. python scripts/compile_turns.py [SMALL_LANE_THREADS]

With 1 (the old small lane: one thread), B waits behind A's running compile.
"""
import asyncio
import json
import sys
import time

import httpx

from nanoserve import DEFAULT_MODEL, LLMEngine
from nanoserve.config import Config
from nanoserve.entrypoints.openai.api_server import ServerThread, build_app
from nanoserve.extensions import structured_outputs


def body(schema: dict) -> dict:
    return dict(model="m", prompt="Emma", max_tokens=8,
                response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})


def emails(prefix: str) -> dict:
    names = [f"{prefix}{i}" for i in range(60)]
    return {"type": "object", "properties": {name: {"type": "string", "format": "email"} for name in names},
            "required": names}


def small(n: int) -> dict:
    return {"type": "object", "properties": {"full_name": {"type": "string", "maxLength": 20 + n},
                                             "age": {"type": "integer", "minimum": 0, "maximum": 120}},
            "required": ["full_name", "age"]}


async def post(client: httpx.AsyncClient, url: str, key: str, schema: dict) -> tuple[int, float]:
    start = time.perf_counter()
    response = await client.post(url + "/v1/completions", json=body(schema),
                                 headers={"Authorization": f"Bearer {key}"}, timeout=120)
    return response.status_code, time.perf_counter() - start


async def measure(url: str) -> None:
    print(f"A's schemas: {len(json.dumps(emails('a0_')))} characters; B's: {len(json.dumps(small(0)))}")
    async with httpx.AsyncClient() as client:
        print(f"warm-up (the workers start): {await post(client, url, 'key-b', small(-1))}")
        for n in range(5):
            a = [asyncio.create_task(post(client, url, "key-a", emails(f"{side}{n}_"))) for side in "xy"]
            await asyncio.sleep(0.5)
            status, seconds = await post(client, url, "key-b", small(n))
            print(f"try {n + 1}: B got {status} in {seconds:.2f} s; A got {[(await t)[0] for t in a]}", flush=True)
            await asyncio.sleep(20)  # A's compile left running ends before the next try


if __name__ == "__main__":
    if len(sys.argv) > 1:
        structured_outputs.SMALL_LANE_THREADS = int(sys.argv[1])
    engine = LLMEngine(Config.from_kwargs(DEFAULT_MODEL, device="cpu"))
    server = ServerThread(build_app(engine, "m", api_key=["key-a", "key-b"])).start()
    try:
        asyncio.run(measure(server.url))
    finally:
        server.stop()
