"""The tokenizer thread: the one thread where the server renders chat templates and tokenizes.

It also checks tools and grammar specs against their bounds. So neither the event loop nor the engine
thread waits on a long input.

Its jobs are taken in turns across clients (fair_queue.FairQueue), as the engine loop takes requests.
A client with many requests queued waits behind one job of each other client. So the other clients do
not wait behind all of its jobs. Each job's work is bounded by the server's limits. A request's texts are
bounded by max_request_prompt_bytes, its tools by MAX_TOOLS_BYTES, a grammar spec by the grammar bounds.
So a lone client's job waits for at most one bounded job per client ahead of it.
"""
from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, TypeVar

from nanoserve.entrypoints.fair_queue import FairQueue

T = TypeVar("T")


@dataclass(frozen=True)
class Job:
    request_id: str
    turn: Hashable                  # the client (serving_engine.client_key)
    work: Callable[[], Any]
    future: asyncio.Future          # the event loop's: settled there (`settle`)
    loop: asyncio.AbstractEventLoop


class TokenizerThread:
    """One daemon thread running jobs from a FairQueue; `run` awaits a job's result on the event loop."""

    def __init__(self, name: str = "nanoserve-tokenizer") -> None:
        self.queue: FairQueue[Job] = FairQueue()
        self.condition = threading.Condition()
        self.ids = itertools.count()
        self.closed = False
        self.thread = threading.Thread(target=self.loop, name=name, daemon=True)
        self.thread.start()

    async def run(self, work: Callable[[], T], client: Hashable = "") -> T:
        """work() in the tokenizer thread, in `client`'s turn; its exception is raised here."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self.condition:
            if self.closed:
                raise RuntimeError("the tokenizer thread has stopped")
            self.queue.add(Job(str(next(self.ids)), client, work, future, loop))
            self.condition.notify()
        return await future

    def loop(self) -> None:
        while (job := self.next_job()) is not None:
            if job.future.cancelled():  # its request gave up (the client left) before its turn came
                continue
            try:
                result, error = job.work(), None
            except Exception as exception:  # the handler's to raise (an APIError: a 400)
                result, error = None, exception
            try:
                job.loop.call_soon_threadsafe(settle, job.future, result, error)
            except RuntimeError:  # the event loop has closed: no one waits
                pass

    def next_job(self) -> Job | None:
        """The next client's oldest job, once there is one; None once stopped."""
        with self.condition:
            while not self.queue and not self.closed:
                self.condition.wait()
            return None if self.closed else self.queue.pop_next()

    def shutdown(self) -> None:
        with self.condition:
            self.closed = True
            self.condition.notify()


def settle(future: asyncio.Future, result: Any, error: Exception | None) -> None:
    """On the event loop: the job's outcome, unless its waiter was cancelled meanwhile."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
