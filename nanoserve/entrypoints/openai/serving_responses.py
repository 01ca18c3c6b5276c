"""POST /v1/responses: OpenAI's Responses API, stateless, served by the chat completions' machinery.

A Responses body becomes a chat body (`chat_body`), field by field.
- `instructions` becomes a system message, first.
- `input` becomes the messages. A string is one user message. A list holds message items, the
  assistant's function_call items, and function_call_output items (as "tool" messages).
- max_output_tokens becomes max_tokens, and text.format becomes response_format.
- The flat function tools become chat tools, read as serving_tools.py reads them.

The chat body is served as one chat choice (serving_chat.serve_chat). `answer` gives the result the
Responses API's shape. A whole response is a `response` object. Its `output` holds a `message` item
(its text as `output_text`) and a `function_call` item per call. A stream is the events that the openai
client's stream helper reads:

    response.created, response.in_progress
    response.output_item.added (message) -> response.content_part.added -> response.output_text.delta ...
    response.output_item.added (function_call) -> response.function_call_arguments.delta ...
    at the end, per item: response.output_text.done, response.content_part.done / response.function_call_arguments.done,
    then response.output_item.done; last response.completed (its status "incomplete" past max_output_tokens)

Stateless: nothing is stored, so previous_response_id and store=true are refused (400). The client sends
the whole conversation each time: `input` plus the last response's `output` items.
"""
from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from functools import partial

from fastapi import Request
from fastapi.responses import Response

from nanoserve import RequestOutput
from nanoserve.entrypoints.openai.chat_api import ChatAPI
from nanoserve.entrypoints.openai.protocol import (
    APIError,
    ChatBody,
    ResponsesBody,
    ResponsesToolChoice,
    parse,
    read_json,
    shorten,
)
from nanoserve.entrypoints.openai.serving_chat import serve_chat
from nanoserve.entrypoints.openai.serving_engine import Serving
from nanoserve.entrypoints.openai.streaming import EventStream, Generation

TEXT_PART_TYPES = ("input_text", "output_text", "text")  # a message's text parts, whoever wrote them


async def create_response(request: Request) -> Response:
    arrival_time = time.perf_counter()
    serving: Serving = request.app.state.serving
    body = parse(ResponsesBody, await read_json(request, serving.limits, serving.max_body_values))
    try:
        return await serve_chat(serving, request, chat_body(body), arrival_time, partial(answer, body=body))
    except APIError as error:
        raise responses_error(error) from None


# The chat fields a Responses body gives under other names: an error names the field the client sent.
RESPONSES_FIELDS = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text"}


def responses_error(error: APIError) -> APIError:
    """A chat request's error as a Responses client reads it.

    Its param and the field names in its message become the Responses body's. That is `input`, not
    `messages`, and `max_output_tokens`, not `max_tokens`."""
    message = error.message
    for chat_name, name in RESPONSES_FIELDS.items():
        message = re.sub(rf"\b{chat_name}\b", name, message)
    return APIError(message, param=RESPONSES_FIELDS.get(error.param, error.param), status=error.status,
                    code=error.code)


# --- The request, as a chat body -------------------------------------------------------------------

def chat_body(body: ResponsesBody) -> ChatBody:
    """The chat body that serves this Responses body; a 400 names the Responses field at fault."""
    if body.previous_response_id is not None:
        raise APIError("previous_response_id is not supported: this server stores no responses; send the whole "
                       "conversation in input", param="previous_response_id")
    if body.store:
        raise APIError("store=true is not supported: this server stores no responses; send store=false",
                       param="store")
    if body.background:
        raise APIError("background=true is not supported: this server answers while the client waits",
                       param="background")
    if body.max_tool_calls is not None:
        raise APIError("max_tool_calls is not supported by this server; bound the calls with tool_choice or "
                       "parallel_tool_calls", param="max_tool_calls")
    system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    chat = dict(model=body.model, messages=system + input_messages(body.input), max_tokens=body.max_output_tokens,
                temperature=body.temperature, top_p=body.top_p, stream=body.stream,
                parallel_tool_calls=body.parallel_tool_calls)
    if body.tools:
        chat["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                         for tool in body.tools]
    if isinstance(body.tool_choice, ResponsesToolChoice):
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    elif body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice
    text_format = body.text.format if body.text is not None else None
    if text_format is not None and text_format.type == "json_schema":
        if text_format.schema_ is None:
            raise APIError("text.format of type json_schema needs a schema", param="text")
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": text_format.name,
                                                                          "schema": text_format.schema_}}
    elif text_format is not None:
        chat["response_format"] = {"type": text_format.type}
    try:
        return parse(ChatBody, chat)
    except APIError as error:  # what reached the messages came from input
        raise APIError(error.message, param="input" if error.param == "messages" else error.param) from None


def input_messages(items: str | list[dict]) -> list[dict]:
    """`input` as chat messages: a string is one user message.

    function_call items join the assistant message before them, or make one. function_call_output items are
    "tool" messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(f"input.{i}.role must be user, assistant, system or developer; got "
                               f"{shorten(repr(role))}", param="input")
            role = "system" if role == "developer" else role  # chat templates know system
            messages.append({"role": role, "content": item_text(item.get("content"), i)})
        elif kind == "function_call":
            function = {"name": item_string(item, "name", i), "arguments": item_string(item, "arguments", i)}
            call = {"id": item_string(item, "call_id", i), "type": "function", "function": function}
            if not messages or messages[-1]["role"] != "assistant":
                messages.append({"role": "assistant", "content": None})
            messages[-1].setdefault("tool_calls", []).append(call)
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item_string(item, "call_id", i),
                             "content": item_string(item, "output", i)})
        else:
            raise APIError(f"input.{i}.type {shorten(repr(kind))} is not supported (message, function_call, "
                           "function_call_output)", param="input")
    return messages


def item_text(content: object, i: int) -> str:
    """A message item's content: a string, or text parts joined by newlines."""
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) else [None]
    if not all(isinstance(p, dict) and p.get("type") in TEXT_PART_TYPES and isinstance(p.get("text"), str)
               for p in parts):
        raise APIError(f"input.{i}.content must be a string or text parts ({{'type': 'input_text', 'text': ...}})",
                       param="input")
    return "\n".join(p["text"] for p in parts)


def item_string(item: dict, key: str, i: int) -> str:
    if not isinstance(item.get(key), str):
        raise APIError(f"input.{i}.{key} must be a string", param="input")
    return item[key]


# --- The answer ------------------------------------------------------------------------------------

async def answer(generation: Generation, api: ChatAPI, head: dict, body: ResponsesBody) -> Response:
    """The response object, or its stream of events."""
    if body.stream:
        return EventStream(generation, api, head, False, events=response_events(generation, api, head, body))
    outputs = [result async for _, result in generation.results() if isinstance(result, RequestOutput)]
    choice = api.choice(0, api.show(0, outputs[0]))
    message = choice["message"]
    items = [message_item(message["content"])] if message["content"] else []
    items += [call_item(call["id"], call["function"]["name"], call["function"]["arguments"])
              for call in message.get("tool_calls", [])]
    # json.dumps' ASCII escapes keep a lone surrogate echoed from the body ("\ud800" in a tool's description)
    # as JSON, as it came. JSONResponse's UTF-8 could not encode it (a 500).
    return Response(json.dumps(response_object(body, head, items, choice["finish_reason"], api.usage(outputs))),
                    media_type="application/json")


def message_item(text: str, status: str = "completed") -> dict:
    content = [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
    return dict(id=f"msg_{uuid.uuid4().hex}", type="message", role="assistant", status=status, content=content)


def call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return dict(id=f"fc_{uuid.uuid4().hex}", type="function_call", call_id=call_id, name=name, arguments=arguments,
                status=status)


def response_object(body: ResponsesBody, head: dict, output: list[dict], finish_reason: str | None,
                    usage: dict | None) -> dict:
    """OpenAI's `response`; finish_reason None: still in progress, "length": incomplete (max_output_tokens)."""
    status = "in_progress" if finish_reason is None else "incomplete" if finish_reason == "length" else "completed"
    incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
    text_format = body.text.format if body.text is not None and body.text.format is not None else None
    tool_choice = body.tool_choice if body.tool_choice is not None else "auto"
    if usage is not None:
        usage = dict(input_tokens=usage["prompt_tokens"], input_tokens_details={"cached_tokens": 0},
                     output_tokens=usage["completion_tokens"], output_tokens_details={"reasoning_tokens": 0},
                     total_tokens=usage["total_tokens"])
    return dict(id=f"resp_{head['id'].split('-')[-1]}", object="response", created_at=head["created"],
                model=head["model"], status=status, output=output, error=None, incomplete_details=incomplete,
                instructions=body.instructions, max_output_tokens=body.max_output_tokens, metadata={},
                parallel_tool_calls=body.parallel_tool_calls is not False, previous_response_id=None, store=False,
                temperature=body.temperature, top_p=body.top_p,
                tool_choice=tool_choice if isinstance(tool_choice, str) else tool_choice.model_dump(),
                tools=[tool.model_dump(exclude_none=True) for tool in body.tools or []],
                text={"format": text_format.model_dump(by_alias=True, exclude_none=True) if text_format else
                      {"type": "text"}}, usage=usage)


class ResponseEvents:
    """A streamed response's events so far: the open message item's text, each call item's arguments."""

    def __init__(self) -> None:
        self.sequence_number = 0
        self.items: list[dict] = []      # output items, in output_index order, as they stand
        self.message: dict | None = None  # the message item, once content came
        self.calls: dict[int, dict] = {}  # tool call index -> its item

    def event(self, kind: str, **fields: object) -> str:
        data = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def add_content(self, text: str) -> list[str]:
        events = []
        if self.message is None:
            self.message = message_item("", status="in_progress")
            self.items.append(self.message)
            events.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                                     item={**self.message, "content": []}))
            events.append(self.event("response.content_part.added", item_id=self.message["id"],
                                     output_index=len(self.items) - 1, content_index=0,
                                     part={"type": "output_text", "text": "", "annotations": []}))
        self.message["content"][0]["text"] += text
        events.append(self.event("response.output_text.delta", item_id=self.message["id"],
                                 output_index=self.items.index(self.message), content_index=0, delta=text,
                                 logprobs=[]))
        return events

    def add_call(self, delta: dict) -> list[str]:
        """A chat stream's tool_calls delta: the first of a call opens its item."""
        events = []
        if delta["index"] not in self.calls:
            item = call_item(delta["id"], delta["function"]["name"], "", status="in_progress")
            self.calls[delta["index"]] = item
            self.items.append(item)
            events.append(self.event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item)))
        item = self.calls[delta["index"]]
        piece = delta["function"].get("arguments", "")
        if piece:
            item["arguments"] += piece
            events.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                     output_index=self.items.index(item), delta=piece))
        return events

    def finish(self) -> list[str]:
        """Each item's closing events, in output order."""
        events = []
        for output_index, item in enumerate(self.items):
            item["status"] = "completed"
            if item["type"] == "message":
                part = item["content"][0]
                ids = dict(item_id=item["id"], output_index=output_index, content_index=0)
                events.append(self.event("response.output_text.done", **ids, text=part["text"], logprobs=[]))
                events.append(self.event("response.content_part.done", **ids, part=part))
            else:
                events.append(self.event("response.function_call_arguments.done", item_id=item["id"],
                                         output_index=output_index, name=item["name"], arguments=item["arguments"]))
            events.append(self.event("response.output_item.done", output_index=output_index, item=item))
        return events


async def response_events(generation: Generation, api: ChatAPI, head: dict, body: ResponsesBody) -> AsyncIterator[str]:
    """The Responses stream: the chat choice's deltas (api.chunk_choice) as the Responses API's events. A
    failure mid-stream is an "error" event, as OpenAI sends it."""
    events = ResponseEvents()
    started = response_object(body, head, [], None, None)
    yield events.event("response.created", response=started)
    yield events.event("response.in_progress", response=started)
    outputs, finish_reason = [], None
    try:
        async for _, result in generation.results():
            if isinstance(result, RequestOutput):
                outputs.append(result)
                continue
            shown = api.show(0, result)
            chunk = api.chunk_choice(0, shown) if shown.text or shown.finish_reason else None
            if chunk is None:
                continue
            finish_reason = chunk["finish_reason"] or finish_reason
            if chunk["delta"].get("content"):
                for event in events.add_content(chunk["delta"]["content"]):
                    yield event
            for delta in chunk["delta"].get("tool_calls", []):
                for event in events.add_call(delta):
                    yield event
    except APIError as chat_error:
        error = responses_error(chat_error)
        yield events.event("error", code=error.code, message=error.message, param=error.param)
        return
    for event in events.finish():
        yield event
    final = response_object(body, head, events.items, finish_reason or "stop", api.usage(outputs))
    # response.completed even when the response is incomplete (its status says so), as vLLM sends it.
    # The openai client's stream helper ends only with it (get_final_response).
    yield events.event("response.completed", response=final)
