"""The OpenAI-compatible API's side of a request, before it reaches the engine.

This file holds the request bodies, how they are read and checked, the errors they get, and the
server's limits.

Bodies are strict, as OpenAI's API: "5" is not an int and true is not a number. A field left out or
null takes the default. Unknown fields are ignored (and logged). UNSUPPORTED ones are refused, unless
they hold the value that means "not used". Every error is an `APIError`: an HTTP status and OpenAI's
error body, naming the field at fault.
"""
from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Literal, TypeVar

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import ClientDisconnect

from nanoserve.entrypoints.engine_loop import EngineDeadError, EngineGenerateError
from nanoserve.sampling_params import MAX_LOGPROBS

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the server (docs/serving.md, "Limits"); past them, a 4xx at once."""
    max_body_bytes: int = 8 * 2**20                # 413 past this; the body is read no further
    max_stop: int = 32                             # stop strings, and stop_token_ids, per request
    max_stop_chars: int = 1024                     # characters in one stop string
    # Completions (prompts x n) in flight: tokenizing, waiting or running in the engine, not only queued.
    # More get 429. None: 4 x the engine's max_num_seqs (Serving.max_in_flight), a running batch and three
    # more waiting.
    max_num_queued_requests: int | None = None
    # Of those, what one client (its API key where the server takes several, else its address) may hold.
    # More get 429. None: 7/8 of max_num_queued_requests, so that one client cannot make 429s for the others.
    max_num_queued_requests_per_client: int | None = None
    max_n: int = 128                               # completions of one prompt (n): OpenAI's limit
    # Bytes of text in one request's prompts or messages together (at least what one prompt may hold).
    # Token ids in one /detokenize (at least max_model_len). Both bound one request's tokenizer time.
    max_request_prompt_bytes: int = 2**20
    max_detokenize_tokens: int = 2**16
    # Completions (prompts x n) of one request: twice max_n, one default engine batch (max_num_seqs 256).
    max_completions_per_request: int = 256
    # Seconds a stream may wait for its client to take a chunk (the socket's buffers full). Then its
    # connection is closed. So a client that stops reading holds no more than this.
    write_timeout: float = 30.0
    # Seconds a request's body may take to arrive, from its head on. A client that stops sending holds
    # its connection, and the bytes it sent, no longer than this (408).
    body_timeout: float = 30.0
    # Structured outputs (response_format, structured_outputs), checked before xgrammar sees them.
    # Bytes of the schema, regex, grammar or choices. Nesting of the schema, and of brackets in patterns,
    # regexes and grammars. Seconds a request waits for its grammar's compile (past it, a 400).
    max_grammar_bytes: int = 64 * 1024
    max_grammar_depth: int = 64
    max_grammar_compile_seconds: float = 10.0


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


def engine_error(error: Exception) -> APIError:
    """An AsyncLLM failure as the client sees it.

    Bad input (add_request's ValueError) is a 400 naming the field. A failed step or add_request is a 500.
    A dead engine loop is a 503."""
    if isinstance(error, EngineDeadError):
        return APIError(str(error), status=503)
    if isinstance(error, EngineGenerateError):
        return APIError(str(error), status=500)
    return APIError(str(error), param=getattr(error, "param", None))


ENGINE_ERRORS = (ValueError, EngineGenerateError, EngineDeadError)  # what AsyncLLM raises for a request


# --- Request bodies ------------------------------------------------------------------------------
# Strict (see above): a field left out or null takes the default.

class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(Strict):
    include_usage: bool | None = True  # as vLLM: stream_options without include_usage includes it


class JsonSchema(Strict):
    name: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")  # `schema` is a BaseModel attribute
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(Strict):
    """OpenAI's: {"type": "text"}, {"type": "json_object"}, or {"type": "json_schema", "json_schema": {...}}."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class StructuredOutputsBody(Strict):
    """vLLM's structured_outputs extra: one of these (StructuredOutputsParams)."""
    json_: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


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
    user: str | None = None  # OpenAI's end-user id: the client whose turns and share a request takes
    n: int | None = None     # completions of each prompt
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extras: repetition_penalty, min_p, min_tokens,
    min_p: float | None = None               # include_stop_str_in_output, structured_outputs
    logit_bias: dict[str, float] | None = None  # token id (as a string, as OpenAI sends it) -> bias in [-100, 100]
    min_tokens: int | None = None
    include_stop_str_in_output: bool | None = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None


class CompletionBody(SamplingBody):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool | None = None           # the prompt before the completion (its logprobs too, with logprobs)
    logprobs: int | None = None        # each token's logprob, with the N most likely
    prompt_logprobs: int | None = None  # vLLM's extra: each prompt token's, in the choice's prompt_logprobs


class ContentPart(Strict):
    type: str
    text: str | None = None


class FunctionCall(Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class MessageToolCall(Strict):
    """A call the assistant made, in a conversation sent back."""
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(Strict):
    role: str
    content: str | list[ContentPart] | None = None  # None: an assistant message that only calls tools
    tool_calls: list[MessageToolCall] | None = None  # the assistant's calls
    tool_call_id: str | None = None                  # a "tool" message: the call it answers
    name: str | None = None


class FunctionDefinition(Strict):
    name: str
    description: str | None = None
    parameters: dict | None = None  # a JSON schema; None: no parameters
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Strict):
    name: str


class NamedToolChoice(Strict):
    """tool_choice {"type": "function", "function": {"name": ...}}: that function is called."""
    type: Literal["function"]
    function: NamedFunction


class ChatBody(SamplingBody):
    messages: list[Message]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None       # each token's logprob
    top_logprobs: int | None = None    # and the N most likely (with logprobs true)
    tools: list[Tool] | None = None    # serving_tools.py
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None


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


class ResponsesTool(Strict):
    """The Responses API's function tool: the chat tool's function, flat."""
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ResponsesToolChoice(Strict):
    type: Literal["function"]
    name: str


class TextFormat(Strict):
    """The Responses API's text.format: {"type": "text"}, {"type": "json_object"}, or {"type": "json_schema",
    "name": ..., "schema": {...}} (response_format's json_schema, flat)."""
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(Strict):
    format: TextFormat | None = None


class ResponsesBody(Strict):
    """POST /v1/responses (serving_responses.py), stateless: `input` is the whole conversation."""
    model: str | None = None
    input: str | list[dict]  # a user message, or message, function_call and function_call_output items
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    text: TextConfig | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponsesToolChoice | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None  # refused: this server keeps no responses
    store: bool | None = None                # true refused, for the same reason
    background: bool | None = None           # true refused: every response is answered while the client waits
    max_tool_calls: int | None = None        # refused: a tool call is the model's to make or not (tool_choice)


BODIES = (CompletionBody, ChatBody, Message, ContentPart, StreamOptions, TokenizeBody, DetokenizeBody, ResponseFormat,
          JsonSchema, StructuredOutputsBody, FunctionCall, MessageToolCall, FunctionDefinition, Tool, NamedToolChoice,
          ResponsesBody, ResponsesTool, ResponsesToolChoice, TextConfig, TextFormat)
FIELDS = {field.alias or name for body in BODIES for name, field in body.model_fields.items()}  # as sent: "json"
# Fields this server does not support -> the values that mean "not used", which it accepts. A body that
# declares one of them (CompletionBody.echo) supports it.
UNSUPPORTED = {
    "n": (1, None), "best_of": (1, None), "logprobs": (None, False), "top_logprobs": (None, 0), "echo": (False, None),
    "prompt_logprobs": (None,), "suffix": (None, ""), "tools": (None, []), "tool_choice": (None, "none", "auto"),
    "functions": (None, []), "function_call": (None, "none", "auto"), "use_beam_search": (False, None),
}
BodyT = TypeVar("BodyT", bound=BaseModel)


async def read_json(request: Request, limits: Limits, max_values: int) -> dict:
    """The body as a JSON object.

    A 413 past limits.max_body_bytes (read no further) or past `max_values` commas. A 408 past
    limits.body_timeout. A 400 if it is no JSON object. json.loads holds the GIL while it builds the
    body's objects. That took ~0.1 s for 200,000 small lists, and every stream and /health waited. The
    commas are an upper bound on the values. Counting them first costs ~1 ms per MiB."""
    limit = limits.max_body_bytes
    too_large = APIError(f"the request body is larger than {limit} bytes, this server's limit", status=413)
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) > limit:
        raise too_large
    chunks, size = [], 0
    try:
        async with asyncio.timeout(limits.body_timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)
    except TimeoutError:
        raise APIError(f"the request body took over {limits.body_timeout} s to arrive, this server's limit "
                       f"(--body-timeout)", status=408) from None
    except ClientDisconnect:  # one line, not the ASGI stack's traceback: a client may leave whenever it likes
        logger.info("a client left while sending its request body (%d bytes)", size)
        raise APIError("the client left while sending its request body") from None
    raw = b"".join(chunks)
    if raw.count(b",") > max_values:
        raise APIError(f"the request body has more than {max_values} values (commas), more than one request can "
                       "use on this server", status=413)
    try:
        body = json.loads(raw)
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


def given(value: T | None, default: T) -> T:
    return default if value is None else value


def check_logprobs(field: str, value: int | None) -> None:
    """A number of most likely tokens (logprobs, top_logprobs, prompt_logprobs): None, or 0 to MAX_LOGPROBS."""
    if value is not None and value > MAX_LOGPROBS:  # vLLM's words
        raise APIError(f"Requested {field} of {value}, which is greater than max allowed: {MAX_LOGPROBS}", param=field)
    if value is not None and value < 0:
        raise APIError(f"{field} must be from 0 to {MAX_LOGPROBS}; got {value}", param=field)
