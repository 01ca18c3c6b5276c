"""Structured outputs: a grammar the output must follow, enforced one token at a time by a mask over the
vocabulary, with xgrammar. The grammar is a JSON schema, a regex, a choice of strings, or an EBNF grammar.

A request's grammar goes through three stages (docs/structured-outputs.md):
1. add_request checks the spec's cheap bounds (grammar_bounds.py: size, nesting, stacked quantifiers).
   A spec past them is a ValueError naming structured_outputs there, before anything is queued.
2. A background thread has a child process parse it and compile it against the tokenizer's vocabulary
   (grammar_workers.py). Compiling finds, for each grammar state, which tokens may follow: the costly part.
   In a child, a spec that crashes xgrammar fails its own request only. Compiled grammars are cached by spec.
   The scheduler admits the request only once its grammar is compiled. Other requests run meanwhile.
   A spec the child refuses, crashes on or takes too long over fails its request. The error is an
   InvalidRequest naming structured_outputs.
3. Each step, `apply_grammar_masks` fills one bitmask row per constrained request from its matcher.
   The matcher is the grammar's state after the output so far. The logits of the tokens outside the mask
   become -inf. The sampled token then advances the matcher (`RequestGrammar.accept`, from
   Sequence.append_token). Either taking over STEP_SECONDS fails the request alone, since every stream
   in the step waits for it.

Invariant: a request's matcher has accepted exactly its output tokens. A preempted request keeps its
tokens and its matcher. Recomputing the prompt samples nothing, so the matcher is not advanced twice.
The grammar ends with the stop token (EOS). Once it is accepted, the matcher is terminated and the request
finishes with "stop".
"""
from __future__ import annotations

import json
import logging
import threading
from collections import Counter, OrderedDict, deque
from collections.abc import Collection
from concurrent.futures import FIRST_COMPLETED, CancelledError, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, fields
from functools import cached_property
from time import perf_counter
from typing import TYPE_CHECKING, Any, Callable

import torch

from nanoserve.extensions.grammar_bounds import MAX_BYTES, MAX_DEPTH, check_bounds, read_json, refuse
from nanoserve.extensions.grammar_workers import MEMORY_BYTES, GrammarWorker
from nanoserve.sampling_params import GrammarSpec, require

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from nanoserve.sequence import Sequence

CACHE_SIZE = 256  # compiled grammars kept, the least recently asked for dropped first,
CACHE_BYTES = 512 * 2**20  # and at most this many bytes of them (`compile_now` says how it counts them)
SMALL_SPEC_CHARS = 4096  # a spec this short compiles in a lane of its own, never queued behind a large one
# Compiles the small lane runs at once, each in its own thread and worker process, each for another client.
# A 3 KB schema of 60 `format: email` strings compiles in ~18 s. A 176-character one beside it must not wait.
SMALL_LANE_THREADS = 2
# One request's grammar work in one step: its mask, or its token's advance. It runs on the engine's thread, so every
# stream waits for it. Some grammars (`(([a-z ]*)*)*`) take longer at each token: 186 ms at the 50th. A normal
# grammar takes under a millisecond. Past this, the request fails alone (finish_reason "error").
STEP_SECONDS = 0.2


@dataclass(frozen=True)
class StructuredOutputsParams(GrammarSpec):
    """Exactly one of these, with vLLM's names:
    - `json`: a JSON schema (a dict, or its text);
    - `json_object=True`: any JSON object;
    - `regex`;
    - `choice`: one of these strings;
    - `grammar`: an EBNF grammar (xgrammar's, GBNF-like)."""
    json: dict | str | None = field(default=None, hash=False)
    regex: str | None = None
    choice: tuple[str, ...] | None = None  # a list is stored as a tuple
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        # given: anything but None (json={} is the schema of any JSON), and json_object only when True
        given = [option.name for option in fields(self) if getattr(self, option.name) not in (None, False)]
        require(len(given) == 1, "structured_outputs", given, "one of json, regex, choice, grammar, json_object")
        schema_text = isinstance(self.json, str) and isinstance(read_json(self.json), (dict, bool))
        require(self.json is None or isinstance(self.json, dict) or schema_text, "structured_outputs", self.json,
                "a json schema as a dict or a str of JSON")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            require(value is None or isinstance(value, str), "structured_outputs", value, f"a str {name}")
        if self.choice is not None:
            require(isinstance(self.choice, (list, tuple)) and all(isinstance(c, str) for c in self.choice),
                    "structured_outputs", self.choice, "a choice given as a list of strs")
            object.__setattr__(self, "choice", tuple(self.choice))

    @cached_property
    def key(self) -> str:
        """The spec as one string: the cache's key."""
        spec = read_json(self.json) if isinstance(self.json, str) else self.json  # valid JSON: __post_init__
        return json.dumps([spec, self.regex, self.choice, self.grammar, self.json_object], sort_keys=True)


class RequestGrammar:
    """One request's grammar. It is compiled in the background (`ready` once done). Then it is a matcher
    that has accepted exactly the request's output tokens."""

    def __init__(self, compiled: Future) -> None:
        self.compiled = compiled
        self.matcher = None  # xgrammar's GrammarMatcher, made at the first token: the compiled grammar is ready by then

    @property
    def ready(self) -> bool:
        """Compiled, so the request may run (the scheduler checks). A failed compile is never ready.
        (`poll` ends its request.)"""
        return self.compiled.done() and failure(self.compiled) is None

    def start(self) -> Any:
        if self.matcher is None:
            import xgrammar as xgr
            self.matcher = xgr.GrammarMatcher(self.compiled.result())
        return self.matcher

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Set bitmask's row to the tokens the grammar allows now. An InvalidRequest if it took over STEP_SECONDS
        (the row is filled anyway)."""
        started = perf_counter()
        self.start().fill_next_token_bitmask(bitmask, row)
        check_time(perf_counter() - started, "mask the next token")

    def accept(self, token: int) -> Exception | None:
        """Advance the matcher by token. Returns None, or the error that fails the request (never the step).
        The error is the grammar refusing a token its mask allowed, taking over STEP_SECONDS, or failing."""
        try:
            started = perf_counter()
            if not self.start().accept_token(token):
                return RuntimeError(f"structured_outputs: the grammar refused token {token}, which its mask allowed")
            check_time(perf_counter() - started, "accept a token")
        except Exception as error:  # a compile that failed (compiled.result() raises), a matcher that fails
            return error

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token accepted."""
        return self.matcher is not None and self.matcher.is_terminated()


@dataclass
class Lane:
    """Compile threads and the compiles queued for them, per client. A thread takes one compile per turn from
    each client in turn, so a client with many slow schemas queued delays another's by one compile at most.
    A client has at most one compile running. So with two threads, a second client's compile starts at once."""
    pool: ThreadPoolExecutor
    # client -> its (spec, future)s, oldest first. The client served last is moved to the end: its turn is last.
    queues: OrderedDict[str, deque] = field(default_factory=OrderedDict)
    running: set[str] = field(default_factory=set)  # the clients with a compile running


class GrammarCompiler:
    """An engine's grammars. They are bounded here (grammar_bounds.py), and parsed and compiled in child
    processes (grammar_workers.py) by background threads. They are cached by spec.

    Two threads are for small specs (SMALL_SPEC_CHARS), one for the rest. So a 1 ms regex never waits behind
    a 5,000-string enum, nor behind another client's slow small schema. Each lane takes its clients' compiles
    in turns (`Lane`). Each thread owns one worker process, started at its first grammar. A plain request
    never starts one.

    It is thread-safe. A server's handlers submit grammars too, and wait for the compile before the request
    reaches the engine (`submit(..., waiting=True)`, then `leave`). The engine's add_request then finds it
    compiled in the cache. A compile that every waiter left before it started is cancelled.

    `max_bytes` and `max_depth` are the bounds (a server sets its own). `memory_bytes` is each worker's limit
    on one compile (grammar_workers.py has its time limit)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int, eos_token_ids: set[int],
                 memory_bytes: int = MEMORY_BYTES) -> None:
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, sorted(eos_token_ids)
        self.max_bytes, self.max_depth, self.memory_bytes = MAX_BYTES, MAX_DEPTH, memory_bytes
        self.lane = Lane(ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar"))
        self.small_lane = Lane(ThreadPoolExecutor(SMALL_LANE_THREADS, thread_name_prefix="grammar-small"))
        self.tokenizer_info = None  # xgrammar's, made at the first compile (reading the vocabulary takes ~0.5 s)
        self.workers = {}  # a compile thread's name -> its GrammarWorker
        self.started = []  # the Futures of `start_workers`
        self.cache = OrderedDict()  # spec key -> the Future of its compile, the least recently asked for first
        self.waiters = Counter()  # spec key -> requests waiting for its compile (`submit`'s waiting)
        self.sizes = {}  # spec key -> bytes its compiled grammar holds (`compile_now`)
        self.lock = threading.RLock()  # over cache, waiters, tokenizer_info and workers: engine and server threads
        self.cache_bytes = CACHE_BYTES

    def compile(self, spec: StructuredOutputsParams) -> RequestGrammar:
        """A grammar for one request (its own matcher), compiling in the background unless cached."""
        return RequestGrammar(self.submit(spec))

    def poll(self, waiting: Collection[Sequence], idle: bool, fail: Callable[[Sequence, Exception], object]) -> None:
        """The grammar compiler seam's step (seams.py).

        Sometimes the step is `idle` (it scheduled nothing) and every waiting request's grammar is compiling.
        Then it waits until the first compile ends, but at most 0.1 s. So a long compile never keeps the
        engine's loop from new requests and aborts. Then it fails the waiting requests whose grammar failed
        to compile, each alone and logged. Those are never `ready`, so the scheduler never admits them."""
        with_grammar = [seq for seq in waiting if seq.grammar is not None]
        if idle and waiting and len(with_grammar) == len(waiting):  # returns at once if one compile has ended
            wait([seq.grammar.compiled for seq in with_grammar], 0.1, FIRST_COMPLETED)
        for seq in with_grammar:
            if error := failure(seq.grammar.compiled):
                logging.getLogger(__name__).error(f"grammar of request {seq.request_id!r} failed: {error!r}")
                fail(seq, error)

    def submit(self, spec: StructuredOutputsParams, waiting: bool = False, checked: bool = False,
               client: str = "") -> Future:
        """The compile of spec: cached, else queued now, in `client`'s turn. A failed one is tried again.

        A spec past the bounds is an InvalidRequest naming structured_outputs here, unless `checked` by
        `check` before. A spec the worker refuses is the future's exception. With `waiting`, a request waits
        for it until it calls `leave`."""
        if not checked:
            self.check(spec)
        key = spec.key
        with self.lock:
            future = self.cache.get(key)
            if future is None or failure(future) is not None:
                lane = self.small_lane if len(key) <= SMALL_SPEC_CHARS else self.lane
                future = self.cache[key] = Future()
                lane.queues.setdefault(client, deque()).append((spec, future))
                lane.pool.submit(self.take_turn, lane)  # one turn per compile queued
            self.cache.move_to_end(key)
            self.evict()  # sizes are known once compiled: each submit evicts for those done since the last
            if waiting:
                self.waiters[key] += 1
            return future  # the newest in the cache, so evict keeps it

    def take_turn(self, lane: Lane) -> None:
        """In a compile thread: the oldest compile of the client whose turn it is; that client then goes last.
        A client with a compile running waits. The thread takes compiles until none is left to take."""
        while True:
            with self.lock:
                client = next((name for name in lane.queues if name not in lane.running), None)
                if client is None:
                    return
                queue = lane.queues.pop(client)
                spec, future = queue.popleft()
                if queue:
                    lane.queues[client] = queue
                if not future.set_running_or_notify_cancel():  # cancelled: every waiter left (`leave`)
                    continue
                lane.running.add(client)
            try:
                future.set_result(self.compile_now(spec))
            except Exception as error:
                future.set_exception(error)
            with self.lock:
                lane.running.discard(client)

    def check(self, spec: StructuredOutputsParams) -> None:
        """Check the spec is within the bounds (grammar_bounds.py), else raise an InvalidRequest.
        Then make its key (memoized)."""
        if self.tokenizer is None:
            refuse("needs the model's tokenizer")
        check_bounds(vars(spec), self.max_bytes, self.max_depth)  # its fields by name
        spec.key  # noqa: B018 (made here, where it costs no one a wait)

    def leave(self, spec: StructuredOutputsParams) -> None:
        """A request that waited for spec's compile stopped waiting. It was compiled, or past its time budget,
        or its client left. A compile not yet started that no request waits for any more is cancelled.
        Without that, six clients that sent a huge schema and left kept the compile thread busy for 23 s.
        One already started is dropped once done. Its requests got their answer (a 400), so it must not
        hold the cache's memory."""
        key = spec.key
        with self.lock:
            self.waiters[key] -= 1
            if self.waiters[key] == 0:
                del self.waiters[key]
                future = self.cache.get(key)
                if future is not None and not future.done():
                    future.cancel()  # False once started: then it runs on, and is dropped once done
                    future.add_done_callback(lambda done: self.drop(key, done))  # at once if cancelled

    def drop(self, key: str, future: Future) -> None:
        """Drop a compile that every waiter left while it ran, unless a request asked for it since."""
        with self.lock:
            if key not in self.waiters and self.cache.get(key) is future:
                del self.cache[key]
                self.sizes.pop(key, None)

    def evict(self) -> None:
        """Drop the least recently asked for grammars past CACHE_SIZE, or past cache_bytes.
        cache_bytes counts the compiled ones' sizes: a 5,000-string enum takes ~75 MB.
        A request holding one keeps it until it ends."""
        num_bytes = sum(self.sizes.get(key, 0) for key in self.cache)
        while len(self.cache) > CACHE_SIZE or num_bytes > self.cache_bytes and len(self.cache) > 1:
            key, _ = self.cache.popitem(last=False)
            num_bytes -= self.sizes.pop(key, 0)

    def worker(self) -> GrammarWorker:
        """In a compile thread: its worker process. It is made at its first grammar. The process starts at
        its first job."""
        import xgrammar as xgr
        with self.lock:
            if self.tokenizer_info is None:
                self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                                         stop_token_ids=self.eos_token_ids)
            name = threading.current_thread().name
            if name not in self.workers:
                self.workers[name] = GrammarWorker(self.tokenizer_info.serialize_json(), self.memory_bytes)
            return self.workers[name]

    def start_workers(self) -> list[Future]:
        """Start each thread's worker process now (once), ahead of any compile.
        A server waits for these before a request's compile time budget starts. So no request's budget pays
        for a worker's start, which takes seconds. The barrier keeps each start in a thread of its own."""
        with self.lock:
            if not self.started:
                for lane, threads in ((self.small_lane, SMALL_LANE_THREADS), (self.lane, 1)):
                    barrier = threading.Barrier(threads)
                    self.started += [lane.pool.submit(lambda b=barrier: (b.wait(), self.worker().start()))
                                     for _ in range(threads)]
            return self.started

    def compile_now(self, spec: StructuredOutputsParams) -> Any:
        """In a compile thread: spec parsed and compiled by its worker process, read back against the vocabulary.
        Its size for the cache is its JSON's length: xgrammar's memory_size_bytes undercounts. A schema of 30
        `format: email` strings reported 1.4 MiB; each copy read back held 24 MiB, and its JSON was 24.6 MiB."""
        import xgrammar as xgr
        grammar_json = self.worker().run(spec)
        compiled = xgr.CompiledGrammar.deserialize_json(grammar_json, self.tokenizer_info)
        with self.lock:
            self.sizes[spec.key] = max(len(grammar_json), compiled.memory_size_bytes)
        return compiled

    def close(self) -> None:
        """Stop the worker processes (they also end when this process does)."""
        with self.lock:
            for worker in self.workers.values():
                worker.stop()


def check_time(seconds: float, what: str) -> None:
    """A grammar's work in one step took `seconds`: past STEP_SECONDS, an InvalidRequest that fails its request."""
    if seconds > STEP_SECONDS:
        refuse(f"took {seconds:.2f} s to {what}, over this server's limit of {STEP_SECONDS} s per token")


def failure(future: Future) -> BaseException | None:
    """A future's exception once done. It is CancelledError if it was cancelled (Future.exception would raise
    it). It is None while it runs, or once it succeeded."""
    if not future.done():
        return None
    return CancelledError() if future.cancelled() else future.exception()


def apply_grammar_masks(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Set -inf in logits [S, vocab], in place, on each constrained row's tokens that its grammar forbids now.

    One bitmask serves the whole step, [S, ceil(vocab / 32)] int32. Bit t of a row means token t is allowed.
    All bits are set when made. A grammar that fails here fails its request alone (seq.error). process_logits
    then zeroes its row, whatever its mask left."""
    rows = [row for row, seq in enumerate(seqs) if seq.grammar is not None and seq.error is None]
    if not rows:
        return
    import xgrammar as xgr
    bitmask = xgr.allocate_token_bitmask(len(seqs), logits.shape[1])
    for row in rows:
        try:
            seqs[row].grammar.fill(bitmask, row)
        except Exception as error:  # this request's grammar: its failure, not the step's
            seqs[row].error = error
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
