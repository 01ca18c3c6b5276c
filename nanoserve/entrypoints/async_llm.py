"""The asyncio front end over one LLMEngine, as vLLM's AsyncLLM: usable from any event loop, no HTTP.

    async with AsyncLLM(LLMEngine(config)) as llm:
        async for output in llm.generate(prompt_token_ids, SamplingParams(max_tokens=8), "request-0"):
            ...  # a RequestDelta per step that sampled a token for it, then its RequestOutput

Threads and queues. The engine is not thread-safe (engine.py), so one thread owns it: `EngineLoop`
(engine_loop.py). Every other thread talks to it through its `inbox`. The inbox is a queue.Queue, and the
only way in:

    callers' event loops                               the engine thread (EngineLoop)
    --------------------                               ------------------------------
    RequestStream.submit  -- Submit --+                +-> FairQueue -> engine.add_request: Accepted | Failed
    abort, stream.close   -- Abort  --+--> inbox ------+-> engine.abort_request (or FairQueue.remove): its RequestOutput
    shutdown              -- Stop   --+                +-> return
                                                           engine.step(): RequestDeltas, RequestOutputs
    RequestStream <-- ReplyQueue (asyncio.Queue, written with call_soon_threadsafe) <--+

Between two steps the loop takes every message in the inbox. It hands the engine the submitted requests
that its next step could run (`admit`). Admission takes turns round-robin across clients, or across
streams where no client is given. So one client's 128,000 requests do not delay another's first token.
No client holds more than 7/8 of the engine's `max_num_seqs`, so another's first request always finds room.
Then the loop steps the engine. It sends each request's results to the ReplyQueue the request came with.
`Accepted` or `Failed` comes first, then its RequestDeltas, then its RequestOutput. A request that failed
alone gets a Failed instead of its RequestOutput (finish_reason "error", a grammar with no valid output).

Every submitted request gets exactly one final reply, its RequestOutput or a Failed, unless the loop is
stopped first. Idle, the loop blocks on the inbox. A stream may close before its requests finish: its
reader left (a client disconnected, a task was cancelled). It then sends an Abort, so their KV blocks are
free before the next step. A step that raises fails the requests it ran (EngineGenerateError). The loop
aborts them in the engine and serves the next ones. If the loop itself dies, every request fails at once
(EngineDeadError) instead of hanging, and `AsyncLLM.error` says why.

A `StatLogger` (the server's Prometheus metrics) hears on the engine thread of each request added, step
run and request finished. It hears before the request's reader does. The HTTP server adds handlers and a
tokenizer thread in front of this: see entrypoints/openai/api_server.py.
"""
from __future__ import annotations

import queue
import time
from collections.abc import AsyncIterator, Callable, Hashable

from nanoserve.engine import LLMEngine
from nanoserve.entrypoints.engine_loop import (
    Abort,
    Accepted,
    EngineDeadError,
    EngineGenerateError,
    EngineLoop,
    Failed,
    Message,
    Reply,
    ReplyQueue,
    StatLogger,
    Stop,
    Submit,
)
from nanoserve.outputs import RequestDelta, RequestOutput
from nanoserve.sampler import SamplingParams

# The errors a reader of AsyncLLM may catch, and the stat logger it may pass, live with the engine thread.
__all__ = ["AsyncLLM", "EngineDeadError", "EngineGenerateError", "RequestStream", "StatLogger"]


class RequestStream:
    """Engine requests submitted together and read back together, each result as it comes.

    A server's n choices of one HTTP request share one stream. It is made on the event loop that reads it.
    `close()`, however the reader ends, aborts the requests not finished. `on_finished`: see ReplyQueue."""

    def __init__(self, inbox: queue.Queue[Message], on_finished: Callable[[str], None] | None = None,
                 client: Hashable | None = None) -> None:
        self.inbox, self.replies, self.client = inbox, ReplyQueue(on_finished), client
        self.unfinished: set[str] = set()
        self.early: list[Reply] = []  # results that came in while submit awaited another's Accepted

    async def submit(self, requests: list[tuple[str, list[int], SamplingParams]],
                     arrival_time: float | None = None) -> None:
        """Hand every (request_id, prompt_token_ids, params) to the engine thread; raise the first refusal.

        Then wait until add_request has taken them all, or they were aborted first. arrival_time: now if None.
        The engine loop takes a stream's requests in turns with the other streams'. So a large submit waits
        here for its last requests' turns."""
        arrival_time = time.perf_counter() if arrival_time is None else arrival_time
        for request_id, token_ids, params in requests:
            self.unfinished.add(request_id)
            self.inbox.put(Submit(request_id, token_ids, params, arrival_time, self.replies, self.client))
        not_taken = {request_id for request_id, _, _ in requests}
        while not_taken:
            reply = await self.replies.get()
            if isinstance(reply, Failed):
                raise reply.error
            if isinstance(reply, Accepted | RequestOutput):  # an output: aborted before the engine took it
                not_taken.discard(reply.request_id)
            if not isinstance(reply, Accepted):
                self.early.append(reply)

    async def __aiter__(self) -> AsyncIterator[RequestDelta | RequestOutput]:
        """Each request's deltas, then its output, until every request has its output."""
        while self.unfinished:
            reply = self.early.pop(0) if self.early else await self.replies.get()
            if isinstance(reply, Failed):
                raise reply.error
            if isinstance(reply, RequestOutput):
                self.unfinished.discard(reply.request_id)
            yield reply

    def close(self) -> None:
        for request_id in self.unfinished:
            self.inbox.put(Abort(request_id))
        self.unfinished.clear()


class AsyncLLM:
    """generate() and abort() from asyncio, the engine stepping on its own thread.

    The thread runs between start() and shutdown(), or inside `async with`. The engine is the loop's alone
    once started."""

    def __init__(self, engine: LLMEngine, stat_logger: StatLogger | None = None) -> None:
        self.engine = engine
        self.engine_loop = EngineLoop(engine, stat_logger or StatLogger())
        self.engine_loop.stat_logger.record_engine(engine.stats())  # before the thread: a fresh server's free blocks

    @property
    def error(self) -> BaseException | None:
        """Why the engine loop died; None while it serves."""
        return self.engine_loop.error

    def start(self) -> None:
        self.engine_loop.thread.start()

    def shutdown(self) -> None:
        """Stop the engine loop after its current step (unfinished requests get no more results)."""
        self.engine_loop.inbox.put(Stop())
        self.engine_loop.thread.join()

    async def __aenter__(self) -> AsyncLLM:
        self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.shutdown()

    def stream(self, on_finished: Callable[[str], None] | None = None, client: Hashable | None = None) -> RequestStream:
        """An empty stream to submit requests to, and read them back from together.

        generate uses one per request. The server uses one per HTTP request, which is also its turn in the
        engine loop's FairQueue. `on_finished(request_id)` runs on this event loop as each request's final reply
        arrives, read or not. `client` is any hashable, such as a server's client key. Streams of one client
        share its turns and its engine share."""
        return RequestStream(self.engine_loop.inbox, on_finished, client)

    async def generate(self, prompt_token_ids: list[int], sampling_params: SamplingParams, request_id: str,
                       arrival_time: float | None = None) -> AsyncIterator[RequestDelta | RequestOutput]:
        """One request's RequestDeltas, then its RequestOutput (one completion: n must be 1).

        Bad input raises add_request's ValueError. A reader that stops early aborts the request when this
        generator is closed. That is at once inside contextlib.aclosing, else when it is garbage-collected."""
        stream = self.stream()
        try:
            await stream.submit([(request_id, prompt_token_ids, sampling_params)], arrival_time)
            async for output in stream:
                yield output
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Abort a request between two steps, from any thread; its stream ends with its RequestOutput
        (finish_reason "abort")."""
        self.engine_loop.inbox.put(Abort(request_id))
