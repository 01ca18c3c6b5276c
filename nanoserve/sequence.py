"""A request's state as it moves through the engine.

A `Sequence` is one request. It holds:
- its prompt and output token ids;
- how many of them already have their KV in the cache (`num_computed_tokens`);
- its block table: which KV blocks hold them, in order;
- its status.
The scheduler keeps an invariant. The block table covers at least `num_computed_tokens` slots.
Every token after them still has to be run through the model.
"""

import enum
import time
from typing import Protocol

from nanoserve.detokenizer import Detokenizer
from nanoserve.sampler import SamplingParams, TokenLogprobs


class Grammar(Protocol):
    """A request's grammar (structured_outputs.py's RequestGrammar).

    The request waits as WAITING_FOR_GRAMMAR until `ready`, that is, compiled. The scheduler checks.
    A failed compile is never ready, and the engine ends its request. `append_token` calls `accept` with
    each sampled token. What it returns, an error or None, becomes the request's `error`."""
    ready: bool

    def accept(self, token: int) -> Exception | None: ...


class SequenceStatus(enum.Enum):
    WAITING = enum.auto()   # queued: not yet admitted, or preempted and waiting to be recomputed
    WAITING_FOR_GRAMMAR = enum.auto()  # queued, its grammar compiling: the scheduler passes it over
    RUNNING = enum.auto()   # admitted: holds KV blocks and is scheduled every step
    FINISHED = enum.auto()  # done: blocks returned, output reported


class Sequence:
    """One request. `token_ids` grows by one sampled token per decode step (by the accepted drafts
    too, with speculative decoding: spec_decode.py)."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, detokenizer: Detokenizer | None = None,
                 grammar: Grammar | None = None, arrival_time: float | None = None) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.token_ids = list(prompt_token_ids)          # prompt, then every sampled token
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0                     # tokens whose KV is in the cache
        # Prompt tokens found in the prefix cache when first admitted (None until then); tokens
        # re-found after a preemption are its own, recomputed or not, and do not count.
        self.num_cached_tokens: int | None = None
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []              # prefix-cache keys of the full blocks, in order
        self.spec_token_ids: list[int] = []              # draft tokens this step verifies (spec_decode.py)
        self.status = SequenceStatus.WAITING if grammar is None else SequenceStatus.WAITING_FOR_GRAMMAR
        self.finish_reason: str | None = None            # "stop" | "length" | "abort" | "error"
        # Why this request failed alone (its grammar or a logits processor raised: logits_processors.py);
        # set, it ends with "error" at its next token and no other request notices.
        self.error: Exception | None = None
        # TTFT and latency count from here: add_request, or the HTTP request's arrival when a server
        # passes it (add_request's arrival_time), so time spent queued before the engine counts too.
        self.arrival_time = time.perf_counter() if arrival_time is None else arrival_time
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.detokenizer = detokenizer                   # the output text; None without a tokenizer
        self.grammar = grammar                           # with structured_outputs: structured_outputs.py
        self.logprobs: list[TokenLogprobs] = []          # per output token, with params.logprobs
        # Per prompt token, with params.prompt_logprobs; shared by the requests with the same prompt (scheduler.py)
        self.prompt_logprobs: list[TokenLogprobs | None] = [None]

    def append_token(self, token: int, logprobs: TokenLogprobs | None = None) -> None:
        """A sampled token (and its logprobs, if asked for): onto token_ids, and into the output text."""
        self.token_ids.append(token)
        if logprobs is not None:
            self.logprobs.append(logprobs)
        if self.first_token_time is None:
            self.first_token_time = time.perf_counter()
        if self.detokenizer is not None:
            self.detokenizer.add(token)
        if self.grammar is not None and self.error is None:
            self.error = self.grammar.accept(token)

    def finish(self, reason: str) -> None:
        """Finished ("stop", "length") or aborted ("abort"): the text gets its final form."""
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.finish_time = time.perf_counter()
        if self.detokenizer is not None:
            self.detokenizer.finish(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table})")


ScheduledSeq = tuple[Sequence, int]  # a request and how many of its tokens run this step
