"""/v1/chat/completions' choices.

`ChatAPI` formats the assistant's message, a role chunk first when streamed, and OpenAI's chat logprobs.
serving_tools.py's ToolChatAPI builds on it. serving_chat.py's route picks one of them.
`template_messages` turns a body's messages into what chat templates take.
"""
from __future__ import annotations

import json

from nanoserve import RequestDelta, RequestOutput
from nanoserve.entrypoints.openai.protocol import (
    APIError,
    ChatBody,
    ContentPart,
    Message,
    MessageToolCall,
    check_logprobs,
    given,
    shorten,
)
from nanoserve.entrypoints.openai.serving_engine import Formatter, Prompt, Shown, TokenStrings, clamp
from nanoserve.sampler import Logprob


class ChatAPI(Formatter):
    """/v1/chat/completions' response and chunk choices."""
    id_prefix, object, chunk_object, prompt_field = "chatcmpl", "chat.completion", "chat.completion.chunk", "messages"

    def __init__(self, body: ChatBody, prompts: list[Prompt], n: int, strings: TokenStrings) -> None:
        super().__init__(body, prompts, n, strings)
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
        logprobs = result.logprobs
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


def template_messages(messages: list[Message]) -> list[dict]:
    """Messages as chat templates take them.

    Content given as a list of text parts is joined by newlines (as vLLM does). An assistant's tool_calls
    and a tool message's tool_call_id go along."""
    result = []
    for i, m in enumerate(messages):
        if m.content is None and not m.tool_calls:
            raise APIError(f"messages.{i}.content: Field required", param="messages")
        parts = [ContentPart(type="text", text=m.content or "")] if not isinstance(m.content, list) else m.content
        if any(p.type != "text" or p.text is None for p in parts):
            raise APIError(f"messages.{i}.content: only text parts ({{'type': 'text', 'text': ...}}) are supported",
                           param="messages")
        message = {"role": m.role, "content": "\n".join(p.text for p in parts)}
        if m.tool_calls:
            message["tool_calls"] = [template_tool_call(call) for call in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        result.append(message)
    return result


def template_tool_call(call: MessageToolCall) -> dict:
    """A call as transformers' chat templates take it: the arguments as a dict, as vLLM passes them.

    Templates write the arguments with tojson, so a string would be quoted twice. Arguments that are no
    JSON object stay text."""
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        arguments = call.function.arguments
    except RecursionError:  # nested past Python's limit ("[" * 5000): was a 500
        raise APIError(f"a tool call's arguments nest too deep for this server (call {shorten(repr(call.id))})",
                       param="messages") from None
    function = {"name": call.function.name, "arguments": arguments}
    return {"id": call.id, "type": "function", "function": function}

