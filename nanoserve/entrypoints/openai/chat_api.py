"""/v1/chat/completions' choices.

`ChatAPI` formats the assistant's message, a role chunk first when streamed, and OpenAI's chat logprobs.
serving_tools.py's ToolChatAPI builds on it. serving_chat.py's route picks one of them.
"""
from __future__ import annotations

from nanoserve import RequestDelta, RequestOutput
from nanoserve.entrypoints.openai.protocol import APIError, ChatBody, check_logprobs, given
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
