"""/v1/chat/completions: messages formatted by the tokenizer's chat template, as LLM.chat does.

chat_api.py's `ChatAPI` formats the choices: the assistant's message, a role chunk first when streamed,
and OpenAI's chat logprobs. With tools, serving_tools.py's ToolChatAPI formats them instead.
`create_chat_completion` is the route's handler.
"""
from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import Response

from nanoserve.entrypoints.openai.chat_api import template_messages
from nanoserve.entrypoints.openai.protocol import ChatBody, parse, read_json
from nanoserve.entrypoints.openai.serving_engine import Prompt, Serving
from nanoserve.entrypoints.openai.serving_tools import check_tool_schemas, prepare_tools, template_tools
from nanoserve.entrypoints.openai.streaming import Answer, generate_response


async def create_chat_completion(request: Request) -> Response:
    arrival_time = time.perf_counter()
    serving: Serving = request.app.state.serving
    body = parse(ChatBody, await read_json(request, serving.limits, serving.max_body_values))
    return await serve_chat(serving, request, body, arrival_time)


async def serve_chat(serving: Serving, request: Request, body: ChatBody, arrival_time: float,
                     answer: Answer | None = None) -> Response:
    """A parsed chat body's response; /v1/responses' too, in its own shape (`answer`)."""
    serving.check_chat_template()
    messages = template_messages(body.messages)
    serving.check_request_bytes([m["content"] for m in messages], "messages")
    body, api = prepare_tools(body, serving.tool_call_parser)
    tools = template_tools(body)

    def prepare() -> list[Prompt]:  # as LLM.chat: the template wrote the special tokens (<s>)
        check_tool_schemas(body.tools, serving.limits)
        text = serving.render_chat(messages, tools=tools)
        return [Prompt(serving.tokenize(text, "messages", add_special_tokens=False))]
    return await generate_response(serving, request, api, body, 1, prepare, arrival_time, answer)

