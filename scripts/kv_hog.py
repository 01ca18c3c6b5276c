"""One client (127.0.0.2) sends 4 streamed requests of 1,000 prompt tokens and 300 generated, on SmolLM2 with
128 KV blocks of 16 slots: the cache holds one of them at a time. A lone client (127.0.0.3) sends a 4-token
request at 5, 15, 30, 45 and 60 s. Each time it prints the lone client's first token's time and what the
engine holds. Linux (any 127.x.y.z address is the loopback).

    PYTHONPATH=. python scripts/kv_hog.py SMOLLM2_FOLDER
"""
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from client_fairness import client_from, stream  # noqa: E402

from nanoserve import LLMEngine  # noqa: E402
from nanoserve.config import Config  # noqa: E402
from nanoserve.entrypoints.openai.api_server import ServerThread, build_app  # noqa: E402


async def measure(url: str, engine: LLMEngine) -> None:
    async with client_from("127.0.0.2") as hog_client, client_from("127.0.0.3") as lone_client:
        # distinct prompts, so the prefix cache shares nothing between them
        bodies = [dict(model="m", prompt=[(7 * i + 13 * r) % 40000 + 100 for i in range(1000)], max_tokens=300,
                       ignore_eos=True) for r in range(4)]
        hog = [asyncio.create_task(stream(hog_client, url, body, to_end=True)) for body in bodies]
        start = time.perf_counter()
        for at in (5, 15, 30, 45, 60):
            await asyncio.sleep(at - (time.perf_counter() - start))
            stats = engine.stats()  # read from this thread: for a print only
            lone = await stream(lone_client, url, dict(model="m", prompt="Emma", max_tokens=4))
            print(f"t={at} s: engine {stats['num_running']} running, {stats['num_waiting']} waiting; "
                  f"lone client's first token {lone:.2f} s", flush=True)
        for task in hog:
            task.cancel()


if __name__ == "__main__":
    engine = LLMEngine(Config.from_kwargs(sys.argv[1], device="cpu", num_kvcache_blocks=128, max_model_len=2032))
    server = ServerThread(build_app(engine, "m")).start()
    try:
        asyncio.run(measure(server.url, engine))
    finally:
        server.stop()
