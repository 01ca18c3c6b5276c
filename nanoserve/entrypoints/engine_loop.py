"""The engine thread of AsyncLLM (async_llm.py), and the messages it trades with other threads.

async_llm.py's docstring draws the threads and queues. This file holds the thread's side of them.
`EngineLoop` owns the engine: no other thread calls it. Other threads send it messages through its
`inbox` (Submit, Abort, Stop). Each request's results go back through its stream's `ReplyQueue`.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass

from nanoserve.engine import LLMEngine
from nanoserve.entrypoints.fair_queue import FairQueue
from nanoserve.outputs import CompletionOutput, RequestDelta, RequestOutput, StepResult
from nanoserve.sampler import SamplingParams

logger = logging.getLogger(__name__)


class EngineGenerateError(Exception):
    """add_request or a step raised on the engine thread (a bug, a device failure).

    The requests concerned fail, and the loop serves the next ones. Bad input raises add_request's ValueError
    instead."""


class EngineDeadError(Exception):
    """The engine loop itself died: every request fails, now and later."""


class StatLogger:
    """What the engine thread tells a stat logger, as vLLM's stat loggers; this one records nothing.
    Every method is called on the engine thread."""

    def record_added(self, request_id: str, num_prompt_tokens: int, arrival_time: float) -> None:
        """add_request took the request."""

    def record_step(self, result: StepResult, start: float, end: float) -> None:
        """A step ran from `start` to `end` (time.perf_counter()); called before its results are sent."""

    def record_finished(self, output: RequestOutput) -> None:
        """Once per request, an aborted one too, before its output is sent."""

    def record_engine(self, stats: dict[str, int]) -> None:
        """engine.stats() after every step, when the engine goes idle, and once before it starts."""


# --- Messages between the threads ----------------------------------------------------------------

class ReplyQueue:
    """One RequestStream's replies: written from the engine thread, read on the reader's event loop.

    `on_finished(request_id)` runs on that loop as each request's final reply arrives, whether or not
    anyone reads it. The final reply is its RequestOutput or a Failed. A server frees the request's slot
    then."""

    def __init__(self, on_finished: Callable[[str], None] | None = None) -> None:
        self.loop, self.queue = asyncio.get_running_loop(), asyncio.Queue()
        self.on_finished = on_finished

    def put(self, reply: Reply) -> None:  # from any thread
        with contextlib.suppress(RuntimeError):  # the reader's event loop has closed: no one is left to read
            self.loop.call_soon_threadsafe(self.deliver, reply)

    def deliver(self, reply: Reply) -> None:  # on the reader's event loop
        self.queue.put_nowait(reply)
        if self.on_finished is not None and isinstance(reply, RequestOutput | Failed):
            self.on_finished(reply.request_id)

    async def get(self) -> Reply:
        return await self.queue.get()


@dataclass
class Submit:
    """Inbox message: add one engine request; its results go to `replies`."""
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    arrival_time: float        # time.perf_counter() when it arrived (an HTTP request's arrival): TTFT counts from it
    replies: ReplyQueue
    client: Hashable | None = None  # who sent it (a server's client key): turns and engine shares are per client

    @property
    def turn(self) -> Hashable:
        """Whose turn it takes in the FairQueue: its client's, else its stream's."""
        return self.replies if self.client is None else self.client


@dataclass
class Abort:
    """Inbox message: abort an engine request, if it has not finished."""
    request_id: str


class Stop:
    """Inbox message: shut down; the engine loop returns."""


@dataclass
class Accepted:
    """Reply: add_request took the request; its deltas follow."""
    request_id: str


@dataclass
class Failed:
    """Reply: the request failed.

    The error is add_request's ValueError, or an EngineGenerateError, or an EngineDeadError. A request that
    failed alone in a step (its grammar) gets a ValueError or an EngineGenerateError."""
    request_id: str
    error: Exception


Message = Submit | Abort | Stop
Reply = Accepted | Failed | RequestDelta | RequestOutput


# --- The engine thread ---------------------------------------------------------------------------

class EngineLoop:
    """The one thread that owns the engine. Its methods run on that thread, once `thread` started."""

    def __init__(self, engine: LLMEngine, stat_logger: StatLogger) -> None:
        self.engine, self.stat_logger = engine, stat_logger
        self.inbox: queue.Queue[Message] = queue.Queue()
        self.replies: dict[str, ReplyQueue] = {}  # unfinished engine requests -> where their results go
        self.pending: FairQueue[Submit] = FairQueue()  # submitted, not yet handed to the engine
        self.max_num_seqs = engine.config.max_num_seqs
        # The most engine slots (running or waiting) one client (Submit.client) may hold. The rest stay free
        # for the others' first tokens, whatever one client holds. A stream without a client has no such bound.
        self.max_client_share = self.max_num_seqs - self.max_num_seqs // 8
        self.client_of: dict[str, Hashable] = {}   # engine requests with a client -> it
        self.num_in_engine: Counter[Hashable] = Counter()  # per client, its requests in the engine
        self.error: BaseException | None = None    # why the loop died, if it did
        self.thread = threading.Thread(target=self.run, name="nanoserve-engine", daemon=True)

    def run(self) -> None:
        try:
            self.serve()
        except BaseException as error:  # a bug in this loop: say so everywhere, never hang
            logger.exception("the engine loop died: every request fails")
            self.error = error
            self.fail_all(EngineDeadError(f"the engine loop died: {error!r}"))
            for submit in self.pending.take_all():
                submit.replies.put(Failed(submit.request_id, EngineDeadError(f"the engine loop died: {error!r}")))
            self.refuse_until_stopped()

    def serve(self) -> None:
        while True:
            for message in self.take_messages():
                if isinstance(message, Stop):
                    return
                self.pending.add(message) if isinstance(message, Submit) else self.abort(message.request_id)
            self.admit()
            if self.engine.has_unfinished_requests():
                self.step()
            else:  # an abort may have emptied the engine: show its blocks free now
                self.stat_logger.record_engine(self.stats())

    def take_messages(self) -> list[Message]:
        """Idle: wait for a message. Busy: take only those already there, and step on."""
        busy = self.engine.has_unfinished_requests() or len(self.pending) > 0
        messages = [] if busy else [self.inbox.get()]
        while not self.inbox.empty():
            messages.append(self.inbox.get_nowait())
        return messages

    def admit(self) -> None:
        """Hand the engine pending requests, taking turns across streams.

        Hand only as many as its next step could run (max_num_seqs running or waiting). What waits, waits
        here, where the turns are fair. It does not wait in the engine's first-come-first-served queue."""
        stats = self.engine.stats()
        room = self.max_num_seqs - stats["num_running"] - stats["num_waiting"]
        num_passed = 0  # clients in a row that passed their turn, holding their share
        while room > 0 and len(self.pending) > 0 and num_passed < len(self.pending.streams):
            if self.num_in_engine[self.pending.next_client()] >= self.max_client_share:
                self.pending.pass_turn()
                num_passed += 1
                continue
            num_passed = 0
            if self.add(self.pending.pop_next()):
                room -= 1

    def add(self, submit: Submit) -> bool:
        """engine.add_request; False if it refused the request (which then has its Failed).

        The first request of a client that holds nothing in the engine goes to the front of its waiting
        queue. Else it waits behind the requests that another client's long prompts had preempted (they go
        back to the front), and they wait for blocks: a lone client waited 102.6 s for its first token
        beside one client's four 1,000-token requests (0.07 s alone)."""
        request_id = submit.request_id
        try:
            self.engine.add_request(submit.token_ids, submit.params, request_id, arrival_time=submit.arrival_time)
        except ValueError as error:  # bad input (InvalidRequest names the field): the caller's to report
            submit.replies.put(Failed(request_id, error))
            return False
        except Exception as error:  # a bug: this request fails, the loop and the others go on
            logger.exception("add_request failed")
            submit.replies.put(Failed(request_id, EngineGenerateError(f"the engine could not take the request: "
                                                                      f"{error!r}")))
            return False
        self.replies[request_id] = submit.replies
        if submit.client is not None:
            if self.num_in_engine[submit.client] == 0:  # a client that holds nothing goes first (see below)
                self.engine.scheduler.waiting.move_to_end(self.engine.requests[request_id], last=False)
            self.client_of[request_id] = submit.client
            self.num_in_engine[submit.client] += 1
        self.stat_logger.record_added(request_id, len(submit.token_ids), submit.arrival_time)
        submit.replies.put(Accepted(request_id))
        return True

    def abort(self, request_id: str) -> None:
        if request_id in self.pending:  # never handed to the engine: its output says so, at O(1) cost
            submit = self.pending.remove(request_id)
            output = self.never_run(submit)
            self.stat_logger.record_finished(output)
            submit.replies.put(output)
            return
        if request_id in self.engine.requests:  # it may have finished meanwhile
            output = self.engine.abort_request(request_id)
            self.stat_logger.record_finished(output)
            self.send(request_id, output)
        self.forget(request_id)  # the next step reports its output again: not sent twice

    def never_run(self, submit: Submit) -> RequestOutput:
        """The output of a request aborted before the engine took it: no tokens, finish_reason "abort"."""
        text = "" if self.engine.tokenizer is not None else None
        return RequestOutput(submit.request_id, None, submit.token_ids, [CompletionOutput(0, text, [], "abort")],
                             num_cached_tokens=0, ttft=None, latency=time.perf_counter() - submit.arrival_time)

    def stats(self) -> dict[str, int]:
        """engine.stats(), with the requests waiting here counted among the waiting."""
        stats = self.engine.stats()
        return {**stats, "num_waiting": stats["num_waiting"] + len(self.pending)}

    def step(self) -> None:
        start = time.perf_counter()
        try:
            result = self.engine.step()
        except Exception as error:  # a bug or a device failure: fail these requests, serve the next ones
            logger.exception("a step failed")
            self.fail_all(EngineGenerateError(f"the engine failed: {error!r}"))
            for request_id in list(self.engine.requests):
                self.abort(request_id)
            return
        self.stat_logger.record_step(result, start, time.perf_counter())
        for delta in result.deltas:
            self.send(delta.request_id, delta)
        for output in result.outputs:
            if output.request_id in self.replies:  # an abort this loop made was recorded then (and left replies)
                self.stat_logger.record_finished(output)
            self.send(output.request_id, output if output.error is None else Failed(output.request_id,
                                                                                  request_error(output.error)))
            self.forget(output.request_id)
        self.stat_logger.record_engine(self.stats())

    def forget(self, request_id: str) -> None:
        """A request's final reply is sent: it has no more replies, nor a slot of its client's share."""
        self.replies.pop(request_id, None)
        if (client := self.client_of.pop(request_id, None)) is not None:
            self.num_in_engine[client] -= 1
            if self.num_in_engine[client] == 0:
                del self.num_in_engine[client]

    def send(self, request_id: str, reply: Reply) -> None:
        if request_id in self.replies:
            self.replies[request_id].put(reply)

    def fail_all(self, error: Exception) -> None:
        for request_id, replies in list(self.replies.items()):
            replies.put(Failed(request_id, error))
            self.forget(request_id)

    def refuse_until_stopped(self) -> None:
        """After the loop died: refuse what still comes (a caller may have raced the death), until Stop."""
        while not isinstance(message := self.inbox.get(), Stop):
            if isinstance(message, Submit):
                message.replies.put(Failed(message.request_id, EngineDeadError("the engine loop has died")))


def request_error(error: Exception) -> Exception:
    """What a request that failed alone in the engine (finish_reason "error") raises for its reader.

    Its input's fault raises an InvalidRequest naming the field. Anything else raises an EngineGenerateError."""
    if isinstance(error, ValueError):
        return error
    return EngineGenerateError(f"the request failed: {error!r}")
