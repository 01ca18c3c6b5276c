"""The tokenizer thread (nanoserve/entrypoints/tokenizer_thread.py) without a server: jobs taken in turns across
clients, results and exceptions handed back to the awaiting coroutine, a cancelled job skipped."""
import asyncio
import threading

import pytest

from nanoserve.entrypoints.tokenizer_thread import TokenizerThread


def test_a_lone_client_waits_for_one_job_per_client_not_for_a_backlog():
    """Client "hog" queues 8 jobs behind one that holds the thread; "lone" queues one after them all. Catches a
    first-come-first-served thread (a ThreadPoolExecutor): the lone client's job ran after all 8 of the hog's (a
    hostile client's 30 KB patterns made another's 1-token request wait 24.8 s)."""
    worker, order, gate = TokenizerThread(), [], threading.Event()

    async def scenario() -> None:
        def job(name: str):
            return lambda: order.append(name) or name
        blocker = asyncio.ensure_future(worker.run(lambda: gate.wait() and order.append("first"), "hog"))
        await asyncio.sleep(0.05)  # the thread is inside the blocking job
        hog = [asyncio.ensure_future(worker.run(job(f"hog{i}"), "hog")) for i in range(8)]
        await asyncio.sleep(0)
        lone = asyncio.ensure_future(worker.run(job("lone"), "lone"))
        await asyncio.sleep(0.05)
        gate.set()
        assert await lone == "lone"
        await asyncio.gather(blocker, *hog)
    asyncio.run(scenario())
    worker.shutdown()
    assert order.index("lone") <= 2, order  # after the blocking job and at most one more of the hog's


def test_results_exceptions_and_cancelled_jobs():
    """Catches an exception of the work lost (the handler waits forever) or raised in the thread (the thread
    dies, every later request hangs), and a job whose request was cancelled run anyway."""
    worker, ran, gate = TokenizerThread(), [], threading.Event()

    async def scenario() -> None:
        assert await worker.run(lambda: 2 + 3, "a") == 5
        with pytest.raises(ValueError):
            await worker.run(lambda: int("x"), "a")
        blocker = asyncio.ensure_future(worker.run(gate.wait, "a"))
        await asyncio.sleep(0.05)
        gone = asyncio.ensure_future(worker.run(lambda: ran.append("gone"), "b"))
        await asyncio.sleep(0)
        gone.cancel()
        gate.set()
        await blocker
        assert await worker.run(lambda: "still serving", "c") == "still serving"
    asyncio.run(scenario())
    worker.shutdown()
    assert ran == []
