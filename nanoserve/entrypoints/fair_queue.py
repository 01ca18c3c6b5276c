"""The requests an AsyncLLM has been given but not yet handed to the engine, taken in turns across clients.

The engine loop hands the engine only what its next step could run (engine_loop.py). The rest wait here.
A client is what `Submit.turn` says. That is the server's client key (serving_engine.client_key), else the
request's stream. The client key is the API key where the server takes several, else the peer address.

Invariant: a request id is in `stream_of` iff it is in exactly one of `streams`' FIFOs, and no FIFO in
`streams` is empty.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, Protocol, TypeVar


class Queued(Protocol):
    """What the queue reads of a request it holds (engine_loop.py's Submit): its id and whose turn it takes."""
    request_id: str

    @property
    def turn(self) -> Hashable: ...


Submit = TypeVar("Submit", bound=Queued)


class FairQueue(Generic[Submit]):
    """Requests submitted but not yet handed to the engine: one FIFO per client (`Submit.turn`).

    They are taken round-robin across clients. The engine's own waiting queue is first come, first served.
    Handing it a 1,000 x n=128 fan-out at once would put 128,000 requests before the next client's one.
    Taking turns, that client waits for one request of each other stream at most. Every operation is O(1)
    (ordered dicts), so a storm of aborts costs microseconds each."""

    def __init__(self) -> None:
        self.streams: OrderedDict[Hashable, OrderedDict[str, Submit]] = OrderedDict()  # per client, in turn order
        self.stream_of: dict[str, Hashable] = {}  # request id -> its client

    def __len__(self) -> int:
        return len(self.stream_of)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.stream_of

    def add(self, submit: Submit) -> None:
        """A client new to the queue takes its turn after the clients already there."""
        self.streams.setdefault(submit.turn, OrderedDict())[submit.request_id] = submit
        self.stream_of[submit.request_id] = submit.turn

    def remove(self, request_id: str) -> Submit:
        client = self.stream_of.pop(request_id)
        requests = self.streams[client]
        submit = requests.pop(request_id)
        if not requests:
            del self.streams[client]
        return submit

    def next_client(self) -> Hashable:
        return next(iter(self.streams))

    def pass_turn(self) -> None:
        """The client whose turn it is lets the others go first (it holds its share of the engine)."""
        self.streams.move_to_end(self.next_client())

    def pop_next(self) -> Submit:
        """The oldest request of the client whose turn it is; that client's next turn comes after every other's."""
        client, requests = next(iter(self.streams.items()))
        _, submit = requests.popitem(last=False)
        del self.stream_of[submit.request_id]
        if requests:
            self.streams.move_to_end(client)
        else:
            del self.streams[client]
        return submit

    def take_all(self) -> list[Submit]:
        submits = [submit for requests in self.streams.values() for submit in requests.values()]
        self.streams.clear()
        self.stream_of.clear()
        return submits
