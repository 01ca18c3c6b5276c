"""An OpenAI-compatible HTTP server over one LLMEngine (FastAPI + uvicorn, as vLLM's).

    python -m nanoserve.serve MODEL [--host 127.0.0.1] [--port 8000] [--api-key KEY] [options]

Threads and queues. The engine is not thread-safe, so one thread owns it, and three kinds of thread
take part in a request:
- uvicorn's event loop (one thread) runs the HTTP handlers (module-level functions such as
  `create_completion`). A handler reads and checks the body, takes its slots of
  --max-num-queued-requests or answers 429 at once, and hands the slow work to
- the tokenizer thread, which renders the chat template and tokenizes, so that neither the event
  loop (serving every other client) nor the engine thread (stepping every other request) waits on a
  long input. With the token ids, the handler puts one `Submit` per choice (n per prompt) on
- the engine thread's `inbox`, a queue.Queue and the only way in. Between two steps the `EngineLoop`
  takes every message there (`Submit` -> add_request, `Abort` -> abort_request, `Stop`), steps the
  engine, and sends each request's results to its handler's `ReplyQueue` (an asyncio.Queue written
  through call_soon_threadsafe): `Accepted` or `Failed` first, then RequestDeltas, then the
  RequestOutput. Idle, it blocks on the inbox.
A client that leaves is noticed on the event loop (`until_disconnected`, `EventStream`), which sends
an `Abort`: its KV blocks are free before the next step. If something fails on the engine thread, the
requests it concerns fail (500) and the loop goes on; if the loop itself dies, /health says 503 and
every request fails at once (503) instead of hanging.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import functools
import hmac
import itertools
import json
import logging
import os
import queue
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from importlib.metadata import PackageNotFoundError, version
from typing import NoReturn, TypeVar

import h11
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from nanoserve import Config, LLMEngine, RequestDelta, RequestOutput, SamplingParams
from nanoserve.sampler import MAX_LOGPROBS, InvalidRequest, Logprob

logger = logging.getLogger("nanoserve.serve")
T = TypeVar("T")
HEADER_TIMEOUT = 10.0  # seconds a connection may take to send a request's head (line and headers)


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the server (README: "Limits"); past them, a 4xx at once."""
    max_body_bytes: int = 8 * 2**20                # 413 past this; the body is read no further
    max_stop: int = 32                             # stop strings, and stop_token_ids, per request
    max_stop_chars: int = 1024                     # characters in one stop string
    max_num_queued_requests: int | None = None     # completions (prompts x n) in flight; more: 429
    max_n: int = 128                               # completions of one prompt (n): OpenAI's limit


# --- Errors -------------------------------------------------------------------------------------

class APIError(Exception):
    """A request's failure: an HTTP status and OpenAI's error body, naming the field at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code

    @property
    def body(self) -> dict:
        kind = "server_error" if self.status >= 500 else "rate_limit_error" if self.status == 429 \
            else "invalid_request_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> Response:  # ASCII JSON: a lone surrogate in a message is escaped, not an error
        return Response(json.dumps(self.body), status_code=self.status, media_type="application/json")


def shorten(text: str, limit: int = 100) -> str:
    """text cut to `limit` characters: what a client sent is never echoed back whole."""
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


# --- Messages between the threads ----------------------------------------------------------------

class ReplyQueue:
    """One HTTP request's queue of Replies: written from the engine thread, read on the event loop."""

    def __init__(self) -> None:
        self.loop, self.queue = asyncio.get_running_loop(), asyncio.Queue()

    def put(self, reply: Reply) -> None:  # from any thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, reply)

    async def get(self) -> Reply:
        return await self.queue.get()


@dataclass
class Submit:
    """Inbox message: add one engine request; its results go to `replies`."""
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    arrival_time: float        # time.perf_counter() when its HTTP request came in: TTFT counts from it
    replies: ReplyQueue


@dataclass
class Abort:
    """Inbox message: abort an engine request (its client is gone); nothing more is sent for it."""
    request_id: str


class Stop:
    """Inbox message: the server shuts down; the engine loop returns."""


@dataclass
class Accepted:
    """Reply: add_request took the request; its deltas follow."""
    request_id: str


@dataclass
class Failed:
    """Reply: the request failed (refused by add_request: 400; a step failed: 500; the loop died: 503)."""
    request_id: str
    error: APIError


Reply = Accepted | Failed | RequestDelta | RequestOutput


# --- The engine thread ---------------------------------------------------------------------------

class Metrics:
    """Prometheus metrics named after vLLM's, each with a model_name label, in the app's own registry."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        gauge, counter, histogram = (functools.partial(self.labelled, kind) for kind in (Gauge, Counter, Histogram))
        seconds = functools.partial(histogram, buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 60))
        self.running = gauge("vllm:num_requests_running", "Requests running")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting in the engine")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "Share of the usable KV-cache blocks in use, 0-1")
        self.gpu_cache_usage = gauge("vllm:gpu_cache_usage_perc", "vllm:kv_cache_usage_perc's old name")
        self.free_blocks = gauge("nanoserve:num_free_blocks", "Free KV-cache blocks")
        self.preemptions = counter("vllm:num_preemptions", "Preemptions")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of accepted requests")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens")
        self.prefix_cache_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_cache_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.rejected = counter("nanoserve:requests_rejected", "Requests refused with 429: too many in flight")
        self.ttft = seconds("vllm:time_to_first_token_seconds", "From arrival to the first token")
        self.itl = seconds("vllm:time_per_output_token_seconds", "Between two tokens of a request")
        self.e2e_latency = seconds("vllm:e2e_request_latency_seconds", "From arrival to finish")
        self.queue_time = seconds("vllm:request_queue_time_seconds", "From arrival to first scheduled")
        self.success = Counter("vllm:request_success", "Finished requests, by finish reason",
                               ["model_name", "finished_reason"], registry=self.registry)

    def labelled(self, kind: type, name: str, doc: str, **kwargs: object):  # -> the model_name child
        return kind(name, doc, ["model_name"], registry=self.registry, **kwargs).labels(self.model_name)

    def observe_finish(self, output: RequestOutput) -> None:
        self.success.labels(self.model_name, output.finish_reason).inc()
        if output.finish_reason != "abort":  # an aborted request's times say when its client left
            self.e2e_latency.observe(output.latency)
            if output.ttft is not None:
                self.ttft.observe(output.ttft)


class EngineLoop:
    """The one thread that owns the engine; everything else talks to it through `inbox`."""

    def __init__(self, engine: LLMEngine, metrics: Metrics) -> None:
        self.engine, self.metrics = engine, metrics
        self.inbox: queue.Queue[Submit | Abort | Stop] = queue.Queue()
        self.replies: dict[str, ReplyQueue] = {}               # unfinished engine requests -> their handler
        self.unscheduled: dict[str, tuple[float, int]] = {}    # (arrival time, prompt tokens) until first scheduled
        self.last_token_time: dict[str, float] = {}
        self.seen = dict(num_preemptions=0, num_cached_tokens=0)  # engine.stats() counters when last read
        self.error: BaseException | None = None                 # why the loop died, if it did
        self.thread = threading.Thread(target=self.run, name="nanoserve-engine", daemon=True)
        self.update_gauges()  # a fresh server shows its free blocks before the first request

    def run(self) -> None:
        try:
            self.serve()
        except BaseException as error:  # a bug in this loop: say so everywhere, never hang
            logger.exception("the engine loop died: /health says 503 and every request fails")
            self.error = error
            self.fail_all(APIError(f"the engine loop died: {error!r}", status=503))
            self.refuse_until_stopped()

    def serve(self) -> None:
        while True:
            for message in self.take_messages():
                if isinstance(message, Stop):
                    return
                self.add(message) if isinstance(message, Submit) else self.abort(message.request_id)
            if self.engine.has_unfinished_requests():
                self.step()
            else:  # an abort may have emptied the engine: show its blocks free now
                self.update_gauges()

    def take_messages(self) -> list[Submit | Abort | Stop]:
        """Idle: wait for a message. Busy: take only those already there, and step on."""
        messages = [] if self.engine.has_unfinished_requests() else [self.inbox.get()]
        while not self.inbox.empty():
            messages.append(self.inbox.get_nowait())
        return messages

    def add(self, submit: Submit) -> None:
        request_id = submit.request_id
        try:
            self.engine.add_request(submit.token_ids, submit.params, request_id, arrival_time=submit.arrival_time)
        except ValueError as error:  # bad input (InvalidRequest names the field)
            submit.replies.put(Failed(request_id, APIError(str(error), param=getattr(error, "param", None))))
            return
        except Exception as error:  # a bug: this request fails, the loop and the others go on
            logger.exception("add_request failed")
            failure = APIError(f"the engine could not take the request: {error!r}", status=500)
            submit.replies.put(Failed(request_id, failure))
            return
        self.replies[request_id] = submit.replies
        self.unscheduled[request_id] = (submit.arrival_time, len(submit.token_ids))
        self.metrics.prompt_tokens.inc(len(submit.token_ids))
        submit.replies.put(Accepted(request_id))

    def abort(self, request_id: str) -> None:
        self.forget(request_id)  # its client is gone: nothing more to send
        if request_id in self.engine.requests:  # it may have finished meanwhile
            self.metrics.observe_finish(self.engine.abort_request(request_id))

    def forget(self, request_id: str) -> None:
        for table in (self.replies, self.unscheduled, self.last_token_time):
            table.pop(request_id, None)

    def step(self) -> None:
        start = time.perf_counter()
        try:
            result = self.engine.step()
        except Exception as error:  # a bug or a device failure: fail these requests, serve the next ones
            logger.exception("a step failed")
            self.fail_all(APIError(f"the engine failed: {error!r}", status=500))
            for request_id in list(self.engine.requests):
                self.abort(request_id)
            return
        now = time.perf_counter()
        for request_id, _ in result.scheduled:
            if request_id in self.unscheduled:
                arrival_time, num_prompt_tokens = self.unscheduled.pop(request_id)
                self.metrics.queue_time.observe(start - arrival_time)
                self.metrics.prefix_cache_queries.inc(num_prompt_tokens)
        for delta in result.deltas:
            self.metrics.generation_tokens.inc(len(delta.token_ids))
            if delta.request_id in self.last_token_time:
                self.metrics.itl.observe(now - self.last_token_time[delta.request_id])
            self.last_token_time[delta.request_id] = now
            self.send(delta.request_id, delta)
        for output in result.outputs:
            if output.finish_reason != "abort":  # an abort was counted when this loop made it
                self.metrics.observe_finish(output)
            self.send(output.request_id, output)
            self.forget(output.request_id)
        self.update_gauges()

    def send(self, request_id: str, reply: Reply) -> None:
        if request_id in self.replies:
            self.replies[request_id].put(reply)

    def fail_all(self, error: APIError) -> None:
        for request_id, replies in self.replies.items():
            replies.put(Failed(request_id, error))
        self.replies.clear()

    def refuse_until_stopped(self) -> None:
        """After the loop died: refuse what still comes (a handler may have raced the death), until Stop."""
        while not isinstance(message := self.inbox.get(), Stop):
            if isinstance(message, Submit):
                message.replies.put(Failed(message.request_id, APIError("the engine loop has died", status=503)))

    def update_gauges(self) -> None:
        stats, m = self.engine.stats(), self.metrics
        usage = 1 - stats["num_free_blocks"] / (self.engine.model_runner.num_blocks - 1)  # block 0 is never used
        m.running.set(stats["num_running"])
        m.waiting.set(stats["num_waiting"])
        m.free_blocks.set(stats["num_free_blocks"])
        m.kv_cache_usage.set(usage)
        m.gpu_cache_usage.set(usage)
        # The engine counts since it started; the counters add what is new since the last look.
        m.preemptions.inc(stats["num_preemptions"] - self.seen["num_preemptions"])
        m.prefix_cache_hits.inc(stats["num_cached_tokens"] - self.seen["num_cached_tokens"])
        self.seen = {name: stats[name] for name in self.seen}


# --- Request bodies ------------------------------------------------------------------------------
# Strict, as OpenAI's API: "5" is not an int and true is not a number. A field left out or null
# takes the default. Unknown fields are ignored (and logged); UNSUPPORTED ones are refused.

class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(Strict):
    include_usage: bool | None = True  # as vLLM: stream_options without include_usage includes it


class SamplingBody(Strict):
    """The fields /v1/completions and /v1/chat/completions share."""
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM's extra parameters: stop_token_ids, top_k, ignore_eos
    seed: int | None = None
    ignore_eos: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None  # OpenAI's end-user id: accepted, unused
    n: int | None = None     # completions of each prompt


class CompletionBody(SamplingBody):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = None           # the prompt before the completion (its logprobs too, with logprobs)
    logprobs: int | None = None        # each token's logprob, with the N most likely
    prompt_logprobs: int | None = None  # vLLM's extra: each prompt token's, in the choice's prompt_logprobs


class ContentPart(Strict):
    type: str
    text: str | None = None


class Message(Strict):
    role: str
    content: str | list[ContentPart]


class ChatBody(SamplingBody):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None       # each token's logprob
    top_logprobs: int | None = None    # and the N most likely (with logprobs true)


class TokenizeBody(Strict):
    """vLLM's /tokenize: a prompt, or messages rendered by the chat template."""
    model: str | None = None
    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template writes them)
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeBody(Strict):
    model: str | None = None
    tokens: list[int]


BODIES = (CompletionBody, ChatBody, Message, ContentPart, StreamOptions, TokenizeBody, DetokenizeBody)
FIELDS = {name for body in BODIES for name in body.model_fields}
# Fields this server does not support -> the values that mean "not used", which it accepts. A body that
# declares one of them (CompletionBody.echo) supports it.
UNSUPPORTED = {
    "n": (1, None), "best_of": (1, None), "logprobs": (None, False), "top_logprobs": (None, 0), "echo": (False, None),
    "prompt_logprobs": (None,), "suffix": (None, ""), "logit_bias": (None, {}), "min_tokens": (0, None),
    "frequency_penalty": (0, 0.0, None), "presence_penalty": (0, 0.0, None), "repetition_penalty": (1, 1.0, None),
    "min_p": (0, 0.0, None), "tools": (None, []), "tool_choice": (None, "none", "auto"), "functions": (None, []),
    "function_call": (None, "none", "auto"), "response_format": (None, {"type": "text"}),
    "use_beam_search": (False, None), "include_stop_str_in_output": (False, None),
}
BodyT = TypeVar("BodyT", bound=BaseModel)


async def read_json(request: Request, limit: int) -> dict:
    """The body as a JSON object; 413 past `limit` bytes (read no further), 400 if it is no JSON object."""
    too_large = APIError(f"the request body is larger than {limit} bytes, this server's limit", status=413)
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, RecursionError) as error:  # not UTF-8, not JSON, an int of 5,000 digits; nested too deep
        raise APIError(f"the request body is not valid JSON: {shorten(str(error), 200)}") from None
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    return body


def parse(model: type[BodyT], body: dict) -> BodyT:
    """The body as `model`; a field it may not use is a 400 naming it, an unknown one is logged."""
    for name, unused in UNSUPPORTED.items():
        value = body.get(name)
        if name in model.model_fields or name not in body:
            continue
        if not any(type(value) is type(u) and value == u for u in unused):  # 0 is no False here
            raise APIError(f"{name}={shorten(repr(value))} is not supported by this server", param=name,
                           code="unsupported_parameter")
    unknown = sorted(body.keys() - model.model_fields.keys() - UNSUPPORTED.keys())
    if unknown:
        logger.warning("ignored unknown fields: %s", shorten(repr(unknown), 300))
    try:
        return model.model_validate(body)
    except ValidationError as error:
        problems = [(".".join(str(part) for part in e["loc"] if isinstance(part, int) or part in FIELDS), e["msg"])
                    for e in error.errors(include_url=False)]  # the loc without pydantic's union tags
        message = "; ".join(f"{path}: {msg}" for path, msg in list(dict.fromkeys(problems))[:4])
        raise APIError(message, param=problems[0][0].split(".")[0] or None) from None


def sampling_params(body: SamplingBody, api: API, max_tokens: int | None, limits: Limits) -> SamplingParams:
    """The body's SamplingParams, checked by SamplingParams itself (a 400 names the field). max_tokens
    None (chat: up to the end of the context) is settled once the prompt is tokenized (`fit_to_context`)."""
    n = given(body.n, 1)
    if not 1 <= n <= limits.max_n:  # SamplingParams takes any n >= 1: this server bounds one request's work
        raise APIError(f"n must be from 1 to {limits.max_n}, this server's limit; got {n}", param="n")
    logprobs, prompt_logprobs = api.logprobs(body)
    stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
    for name, values in ("stop", stop), ("stop_token_ids", body.stop_token_ids or []):
        if len(values) > limits.max_stop:
            raise APIError(f"{name} has {len(values)} entries; this server takes at most {limits.max_stop}", param=name)
    if any(len(s) > limits.max_stop_chars for s in stop):
        raise APIError(f"a stop string is longer than {limits.max_stop_chars} characters, this server's limit",
                       param="stop")
    try:
        return SamplingParams(temperature=given(body.temperature, 1.0), top_p=given(body.top_p, 1.0),
                              top_k=given(body.top_k, 0), max_tokens=given(max_tokens, 1), stop=stop or None,
                              stop_token_ids=body.stop_token_ids or None, seed=body.seed,
                              ignore_eos=bool(body.ignore_eos), n=n, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
    except InvalidRequest as error:
        raise APIError(str(error), param=error.param) from None


def given(value: T | None, default: T) -> T:
    return default if value is None else value


def check_logprobs(field: str, value: int | None) -> None:
    """A number of most likely tokens (logprobs, top_logprobs, prompt_logprobs): None, or 0 to MAX_LOGPROBS."""
    if value is not None and value > MAX_LOGPROBS:  # vLLM's words
        raise APIError(f"Requested {field} of {value}, which is greater than max allowed: {MAX_LOGPROBS}", param=field)
    if value is not None and value < 0:
        raise APIError(f"{field} must be from 0 to {MAX_LOGPROBS}; got {value}", param=field)


def prompt_list(prompt: str | list[int] | list[str] | list[list[int]]) -> list[str | list[int]]:
    """One prompt (a string or a list of token ids) or a list of them -> a list of prompts."""
    if not prompt:
        raise APIError("prompt is empty", param="prompt")
    return [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt


def template_messages(messages: list[Message]) -> list[dict[str, str]]:
    """Messages as chat templates take them; content given as a list of text parts is joined by
    newlines (as vLLM does)."""
    result = []
    for i, m in enumerate(messages):
        parts = [ContentPart(type="text", text=m.content)] if isinstance(m.content, str) else m.content
        if any(p.type != "text" or p.text is None for p in parts):
            raise APIError(f"messages.{i}.content: only text parts ({{'type': 'text', 'text': ...}}) are supported",
                           param="messages")
        result.append({"role": m.role, "content": "\n".join(p.text for p in parts)})
    return result


# --- Responses: one formatter per API ------------------------------------------------------------
# An HTTP request's choices are n completions of each prompt: choice p * n + i is completion i of
# prompt p (as vLLM). Once the prompts are tokenized, the handler makes its API's formatter, which
# turns each result (a RequestOutput for a whole response, a RequestDelta for a stream) into what
# its choice shows (`Shown`), then into the API's JSON.

@dataclass
class Prompt:
    """A prompt as the engine takes it, and as echo shows it: a string as given, token ids decoded (as
    vLLM); None without a tokenizer."""
    token_ids: list[int]
    text: str | None = None


Position = dict[int, Logprob] | None  # a token's logprobs: the token's own first, then the most likely
                                      # (None: a prompt's first token, which nothing predicts)


@dataclass
class Shown:
    """What one choice shows of a result: its text, its tokens and their logprobs (None: not asked for)."""
    text: str | None
    token_ids: list[int]
    logprobs: list[Position] | None
    finish_reason: str | None
    prompt_logprobs: list[Position] | None = None  # vLLM's extra field, in whole responses

    def named_tokens(self) -> set[int]:
        """The tokens whose strings the logprobs show."""
        positions = [p for p in (self.logprobs or []) + (self.prompt_logprobs or []) if p is not None]
        return set(self.token_ids if self.logprobs is not None else []).union(*positions)


class TokenStrings:
    """Each token's text alone, as logprobs name tokens: tokenizer.decode([id]), as vLLM ("<s>", " sky",
    "\ufffd" for one byte of a longer character); "token_id:N" without a tokenizer (vLLM's
    return_tokens_as_token_ids). A token is decoded once, in the tokenizer thread (`learn`), then
    looked up on the event loop: at most the vocabulary is kept."""

    def __init__(self, tokenizer: object | None, tokenizer_thread: ThreadPoolExecutor) -> None:
        self.tokenizer, self.tokenizer_thread = tokenizer, tokenizer_thread
        self.known: dict[int, str] = {}  # written and read on the event loop only

    async def learn(self, token_ids: set[int]) -> None:
        unknown = [t for t in token_ids if t not in self.known] if self.tokenizer is not None else []
        if unknown:
            def decode() -> list[str]:
                return [self.tokenizer.decode([t]) for t in unknown]
            strings = await asyncio.get_running_loop().run_in_executor(self.tokenizer_thread, decode)
            self.known.update(zip(unknown, strings))

    def __getitem__(self, token_id: int) -> str:
        return self.known[token_id] if self.tokenizer is not None else f"token_id:{token_id}"


def clamp(logprob: float) -> float:
    """A logprob as JSON can hold it: -inf (a token ruled out) as OpenAI and vLLM write it."""
    return max(logprob, -9999.0)


def text_or_token_ids(text: str | None, token_ids: list[int]) -> dict:
    """A model without a tokenizer answers token ids, with an empty text."""
    return {"text": text} if text is not None else {"text": "", "token_ids": token_ids}


class Formatter:
    """What both APIs' formatters hold: the request's prompts, its n, and the token strings."""
    echo_only = False  # completions' echo with max_tokens 0: the prompt alone

    def __init__(self, prompts: list[Prompt], n: int, strings: TokenStrings) -> None:
        self.prompts, self.n, self.strings = prompts, n, strings

    def usage(self, outputs: list[RequestOutput]) -> dict:
        """Each prompt's tokens once, whatever n (as vLLM), and the completions' tokens shown."""
        num_prompt = sum(len(p.token_ids) for p in self.prompts)
        num_completion = 0 if self.echo_only else sum(len(o.token_ids) for o in outputs)
        total = num_prompt + num_completion
        return dict(prompt_tokens=num_prompt, completion_tokens=num_completion, total_tokens=total)

    def first_chunk_choice(self, index: int) -> dict | None:
        return None


class CompletionAPI(Formatter):
    """/v1/completions' response and chunk choices."""
    id_prefix, object, chunk_object, prompt_field = "cmpl", "text_completion", "text_completion", "prompt"

    def __init__(self, body: CompletionBody, prompts: list[Prompt], n: int, strings: TokenStrings) -> None:
        super().__init__(prompts, n, strings)
        self.echo, self.echo_only = bool(body.echo), bool(body.echo) and body.max_tokens == 0
        self.num_top, self.show_prompt_logprobs = body.logprobs, body.prompt_logprobs is not None
        self.echoed: set[int] = set()                          # choices whose prompt was shown
        self.num_chars: dict[int, int] = collections.Counter()  # a streamed choice's text so far

    @staticmethod
    def max_tokens(body: CompletionBody) -> int:
        max_tokens = given(body.max_tokens, 16)  # OpenAI's and vLLM's default
        return 1 if max_tokens == 0 and body.echo else max_tokens  # the prompt alone: one token made, unshown (vLLM)

    @staticmethod
    def logprobs(body: CompletionBody) -> tuple[int | None, int | None]:
        """The engine's logprobs and prompt_logprobs: echo with logprobs needs the prompt's (as vLLM)."""
        check_logprobs("logprobs", body.logprobs)
        check_logprobs("prompt_logprobs", body.prompt_logprobs)
        if body.prompt_logprobs is not None and body.stream:
            raise APIError("prompt_logprobs cannot be streamed (as in vLLM); echo with logprobs can",
                           param="prompt_logprobs")
        return body.logprobs, given(body.prompt_logprobs, body.logprobs if body.echo else None)

    def show(self, index: int, result: RequestOutput | RequestDelta) -> Shown:
        """The completion (a whole output, or a streamed delta); with echo, the prompt first (in a
        choice's first chunk), or alone with max_tokens 0."""
        if isinstance(result, RequestOutput):
            completion = result.outputs[0]
            text, token_ids, logprobs, finish_reason = (completion.text, completion.token_ids, completion.logprobs,
                                                        completion.finish_reason)
        else:
            text, token_ids, finish_reason = result.text, result.token_ids, result.finish_reason
            logprobs = None if result.logprobs is None else [result.logprobs]
        if self.echo_only:  # the one token made (it ends the request) is not shown
            text = None if text is None else ""
            token_ids, logprobs, finish_reason = [], None if logprobs is None else [], "length"
        if self.echo and index not in self.echoed:
            self.echoed.add(index)
            prompt = self.prompts[index // self.n]
            text = None if text is None else prompt.text + text
            token_ids = prompt.token_ids + token_ids
            logprobs = None if logprobs is None else result.prompt_logprobs + logprobs
        prompt_logprobs = result.prompt_logprobs if self.show_prompt_logprobs else None
        return Shown(text, token_ids, logprobs, finish_reason, prompt_logprobs)

    def choice(self, index: int, shown: Shown) -> dict:
        choice = dict(index=index, **text_or_token_ids(shown.text, shown.token_ids),
                      logprobs=self.logprobs_object(shown, 0), finish_reason=shown.finish_reason)
        if shown.prompt_logprobs is not None:  # vLLM's shape: {token id: {logprob, rank, decoded_token}}
            choice["prompt_logprobs"] = [None if p is None else {str(t): self.vllm_entry(t, lp) for t, lp in p.items()}
                                         for p in shown.prompt_logprobs]
        return choice

    def vllm_entry(self, token_id: int, logprob: Logprob) -> dict:
        return dict(logprob=clamp(logprob.logprob), rank=logprob.rank, decoded_token=self.strings[token_id])

    def chunk_choice(self, index: int, shown: Shown) -> dict:
        logprobs = self.logprobs_object(shown, self.num_chars[index])
        self.num_chars[index] += len(shown.text or "")
        return dict(index=index, **text_or_token_ids(shown.text, shown.token_ids), logprobs=logprobs,
                    finish_reason=shown.finish_reason)

    def logprobs_object(self, shown: Shown, offset: int) -> dict | None:
        """OpenAI's completions logprobs, as vLLM writes them: per token its string, its logprob and
        top_logprobs {string: logprob} (the token's own, then the num_top most likely: num_top or
        num_top + 1 entries; tokens whose strings coincide share an entry), None for a prompt's first
        token; text_offset: where its string starts after the strings before it, from `offset` (the
        text a stream sent before)."""
        if shown.logprobs is None:
            return None
        tokens = [self.strings[t] for t in shown.token_ids]
        positions = list(zip(shown.token_ids, shown.logprobs))
        token_logprobs = [None if p is None else clamp(p[t].logprob) for t, p in positions]
        top_logprobs = [None if p is None else self.top(p) for _, p in positions]
        text_offset = list(itertools.accumulate(map(len, tokens), initial=offset))[:-1]
        return dict(tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top_logprobs, text_offset=text_offset)

    def top(self, position: dict[int, Logprob]) -> dict[str, float]:
        items = list(position.items())[:self.num_top + 1]  # a prompt's may hold more (prompt_logprobs > logprobs)
        return {self.strings[t]: clamp(logprob.logprob) for t, logprob in items}


class ChatAPI(Formatter):
    """/v1/chat/completions' response and chunk choices."""
    id_prefix, object, chunk_object, prompt_field = "chatcmpl", "chat.completion", "chat.completion.chunk", "messages"

    def __init__(self, body: ChatBody, prompts: list[Prompt], n: int, strings: TokenStrings) -> None:
        super().__init__(prompts, n, strings)
        self.num_top = given(body.top_logprobs, 0)

    @staticmethod
    def max_tokens(body: ChatBody) -> int | None:
        return given(body.max_completion_tokens, body.max_tokens)  # None: up to the end of the context

    @staticmethod
    def logprobs(body: ChatBody) -> tuple[int | None, None]:
        """The engine's logprobs (top_logprobs, with logprobs true), and no prompt logprobs."""
        check_logprobs("top_logprobs", body.top_logprobs)
        if body.top_logprobs and not body.logprobs:  # vLLM's words
            raise APIError("when using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs")
        return (given(body.top_logprobs, 0) if body.logprobs else None), None

    def show(self, index: int, result: RequestOutput | RequestDelta) -> Shown:
        if isinstance(result, RequestOutput):
            c = result.outputs[0]
            return Shown(c.text, c.token_ids, c.logprobs, c.finish_reason)
        logprobs = None if result.logprobs is None else [result.logprobs]
        return Shown(result.text, result.token_ids, logprobs, result.finish_reason)

    def choice(self, index: int, shown: Shown) -> dict:
        return dict(index=index, message=dict(role="assistant", content=shown.text),
                    logprobs=self.logprobs_object(shown), finish_reason=shown.finish_reason)

    def first_chunk_choice(self, index: int) -> dict | None:
        return dict(index=index, delta=dict(role="assistant", content=""), logprobs=None, finish_reason=None)

    def chunk_choice(self, index: int, shown: Shown) -> dict:
        return dict(index=index, delta=dict(content=shown.text), logprobs=self.logprobs_object(shown),
                    finish_reason=shown.finish_reason)

    def logprobs_object(self, shown: Shown) -> dict | None:
        """OpenAI's chat logprobs: per token {token, logprob, bytes, top_logprobs: the num_top most likely
        tokens by rank, each {token, logprob, bytes}}."""
        if shown.logprobs is None:
            return None

        def entry(token_id: int, logprob: Logprob) -> dict:
            token = self.strings[token_id]
            return dict(token=token, logprob=clamp(logprob.logprob), bytes=list(token.encode(errors="replace")))

        def with_top(token_id: int, position: dict[int, Logprob]) -> dict:
            top = sorted(position.items(), key=lambda item: item[1].rank)[:self.num_top]  # the token's own may be one
            return entry(token_id, position[token_id]) | {"top_logprobs": [entry(*item) for item in top]}
        return {"content": [with_top(t, p) for t, p in zip(shown.token_ids, shown.logprobs)]}


API = type[CompletionAPI] | type[ChatAPI]


def sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"


class Generation:
    """The engine requests of one HTTP request (n per prompt, one per choice), submitted and read back
    together. It holds its choices' slots of --max-num-queued-requests from creation to `close()`,
    which its handler calls however the request ends; close() aborts the engine requests not finished."""

    def __init__(self, serving: Serving, num_choices: int) -> None:
        serving.admit(num_choices)
        self.serving, self.num_choices, self.closed = serving, num_choices, False
        self.id = uuid.uuid4().hex
        self.replies = ReplyQueue()
        self.index: dict[str, int] = {}       # engine request id -> its choice's index
        self.unfinished: set[str] = set()
        self.early: list[Reply] = []          # results that came in while others awaited Accepted

    async def submit(self, prompts: list[tuple[list[int], SamplingParams]], arrival_time: float) -> None:
        """Hand every prompt's n requests to the engine loop, sample i seeded seed + i (as vLLM; choice
        p * n + i); raises the first refusal (add_request's 400)."""
        requests = [(token_ids, params.for_sample(i)) for token_ids, params in prompts for i in range(params.n)]
        for index, (token_ids, params) in enumerate(requests):
            request_id = f"{self.id}-{index}"
            self.index[request_id] = index
            self.unfinished.add(request_id)
            self.serving.engine_loop.inbox.put(Submit(request_id, token_ids, params, arrival_time, self.replies))
        num_accepted = 0
        while num_accepted < len(requests):
            reply = await self.replies.get()
            if isinstance(reply, Failed):
                raise reply.error
            if isinstance(reply, Accepted):
                num_accepted += 1
            else:
                self.early.append(reply)

    async def results(self) -> AsyncIterator[tuple[int, RequestDelta | RequestOutput]]:
        """(choice index, delta or final output), as they come; raises a failure of the engine."""
        while self.unfinished:
            reply = self.early.pop(0) if self.early else await self.replies.get()
            if isinstance(reply, Failed):
                raise reply.error
            if isinstance(reply, RequestOutput):
                self.unfinished.discard(reply.request_id)
            yield self.index[reply.request_id], reply

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            for request_id in self.unfinished:
                self.serving.engine_loop.inbox.put(Abort(request_id))
            self.serving.num_in_flight -= self.num_choices


async def whole_response(generation: Generation, api: CompletionAPI | ChatAPI, head: dict) -> JSONResponse:
    outputs = {index: result async for index, result in generation.results() if isinstance(result, RequestOutput)}
    shown = {index: api.show(index, outputs[index]) for index in sorted(outputs)}
    await api.strings.learn(set().union(*(s.named_tokens() for s in shown.values())))
    choices = [api.choice(index, s) for index, s in shown.items()]
    return JSONResponse({**head, "choices": choices, "usage": api.usage(list(outputs.values()))})


async def event_stream(generation: Generation, api: CompletionAPI | ChatAPI, head: dict,
                       include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: a chunk per delta with text or logprobs, the usage if asked, then [DONE]. A
    failure mid-stream is an error event (OpenAI's error body) before [DONE]: the 200 was sent long ago."""
    try:
        for index in range(generation.num_choices):
            if (choice := api.first_chunk_choice(index)) is not None:
                yield sse({**head, "choices": [choice]})
        outputs = []
        async for index, result in generation.results():
            if isinstance(result, RequestOutput):
                outputs.append(result)
                continue
            shown = api.show(index, result)
            if shown.text or shown.finish_reason or shown.text is None or shown.logprobs is not None:  # "": held back
                await api.strings.learn(shown.named_tokens())
                yield sse({**head, "choices": [api.chunk_choice(index, shown)]})
        if include_usage:
            yield sse({**head, "choices": [], "usage": api.usage(outputs)})
    except APIError as error:
        yield sse(error.body)
    except Exception as error:  # a bug here: still an error event, then [DONE]
        logger.exception("a stream failed")
        yield sse(APIError(f"the stream failed: {error!r}", status=500).body)
    yield "data: [DONE]\n\n"


class EventStream(StreamingResponse):
    """A streamed request's response. A client disconnect reaches the engine because Starlette
    cancels the response: its listen_for_disconnect task sees http.disconnect and cancels the task
    that runs the event_stream generator. Whenever that happens (even before the generator has
    started, when its own `finally` would never run), __call__'s `finally` closes the generation,
    which aborts its engine requests."""

    def __init__(self, generation: Generation, api: CompletionAPI | ChatAPI, head: dict, include_usage: bool) -> None:
        super().__init__(event_stream(generation, api, head, include_usage), media_type="text/event-stream")
        self.generation = generation

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.close()


async def until_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """`work`'s response, unless the client disconnects first: then `work` is cancelled and the
    handler's generation.close() aborts its engine requests, so a client that gave up costs no more
    tokens. (Starlette does not cancel a handler whose client left; a stream, see EventStream.)"""
    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():  # the client left (or this handler was cancelled)
            task.cancel()
    return task.result() if task in done else Response(status_code=499)  # 499: no one reads it


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client disconnects (the body was read: receive() has nothing else to say)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


# --- What the handlers share ---------------------------------------------------------------------

class Serving:
    """The served model's name and limits, the engine loop, the tokenizer thread and the metrics.
    Handlers never call the engine; they use its tokenizer (from the tokenizer thread) and constants."""

    def __init__(self, engine: LLMEngine, model_name: str, limits: Limits) -> None:
        self.model_name, self.limits = model_name, limits
        self.model_path, self.max_model_len = engine.config.model, engine.max_model_len
        self.tokenizer = engine.tokenizer
        self.metrics = Metrics(model_name)
        self.engine_loop = EngineLoop(engine, self.metrics)
        self.tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="nanoserve-tokenizer")
        self.token_strings = TokenStrings(self.tokenizer, self.tokenizer_thread)
        self.vocab_size = engine.vocab_size
        self.num_in_flight = 0  # prompts of accepted HTTP requests not yet answered (event loop only)
        # A token covers at most this many bytes of text: a text longer than max_model_len of them
        # cannot fit, and is refused untokenized. (A token's vocabulary entry has at least the bytes of
        # the text it covers, at most half more after Unicode normalization: x2 for safety.)
        longest = max((len(t.encode()) for t in self.tokenizer.get_vocab()), default=1) if self.tokenizer else 1
        self.max_prompt_bytes = 2 * longest * self.max_model_len
        if self.tokenizer is not None:  # the first encode may reset truncation/padding settings: not while the
            self.tokenizer.encode("")   # engine thread decodes with the same tokenizer ("Already borrowed")

    def workers_stopped(self) -> bool:
        """Tensor parallelism's workers stopped (after a failed step): no more steps, for good."""
        return not self.engine_loop.engine.model_runner.healthy

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(f"model {shorten(repr(name))} does not exist; this server serves {self.model_name!r}",
                           param="model", status=404, code="model_not_found")

    def admit(self, num_choices: int) -> None:
        """Take a slot of max_num_queued_requests per choice (prompts x n) or refuse at once (429),
        before any tokenizing: a burst costs no more than reading its bodies."""
        if self.engine_loop.error is not None:
            raise APIError("the engine loop has died; the server cannot serve", status=503)
        limit = self.limits.max_num_queued_requests
        if limit is not None and num_choices > limit:
            raise APIError(f"{num_choices} completions (prompts x n), more than this server takes at once ({limit})",
                           param="prompt")
        if limit is not None and self.num_in_flight + num_choices > limit:
            self.metrics.rejected.inc()
            raise APIError(f"the server is busy: {self.num_in_flight} completions in flight, at most {limit} "
                           f"(--max-num-queued-requests); retry later", status=429, code="too_many_requests")
        self.num_in_flight += num_choices

    async def in_tokenizer_thread(self, work: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_thread, work)

    def tokenize(self, text: str, field: str, add_special_tokens: bool = True, bounded: bool = True) -> list[int]:
        """In the tokenizer thread. `bounded`: a text too long for the context by its bytes alone is refused."""
        if self.tokenizer is None:
            raise APIError(f"{field} is text, but the model has no tokenizer: send token ids", param=field)
        try:
            num_bytes = len(text.encode())
        except UnicodeEncodeError as error:  # a lone surrogate such as "\ud800" (half an emoji)
            raise APIError(f"{field} is not valid Unicode text: {error}", param=field) from None
        if bounded and num_bytes > self.max_prompt_bytes:
            raise APIError(f"{field} has {num_bytes} bytes of text, more than max_model_len={self.max_model_len} "
                           f"tokens can hold ({self.max_prompt_bytes} bytes)", param=field,
                           code="context_length_exceeded")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, token_ids: list[int]) -> str | None:
        """In the tokenizer thread: a token-id prompt as echo shows it (special tokens and all, as vLLM);
        None without a tokenizer, "" for ids outside the vocabulary (add_request refuses them)."""
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(token_ids) if all(0 <= t < self.vocab_size for t in token_ids) else ""

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """In the tokenizer thread: the conversation as the model's chat template writes it."""
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      tokenize=False)
        except Exception as error:  # the template's own checks (a role it does not know, ...)
            raise APIError(f"messages: the chat template failed: {error}", param="messages") from None

    def check_chat_template(self) -> None:
        if self.tokenizer is None or not self.tokenizer.chat_template:
            raise APIError(f"model {self.model_name!r} has no chat template; use /v1/completions", param="messages")

    def fit_to_context(self, params: SamplingParams, max_tokens: int | None, num_prompt_tokens: int,
                       field: str) -> SamplingParams:
        """params with max_tokens settled (None: up to the end of the context); a 400 if the prompt
        and max_tokens do not fit in max_model_len (vLLM's "context length exceeded")."""
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise APIError(f"context length exceeded: the {field} has {num_prompt_tokens} tokens, which leaves no "
                           f"room for a completion in max_model_len={self.max_model_len}", param=field,
                           code="context_length_exceeded")
        if max_tokens is not None and max_tokens > room:
            raise APIError(f"context length exceeded: {num_prompt_tokens} tokens in the {field} + max_tokens="
                           f"{max_tokens} > max_model_len={self.max_model_len}; lower max_tokens or shorten the "
                           f"{field}", param="max_tokens", code="context_length_exceeded")
        return replace(params, max_tokens=given(max_tokens, room))

    async def generate(self, request: Request, api: API, body: SamplingBody, num_prompts: int,
                       prepare: Callable[[], list[Prompt]], arrival_time: float) -> Response:
        """Serve a completions or chat request whose prompts `prepare` tokenizes (in the tokenizer thread)."""
        self.check_model(body.model)
        max_tokens = api.max_tokens(body)
        params = sampling_params(body, api, max_tokens, self.limits)
        if body.stream_options is not None and not body.stream:
            raise APIError("stream_options is only for stream=true", param="stream_options")
        generation = Generation(self, num_prompts * params.n)  # takes its slots, or 429

        async def start() -> Response:
            prompts = await self.in_tokenizer_thread(prepare)
            fitted = [self.fit_to_context(params, max_tokens, len(p.token_ids), api.prompt_field) for p in prompts]
            await generation.submit([(p.token_ids, f) for p, f in zip(prompts, fitted)], arrival_time)
            formatter = api(body, prompts, params.n, self.token_strings)
            head = dict(id=f"{api.id_prefix}-{generation.id}", object=api.chunk_object if body.stream else api.object,
                        created=int(time.time()), model=self.model_name)
            if body.stream:
                include_usage = body.stream_options is not None and bool(body.stream_options.include_usage)
                return EventStream(generation, formatter, head, include_usage)
            return await whole_response(generation, formatter, head)
        try:
            response = await until_disconnected(request, start())
        except BaseException:
            generation.close()
            raise
        if not isinstance(response, EventStream):  # an EventStream closes it when it ends
            generation.close()
        return response


# --- Handlers ------------------------------------------------------------------------------------

async def create_completion(request: Request) -> Response:
    arrival_time = time.perf_counter()  # TTFT, queue time and latency count from the HTTP request's arrival
    serving: Serving = request.app.state.serving
    body = parse(CompletionBody, await read_json(request, serving.limits.max_body_bytes))
    prompts = prompt_list(body.prompt)

    def prepare() -> list[Prompt]:  # token ids are checked by add_request
        return [Prompt(p, serving.decode(p) if body.echo else None) if isinstance(p, list)
                else Prompt(serving.tokenize(p, "prompt"), p) for p in prompts]
    return await serving.generate(request, CompletionAPI, body, len(prompts), prepare, arrival_time)


async def create_chat_completion(request: Request) -> Response:
    arrival_time = time.perf_counter()
    serving: Serving = request.app.state.serving
    body = parse(ChatBody, await read_json(request, serving.limits.max_body_bytes))
    serving.check_chat_template()
    messages = template_messages(body.messages)

    def prepare() -> list[Prompt]:  # as LLM.chat: the template wrote the special tokens (<s>)
        return [Prompt(serving.tokenize(serving.render_chat(messages), "messages", add_special_tokens=False))]
    return await serving.generate(request, ChatAPI, body, 1, prepare, arrival_time)


async def tokenize_text(request: Request) -> Response:
    """vLLM's /tokenize: {count, max_model_len, tokens, token_strs if return_token_strs}."""
    serving: Serving = request.app.state.serving
    body = parse(TokenizeBody, await read_json(request, serving.limits.max_body_bytes))
    serving.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError("give either prompt or messages", param="prompt")
    if body.messages is not None:
        serving.check_chat_template()
        messages = template_messages(body.messages)

        def prepare() -> list[int]:
            text = serving.render_chat(messages, body.add_generation_prompt)
            return serving.tokenize(text, "messages", given(body.add_special_tokens, False), bounded=False)
    else:
        def prepare() -> list[int]:
            return serving.tokenize(body.prompt, "prompt", given(body.add_special_tokens, True), bounded=False)
    token_ids = await serving.in_tokenizer_thread(prepare)
    reply = dict(count=len(token_ids), max_model_len=serving.max_model_len, tokens=token_ids)
    if body.return_token_strs:
        reply["token_strs"] = serving.tokenizer.convert_ids_to_tokens(token_ids)
    return JSONResponse(reply)


async def detokenize_tokens(request: Request) -> Response:
    """vLLM's /detokenize: {"prompt": the tokens' text}."""
    serving: Serving = request.app.state.serving
    body = parse(DetokenizeBody, await read_json(request, serving.limits.max_body_bytes))
    serving.check_model(body.model)
    tokenizer = serving.tokenizer
    if tokenizer is None:
        raise APIError(f"model {serving.model_name!r} has no tokenizer", param="tokens")
    bad = [t for t in body.tokens if not 0 <= t < len(tokenizer)]
    if bad:
        raise APIError(f"tokens {bad[:5]} are outside [0, {len(tokenizer)})", param="tokens")
    return JSONResponse({"prompt": await serving.in_tokenizer_thread(lambda: tokenizer.decode(body.tokens))})


async def list_models(request: Request) -> Response:
    serving: Serving = request.app.state.serving
    card = dict(id=serving.model_name, object="model", created=0, owned_by="nanoserve", root=serving.model_path,
                parent=None, max_model_len=serving.max_model_len, permission=[])
    return JSONResponse(dict(object="list", data=[card]))


async def check_health(request: Request) -> Response:
    serving: Serving = request.app.state.serving
    return Response(status_code=503 if serving.engine_loop.error is not None or serving.workers_stopped() else 200)


async def show_metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.serving.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def show_version(request: Request) -> Response:
    try:
        return JSONResponse({"version": version("nanoserve")})
    except PackageNotFoundError:  # run from a checkout that was never installed
        return JSONResponse({"version": "unknown"})


ROUTES = [
    ("/v1/completions", create_completion, ["POST"]),
    ("/v1/chat/completions", create_chat_completion, ["POST"]),
    ("/v1/models", list_models, ["GET"]),
    ("/tokenize", tokenize_text, ["POST"]),
    ("/detokenize", detokenize_tokens, ["POST"]),
    ("/health", check_health, ["GET", "HEAD"]),
    ("/metrics", show_metrics, ["GET"]),
    ("/version", show_version, ["GET"]),
]


async def api_error(request: Request, error: APIError) -> Response:
    return error.response()


async def http_error(request: Request, error: HTTPException) -> Response:  # no such route or method
    return APIError(str(error.detail), status=error.status_code).response()


async def server_error(request: Request, error: Exception) -> Response:  # a bug: still OpenAI's error body
    return APIError(f"internal error: {error!r}", status=500).response()


class RequireAPIKey:
    """ASGI middleware: every route but /health needs `Authorization: Bearer <key>` (the scheme in
    any case; the key compared whole, in constant time), else 401."""

    def __init__(self, app: Callable, api_key: str) -> None:
        self.app, self.key = app, api_key.encode()

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["path"] != "/health" and not self.authorized(scope["headers"]):
            error = APIError("missing or wrong API key (Authorization: Bearer ...)", status=401, code="invalid_api_key")
            await error.response()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def authorized(self, headers: list[tuple[bytes, bytes]]) -> bool:
        scheme, _, key = dict(headers).get(b"authorization", b"").partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(key.strip(), self.key)


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """The engine loop runs while the app does."""
    serving: Serving = app.state.serving
    serving.engine_loop.thread.start()
    yield
    serving.engine_loop.inbox.put(Stop())
    serving.engine_loop.thread.join()
    serving.tokenizer_thread.shutdown()


def build_app(engine: LLMEngine, served_model_name: str, api_key: str | None = None,
              limits: Limits = Limits()) -> FastAPI:
    """The HTTP app; its EngineLoop thread starts and stops with it."""
    app = FastAPI(title="nanoserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = Serving(engine, served_model_name, limits)
    for path, endpoint, methods in ROUTES:
        app.add_api_route(path, endpoint, methods=methods)
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, server_error)
    if api_key is not None:
        app.add_middleware(RequireAPIKey, api_key=api_key)
    return app


# --- Running it ----------------------------------------------------------------------------------

class HTTPProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request's head (request line and headers): a
    client that connects and sends its head slowly, or never, is cut off after `header_timeout`
    seconds instead of holding a connection for good."""

    def __init__(self, *args: object, header_timeout: float, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout, self.head_timer = header_timeout, None

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        self.start_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.start_head_timer()  # for the next request on this kept-alive connection

    def start_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
        self.head_timer = self.loop.call_later(self.header_timeout, self.close_without_head)

    def close_without_head(self) -> None:
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():  # no whole head came
            self.transport.close()


def uvicorn_server(app: FastAPI, host: str = "127.0.0.1", port: int = 0, header_timeout: float = HEADER_TIMEOUT,
                   log_level: str = "warning") -> uvicorn.Server:
    http = functools.partial(HTTPProtocol, header_timeout=header_timeout)
    return uvicorn.Server(uvicorn.Config(app, host=host, port=port, http=http, log_level=log_level))


class ServerThread:
    """Run an app under uvicorn in a background thread (tests, notebooks); `port=0` picks a free one."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0,
                 header_timeout: float = HEADER_TIMEOUT) -> None:
        self.server = uvicorn_server(app, host, port, header_timeout)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> ServerThread:
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the server failed to start")
            time.sleep(0.01)
        return self

    @property
    def url(self) -> str:
        host, port = self.server.servers[0].sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    @property
    def serving(self) -> Serving:
        return self.server.config.app.state.serving

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join()


class OneLineParser(argparse.ArgumentParser):
    """A mistake in the options is one line ("error: ..."), not the usage text."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def positive(kind: type) -> Callable[[str], int | float]:
    def convert(text: str) -> int | float:
        value = kind(text)
        if value <= 0:
            raise ValueError
        return value
    convert.__name__ = f"positive {kind.__name__}"  # argparse's "invalid positive int value: '0'"
    return convert


ENGINE_OPTIONS = {"block_size": int, "num_kvcache_blocks": int, "max_num_seqs": int, "max_num_batched_tokens": int,
                  "max_model_len": int, "dtype": str, "device": str, "attention_backend": str,
                  "gpu_memory_utilization": float, "tensor_parallel_size": int}


def build_parser() -> OneLineParser:
    parser = OneLineParser(prog="python -m nanoserve.serve", description="nanoserve's OpenAI-compatible server")
    parser.add_argument("model")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--served-model-name", default=None, help="default: the model path")
    parser.add_argument("--max-num-queued-requests", type=positive(int), default=None,
                        help="prompts in flight at once (tokenizing, waiting, running); more get 429")
    parser.add_argument("--max-request-body-bytes", type=positive(int), default=Limits.max_body_bytes)
    parser.add_argument("--header-timeout", type=positive(float), default=HEADER_TIMEOUT,
                        help="seconds a connection may take to send a request's head")
    for name, kind in ENGINE_OPTIONS.items():  # Config's fields, default None: Config's own default
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=None)
    parser.add_argument("--no-prefix-caching", action="store_true")
    return parser


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound now: a port in use fails before the model loads."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    options = {name: getattr(args, name) for name in ENGINE_OPTIONS if getattr(args, name) is not None}
    try:  # everything that can be checked before the model loads, so that a mistake costs no wait
        config = Config.from_kwargs(args.model, enable_prefix_caching=not args.no_prefix_caching, **options)
        if not os.path.isdir(args.model):
            raise ValueError(f"model {args.model!r} is not a folder")
        sock = bind(args.host, args.port)
        engine = LLMEngine(config)
    except (ValueError, OSError) as error:
        parser.error(str(error))
    limits = Limits(max_body_bytes=args.max_request_body_bytes, max_num_queued_requests=args.max_num_queued_requests)
    name = args.served_model_name or args.model
    server = uvicorn_server(build_app(engine, name, args.api_key, limits), args.host, args.port, args.header_timeout,
                            log_level="info")
    host, port = sock.getsockname()[:2]  # uvicorn does not say where a socket it was given listens (--port 0)
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    logging.getLogger("uvicorn.error").info("serving %r at %s", name, url)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has shut down gracefully
        pass
    finally:
        engine.close()  # stops tensor-parallel workers


if __name__ == "__main__":
    main()
