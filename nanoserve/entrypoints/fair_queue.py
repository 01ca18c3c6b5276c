"""The requests an AsyncLLM has been given but not yet handed to the engine, taken in turns across
streams (async_llm.py: the engine loop hands the engine only what its next step could run).

Invariant: a request id is in `stream_of` iff it is in exactly one of `streams`' FIFOs, and no FIFO in
`streams` is empty.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # types only: async_llm.py imports this module
    from nanoserve.entrypoints.async_llm import ReplyQueue, Submit


class FairQueue:
    """Requests submitted but not yet handed to the engine: one FIFO per stream (a server's HTTP
    request), taken round-robin across streams. The engine's own waiting queue is first come, first
    served, so handing it a 1,000 x n=128 fan-out at once would put 128,000 requests before the next
    client's one; taking turns, that client waits for one request of each other stream at most.
    Every operation is O(1) (ordered dicts), so a storm of aborts costs microseconds each."""

    def __init__(self) -> None:
        self.streams: OrderedDict[ReplyQueue, OrderedDict[str, Submit]] = OrderedDict()  # in turn order
        self.stream_of: dict[str, ReplyQueue] = {}  # request id -> its stream (its ReplyQueue)

    def __len__(self) -> int:
        return len(self.stream_of)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.stream_of

    def add(self, submit: Submit) -> None:
        """A stream new to the queue takes its turn after the streams already there."""
        self.streams.setdefault(submit.replies, OrderedDict())[submit.request_id] = submit
        self.stream_of[submit.request_id] = submit.replies

    def remove(self, request_id: str) -> Submit:
        replies = self.stream_of.pop(request_id)
        requests = self.streams[replies]
        submit = requests.pop(request_id)
        if not requests:
            del self.streams[replies]
        return submit

    def pop_next(self) -> Submit:
        """The oldest request of the stream whose turn it is; that stream's next turn comes after every other's."""
        replies, requests = next(iter(self.streams.items()))
        _, submit = requests.popitem(last=False)
        del self.stream_of[submit.request_id]
        if requests:
            self.streams.move_to_end(replies)
        else:
            del self.streams[replies]
        return submit

    def take_all(self) -> list[Submit]:
        submits = [submit for requests in self.streams.values() for submit in requests.values()]
        self.streams.clear()
        self.stream_of.clear()
        return submits
