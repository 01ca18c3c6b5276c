"""A completions or chat request from its checked body to its response, whole or streamed, and what
happens when its client leaves.

`generate_response` takes the request's slots (a `Generation`, or 429 at once). It tokenizes the
prompts in the tokenizer thread and submits the choices to the AsyncLLM. Then it answers with one JSON
response (`whole_response`), or with server-sent events (`EventStream`, one chunk per delta).

A client that leaves is noticed on the event loop, streaming or not (`EventStream`, `until_disconnected`).
That closes the generation: its engine requests are aborted, so their KV blocks are free before the
next step. A client that stays but stops reading a stream is cut off after Limits.write_timeout seconds
without progress. Its slots of the in-flight bound came back already, as the engine finished its requests.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from nanoserve import RequestDelta, RequestOutput, SamplingParams
from nanoserve.entrypoints.openai.protocol import ENGINE_ERRORS, APIError, SamplingBody, engine_error
from nanoserve.entrypoints.openai.sampling_body import grammar_field, sampling_params
from nanoserve.entrypoints.openai.serving_engine import (
    API,
    Formatter,
    Prompt,
    Serving,
    Shown,
    client_of,
)

logger = logging.getLogger(__name__)


class Generation:
    """The engine requests of one HTTP request (n per prompt, one per choice).

    They are submitted and read back together through one RequestStream. A Generation takes its choices'
    slots of the in-flight bound at creation. It gives each slot back when the engine has finished its
    request, with its final reply read or not. So a client that does not read holds no slot past that.
    If the requests were never submitted, the slots come back at `close()`.
    The handler calls close() however the request ends. close() aborts the engine requests not finished."""

    def __init__(self, serving: Serving, num_choices: int, grammar_field: str = "structured_outputs",
                 client: str = "") -> None:
        serving.admit(num_choices, client)
        self.serving, self.num_choices, self.closed, self.client = serving, num_choices, False, client
        self.grammar_field = grammar_field  # the body's field that a grammar's error names
        self.id = uuid.uuid4().hex
        self.stream = serving.async_llm.stream(on_finished=self.release, client=client)
        self.index: dict[str, int] = {}  # engine request id -> its choice's index
        self.holding: set[str] = set()   # submitted requests whose slots this generation still holds

    async def submit(self, prompts: list[tuple[list[int], SamplingParams]], arrival_time: float) -> None:
        """Hand every prompt's n requests to the engine loop; raise the first refusal (add_request's 400).

        Sample i is seeded seed + i (as vLLM; choice p * n + i)."""
        requests = [(token_ids, params.for_sample(i)) for token_ids, params in prompts for i in range(params.n)]
        self.index = {f"{self.id}-{index}": index for index in range(len(requests))}
        assert len(requests) == self.num_choices, "admit took one slot per request"
        self.holding = set(self.index)
        try:
            await self.stream.submit([(request_id, token_ids, params)
                                      for request_id, (token_ids, params) in zip(self.index, requests)], arrival_time)
        except ENGINE_ERRORS as error:
            raise self.api_error(error) from None

    async def results(self) -> AsyncIterator[tuple[int, RequestDelta | RequestOutput]]:
        """(choice index, delta or final output), as they come; raises a failure of the engine."""
        try:
            async for result in self.stream:
                yield self.index[result.request_id], result
        except ENGINE_ERRORS as error:
            raise self.api_error(error) from None

    def api_error(self, error: Exception) -> APIError:
        """engine_error, naming the body's grammar field (response_format or structured_outputs) as sent."""
        api_error = engine_error(error)
        if api_error.param == "structured_outputs":
            api_error.param = self.grammar_field
        return api_error

    def release(self, request_id: str) -> None:
        """The engine has finished a request (on the event loop, as its final reply arrives): its slot is free."""
        if request_id in self.holding:
            self.holding.discard(request_id)
            self.serving.release(self.client)

    def close(self) -> None:
        """Abort what is not finished; their slots come back with their aborted outputs."""
        if not self.closed:
            self.closed = True
            self.stream.close()
            if not self.index:  # never submitted (refused while tokenizing, or the client left): nothing will reply
                self.serving.release(self.client, self.num_choices)


# Makes a response of another API's shape from a submitted generation (see generate_response).
Answer = Callable[[Generation, Formatter, dict], Awaitable[Response]]


async def generate_response(serving: Serving, request: Request, api: API, body: SamplingBody, num_prompts: int,
                            prepare: Callable[[], list[Prompt]], arrival_time: float,
                            answer: Answer | None = None) -> Response:
    """Serve a completions or chat request whose prompts `prepare` tokenizes (in the tokenizer thread).

    `answer`, if given, makes the response from the submitted generation instead. It gives another API's
    shape over the same choices (serving_responses.py). A stream it answers is an EventStream."""
    serving.check_model(body.model)
    max_tokens = api.max_tokens(body)
    params = sampling_params(body, api, max_tokens, serving.limits)
    if body.stream_options is not None and not body.stream:
        raise APIError("stream_options is only for stream=true", param="stream_options")
    client = client_of(request)
    generation = Generation(serving, num_prompts * params.n, grammar_field(body), client)  # takes its slots, or 429

    async def start() -> Response:
        prompts = await serving.in_tokenizer_thread(prepare, client)
        if params.structured_outputs is not None:  # compiled before the engine sees it: a bad one is a 400
            await serving.compile_grammar(params.structured_outputs, grammar_field(body), client)
        # the field the client sent: a chat body's max_completion_tokens, else max_tokens
        tokens_field = "max_completion_tokens" if getattr(body, "max_completion_tokens", None) is not None \
            else "max_tokens"
        fitted = [serving.fit_to_context(params, max_tokens, len(p.token_ids), api.prompt_field, tokens_field)
                  for p in prompts]
        await generation.submit([(p.token_ids, f) for p, f in zip(prompts, fitted)], arrival_time)
        formatter = api(body, prompts, params.n, serving.token_strings)
        head = dict(id=f"{api.id_prefix}-{generation.id}", object=api.chunk_object if body.stream else api.object,
                    created=int(time.time()), model=serving.model_name)
        if answer is not None:
            return await answer(generation, formatter, head)
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


async def whole_response(generation: Generation, api: Formatter, head: dict) -> TimedResponse:
    outputs = {index: result async for index, result in generation.results() if isinstance(result, RequestOutput)}
    shown = {index: api.show(index, outputs[index]) for index in sorted(outputs)}
    usage = api.usage(list(outputs.values()))
    timeout = generation.serving.limits.write_timeout
    return TimedResponse(json_body(api, head, shown, usage), "application/json", timeout)


async def json_body(api: Formatter, head: dict, shown: dict[int, Shown], usage: dict) -> AsyncIterator[str]:
    """A whole response's JSON, one choice at a time, yielding to the event loop between them.

    Built and serialized in one go, 128 choices with 20 logprobs each (46 MB) held the event loop for 4.85 s.
    Every other client waited, and /health too. A worker thread would not help: building and json.dumps
    hold the GIL."""
    yield json.dumps(head)[:-1] + ', "choices": ['
    for i, (index, choice_shown) in enumerate(shown.items()):
        yield ("," if i else "") + json.dumps(api.choice(index, choice_shown))
        await asyncio.sleep(0)  # let every other client in
    yield '], "usage": ' + json.dumps(usage) + "}"


async def event_stream(generation: Generation, api: Formatter, head: dict,
                       include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: a chunk per delta with text or logprobs, the usage if asked, then [DONE].

    A failure mid-stream is an error event (OpenAI's error body) before [DONE]. The 200 was sent long ago."""
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
                choice = api.chunk_choice(index, shown)
                if choice is not None:  # None: the formatter holds it back too (a tool call's tag, half read)
                    yield sse({**head, "choices": [choice]})
        if include_usage:
            yield sse({**head, "choices": [], "usage": api.usage(outputs)})
    except APIError as error:
        yield sse(error.body)
    except Exception as error:  # a bug here: still an error event, then [DONE]
        logger.exception("a stream failed")
        yield sse(APIError(f"the stream failed: {error!r}", status=500).body)
    yield "data: [DONE]\n\n"


class WriteTimeout(Exception):
    """The client took no chunk for write_timeout seconds."""


class TimedResponse(StreamingResponse):
    """A response sent a chunk at a time, each within write_timeout seconds.

    A client that stays connected but does not read makes `send` wait. That is uvicorn's flow control,
    once the socket's buffers are full. After write_timeout seconds of that, the response ends unfinished
    and uvicorn closes the connection. Whole replies need it as much as streams: seven unread n=128
    replies held 427 MB past three timeouts."""

    def __init__(self, content: AsyncIterator[str] | list[str], media_type: str, write_timeout: float) -> None:
        super().__init__(content, media_type=media_type)
        self.write_timeout = write_timeout

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        async def send_or_give_up(message: dict) -> None:
            try:
                await asyncio.wait_for(send(message), self.write_timeout)
            except TimeoutError:
                raise WriteTimeout() from None
        try:
            await super().__call__(scope, receive, send_or_give_up)
        except WriteTimeout:  # returning unfinished: uvicorn closes the connection
            logger.warning("closing a response whose client took nothing for %s s", self.write_timeout)


class EventStream(TimedResponse):
    """A streamed request's response.

    A client disconnect reaches the engine because Starlette cancels the response. Its
    listen_for_disconnect task sees http.disconnect, and cancels the task that runs the event_stream
    generator. Whenever that happens, __call__'s `finally` closes the generation, which aborts its engine
    requests. That holds even before the generator has started, when its own `finally` would never run.
    A client that does not read is cut off after write_timeout seconds (TimedResponse)."""

    def __init__(self, generation: Generation, api: Formatter, head: dict, include_usage: bool,
                 events: AsyncIterator[str] | None = None) -> None:  # events: another API's (serving_responses.py)
        events = event_stream(generation, api, head, include_usage) if events is None else events
        super().__init__(events, "text/event-stream", generation.serving.limits.write_timeout)
        self.generation = generation

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.generation.close()


async def until_disconnected(request: Request, work: Awaitable[Response]) -> Response:
    """`work`'s response, unless the client disconnects first.

    Then `work` is cancelled, and the handler's generation.close() aborts its engine requests. So a client
    that gave up costs no more tokens. Starlette does not cancel a handler whose client left. For a stream,
    see EventStream."""
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


def sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"

