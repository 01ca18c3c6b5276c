"""An OpenAI-compatible HTTP server over one LLMEngine (FastAPI + uvicorn, as vLLM's).

    python -m nanoserve.serve MODEL [--host 127.0.0.1] [--port 8000] [--api-key KEY] [engine options]

The engine is not thread-safe, so one thread owns it: the `EngineLoop`. HTTP handlers run on
uvicorn's asyncio loop and never touch the engine; they put a `Submission` or an abort on the
loop's thread-safe inbox and read their request's own asyncio queue. Between two steps the loop
drains the inbox (add_request, abort_request), steps, and hands each RequestDelta and final
RequestOutput to its request's queue through `call_soon_threadsafe`; idle, it blocks on the inbox.
A request's queue receives, in order: `Accepted()` or the ValueError that add_request raised
(-> 400), then its deltas, then its RequestOutput (or a RuntimeError if a step failed: -> 500).
A client that goes away mid-stream closes its response's generator, which sends an abort: its
blocks are free again before the next step.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict

from nanoserve.config import Config
from nanoserve import LLMEngine, RequestDelta, RequestOutput
from nanoserve.sampler import SamplingParams


@dataclass
class Submission:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    encode_plain: bool                   # a chat prompt: the template wrote the special tokens
    loop: asyncio.AbstractEventLoop      # the handler's event loop and queue
    queue: asyncio.Queue


class Accepted:
    """The first item on a request's queue once add_request took it."""


class Metrics:
    """Prometheus metrics named after vLLM's, in the app's own registry (two apps never share)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.running = Gauge("vllm:num_requests_running", "Requests running", registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting", registry=r)
        self.cache_usage = Gauge("vllm:gpu_cache_usage_perc", "KV-cache usage, 0-1", registry=r)
        self.free_blocks = Gauge("nanoserve:num_free_blocks", "Free KV-cache blocks", registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Preemptions", registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of accepted requests", registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens", registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.itl = Histogram("vllm:time_per_output_token_seconds", "Inter-token latency", registry=r,
                             buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))


class EngineLoop:
    """The one thread that owns the engine; everything else talks to it through `inbox`."""

    def __init__(self, engine: LLMEngine, metrics: Metrics) -> None:
        self.engine, self.metrics = engine, metrics
        self.inbox: queue.Queue[Submission | str | None] = queue.Queue()  # a str is an abort, None stops
        self.queues: dict[str, Submission] = {}   # the requests the engine holds
        self.last_token_time: dict[str, float] = {}
        self.num_preemptions = 0
        self.thread = threading.Thread(target=self.run, name="nanoserve-engine", daemon=True)

    def run(self) -> None:
        while True:
            # Idle: block until something arrives. Busy: take what is there, then step.
            items = [self.inbox.get()] if not self.engine.has_unfinished_requests() else []
            while not self.inbox.empty():
                items.append(self.inbox.get_nowait())
            for item in items:
                if item is None:
                    return
                self.abort(item) if isinstance(item, str) else self.add(item)
            if self.engine.has_unfinished_requests():
                try:
                    self.step()
                except Exception as error:  # a bug in the engine: fail its requests rather than hang them
                    self.fail_all(RuntimeError(f"the engine failed: {error!r}"))
            else:  # an abort may have emptied the engine: show its blocks free now
                self.update_gauges()

    def add(self, sub: Submission) -> None:
        try:
            prompt = sub.prompt
            if sub.encode_plain:  # as LLM.chat: the chat template already wrote <s>
                prompt = self.engine.tokenizer.encode(prompt, add_special_tokens=False)
            self.engine.add_request(prompt, sub.params, sub.request_id)
        except ValueError as error:
            sub.loop.call_soon_threadsafe(sub.queue.put_nowait, error)
            return
        self.queues[sub.request_id] = sub
        self.metrics.prompt_tokens.inc(self.engine.requests[sub.request_id].num_prompt_tokens)
        sub.loop.call_soon_threadsafe(sub.queue.put_nowait, Accepted())

    def abort(self, request_id: str) -> None:
        if request_id in self.engine.requests:  # it may have finished meanwhile
            self.engine.abort_request(request_id)
        self.queues.pop(request_id, None)  # its client is gone: nothing more to send
        self.last_token_time.pop(request_id, None)

    def step(self) -> None:
        result = self.engine.step()
        now = time.perf_counter()
        for delta in result.deltas:
            self.metrics.generation_tokens.inc(len(delta.token_ids))
            if delta.request_id in self.last_token_time:
                self.metrics.itl.observe(now - self.last_token_time[delta.request_id])
            self.last_token_time[delta.request_id] = now
            self.send(delta.request_id, delta)
        for output in result.outputs:
            self.last_token_time.pop(output.request_id, None)
            if output.ttft is not None and output.finish_reason != "abort":
                self.metrics.ttft.observe(output.ttft)
            self.send(output.request_id, output)
            self.queues.pop(output.request_id, None)
        self.update_gauges()

    def fail_all(self, error: RuntimeError) -> None:
        for request_id, sub in list(self.queues.items()):
            sub.loop.call_soon_threadsafe(sub.queue.put_nowait, error)
            self.abort(request_id)

    def send(self, request_id: str, item: RequestDelta | RequestOutput) -> None:
        sub = self.queues.get(request_id)
        if sub is not None:
            sub.loop.call_soon_threadsafe(sub.queue.put_nowait, item)

    def update_gauges(self) -> None:
        stats, m = self.engine.stats(), self.metrics
        usable = self.engine.model_runner.num_blocks - 1  # block 0 is the reserved null block
        m.running.set(stats["num_running"])
        m.waiting.set(stats["num_waiting"])
        m.free_blocks.set(stats["num_free_blocks"])
        m.cache_usage.set(1 - stats["num_free_blocks"] / usable)
        m.preemptions.inc(stats["num_preemptions"] - self.num_preemptions)
        self.num_preemptions = stats["num_preemptions"]


# Request bodies. Strict: "5" is not an int and true is not a number, as in OpenAI's API.
class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False


class SamplingFields(BaseModel):
    model_config = ConfigDict(strict=True)
    model: str
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    ignore_eos: bool = False       # vLLM's extra parameter
    stream: bool = False
    stream_options: StreamOptions | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]


class Message(BaseModel):
    model_config = ConfigDict(strict=True)
    role: str
    content: str


class ChatRequest(SamplingFields):
    messages: list[Message]
    max_completion_tokens: int | None = None


class APIError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code = message, param, status, code


def error_response(message: str, param: str | None = None, status: int = 400, code: str | None = None) -> JSONResponse:
    error = {"message": message, "type": "invalid_request_error", "param": param, "code": code}
    return JSONResponse({"error": error}, status_code=status)


def sampling_params(body: SamplingFields, max_tokens: int | None) -> SamplingParams:
    """The engine's own checks, as a 400 naming the field (SamplingParams says "temperature must be ...")."""
    try:
        return SamplingParams(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                              max_tokens=max_tokens, stop=body.stop if body.stop != [] else None, seed=body.seed,
                              ignore_eos=body.ignore_eos)
    except ValueError as error:
        raise APIError(str(error), param=str(error).split()[0]) from None


def build_app(engine: LLMEngine, served_model_name: str, api_key: str | None = None) -> FastAPI:
    """The HTTP app; its EngineLoop thread starts and stops with the app (its lifespan)."""
    metrics = Metrics()
    engine_loop = EngineLoop(engine, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine_loop.thread.start()
        yield
        engine_loop.inbox.put(None)
        engine_loop.thread.join()

    app = FastAPI(title="nanoserve", lifespan=lifespan)
    app.state.engine_loop = engine_loop

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if api_key is not None and request.url.path != "/health" \
                and request.headers.get("authorization") != f"Bearer {api_key}":
            return error_response("missing or wrong API key (Authorization: Bearer ...)",
                                  status=401, code="invalid_api_key")
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        error = exc.errors()[0]
        if error["type"] == "json_invalid":
            return error_response(f"request body is not valid JSON: {error.get('ctx', {}).get('error', '')}")
        field = ".".join(str(part) for part in error["loc"][1:]) or "body"
        return error_response(f"{field}: {error['msg']}", param=field)

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.message, exc.param, exc.status, exc.code)

    def check_model(name: str) -> None:
        if name != served_model_name:
            raise APIError(f"model {name!r} does not exist; this server serves {served_model_name!r}",
                           param="model", status=404, code="model_not_found")

    async def submit(request_id: str, prompt: str | list[int], params: SamplingParams,
                     encode_plain: bool) -> asyncio.Queue:
        """Hand one request to the engine loop; a 400 if add_request refused it."""
        sub = Submission(request_id, prompt, params, encode_plain, asyncio.get_running_loop(), asyncio.Queue())
        engine_loop.inbox.put(sub)
        first = await sub.queue.get()
        if isinstance(first, ValueError):
            raise APIError(str(first), param="prompt" if "prompt" in str(first) else None)
        return sub.queue

    async def events(request_id: str, items: asyncio.Queue) -> AsyncIterator[RequestDelta | RequestOutput]:
        """A request's deltas, then its output. Closed early (the client left): abort it."""
        finished = False
        try:
            while not finished:
                item = await items.get()
                if isinstance(item, RuntimeError):  # from fail_all
                    raise APIError(str(item), status=500, code="engine_error")
                finished = isinstance(item, RequestOutput)
                yield item
        finally:
            if not finished:
                engine_loop.inbox.put(request_id)

    def usage(output: RequestOutput) -> dict:
        n_prompt, n_out = len(output.prompt_token_ids), len(output.token_ids)
        return dict(prompt_tokens=n_prompt, completion_tokens=n_out, total_tokens=n_prompt + n_out)

    async def serve(body: SamplingFields, request_id: str, prompt: str | list[int], params: SamplingParams,
                    chat: bool) -> Response:
        items = await submit(request_id, prompt, params, encode_plain=chat)
        head = dict(id=request_id, object="chat.completion" if chat else "text_completion",
                    created=int(time.time()), model=served_model_name)
        if not body.stream:
            output = [item async for item in events(request_id, items)][-1]
            choice = dict(index=0, logprobs=None, finish_reason=output.finish_reason)
            if chat:
                choice["message"] = dict(role="assistant", content=output.text)
            else:
                choice["text"] = output.text or ""
                if output.text is None:  # a model without a tokenizer: the tokens are the output
                    choice["token_ids"] = output.token_ids
            return JSONResponse(dict(head, choices=[choice], usage=usage(output)))
        if chat:
            head["object"] = "chat.completion.chunk"
        include_usage = body.stream_options is not None and body.stream_options.include_usage

        def chunk(text: str | None, finish_reason: str | None, role: bool = False,
                  token_ids: list[int] | None = None) -> str:
            choice = dict(index=0, logprobs=None, finish_reason=finish_reason)
            if chat:
                choice["delta"] = dict(role="assistant", content="") if role else dict(content=text)
            else:
                choice["text"] = text or ""
                if text is None:  # a model without a tokenizer: stream its token ids instead
                    choice["token_ids"] = token_ids
            return f"data: {json.dumps(dict(head, choices=[choice]))}\n\n"

        async def stream() -> AsyncIterator[str]:
            if chat:
                yield chunk(None, None, role=True)
            async for item in events(request_id, items):
                if isinstance(item, RequestDelta) and (item.text or item.finish_reason or item.text is None):
                    yield chunk(item.text, item.finish_reason, token_ids=item.token_ids)
                elif isinstance(item, RequestOutput) and include_usage:
                    yield f"data: {json.dumps(dict(head, choices=[], usage=usage(item)))}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Response:
        check_model(body.model)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError("this server takes one prompt per request", param="prompt")
            prompt = prompt[0]
        params = sampling_params(body, 16 if body.max_tokens is None else body.max_tokens)
        return await serve(body, f"cmpl-{uuid.uuid4().hex}", prompt, params, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest) -> Response:
        check_model(body.model)
        tokenizer = engine.tokenizer
        if tokenizer is None or not tokenizer.chat_template:
            raise APIError(f"model {served_model_name!r} has no chat template; use /v1/completions", param="messages")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = sampling_params(body, engine.max_model_len if max_tokens is None else max_tokens)  # it stops there
        try:
            prompt = tokenizer.apply_chat_template([m.model_dump() for m in body.messages],
                                                   add_generation_prompt=True, tokenize=False)
        except Exception as error:  # the template's own checks (a role it does not know, ...)
            raise APIError(f"messages: the chat template failed: {error}", param="messages") from None
        return await serve(body, f"chatcmpl-{uuid.uuid4().hex}", prompt, params, chat=True)

    @app.get("/v1/models")
    async def models() -> dict:
        return dict(object="list", data=[dict(id=served_model_name, object="model", created=0,
                                              owned_by="nanoserve", max_model_len=engine.max_model_len)])

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.model_runner.healthy else 503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


class ServerThread:
    """Run an app under uvicorn in a background thread (tests, notebooks); `port=0` picks a free one."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
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

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description="nanoserve's OpenAI-compatible server")
    parser.add_argument("model")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--served-model-name", default=None, help="default: the model path")
    types = {"block_size": int, "num_kvcache_blocks": int, "max_num_seqs": int, "max_num_batched_tokens": int,
             "max_model_len": int, "dtype": str, "device": str, "attention_backend": str,
             "gpu_memory_utilization": float, "tensor_parallel_size": int}
    for name, type_ in types.items():  # Config's fields, default None: Config's own default
        parser.add_argument("--" + name.replace("_", "-"), type=type_, default=None)
    parser.add_argument("--no-prefix-caching", action="store_true")
    args = parser.parse_args()
    config = {name: getattr(args, name) for name in types if getattr(args, name) is not None}
    engine = LLMEngine(Config.from_kwargs(args.model, enable_prefix_caching=not args.no_prefix_caching, **config))
    app = build_app(engine, args.served_model_name or args.model, args.api_key)
    uvicorn.run(app, host=args.host, port=args.port)
    engine.close()  # stops tensor-parallel workers


if __name__ == "__main__":
    main()
