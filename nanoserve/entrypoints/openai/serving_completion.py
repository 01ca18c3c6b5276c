"""/v1/completions: a prompt (a string or token ids) or a list of them, n completions of each.

`CompletionAPI` formats the choices. It shows the text, or token ids without a tokenizer. It shows echo:
the prompt first, or alone with max_tokens 0. It shows logprobs as OpenAI's completions write them, and
vLLM's prompt_logprobs. `create_completion` is the route's handler.
"""
from __future__ import annotations

import collections
import itertools
import time

from fastapi import Request
from fastapi.responses import Response

from nanoserve import RequestDelta, RequestOutput
from nanoserve.entrypoints.openai.protocol import APIError, CompletionBody, check_logprobs, given, parse, read_json
from nanoserve.entrypoints.openai.serving_engine import (
    Formatter,
    Prompt,
    Serving,
    Shown,
    TokenStrings,
    clamp,
    text_or_token_ids,
)
from nanoserve.entrypoints.openai.streaming import generate_response
from nanoserve.sampler import Logprob


class CompletionAPI(Formatter):
    """/v1/completions' response and chunk choices."""
    id_prefix, object, chunk_object, prompt_field = "cmpl", "text_completion", "text_completion", "prompt"

    def __init__(self, body: CompletionBody, prompts: list[Prompt], n: int, strings: TokenStrings) -> None:
        super().__init__(body, prompts, n, strings)
        self.echo, self.echo_only = bool(body.echo), bool(body.echo) and body.max_tokens == 0
        self.num_top, self.show_prompt_logprobs = body.logprobs, body.prompt_logprobs is not None
        self.echoed: set[int] = set()                          # choices whose prompt was shown
        # A streamed choice's text_offset so far: the length of its token strings sent, as the whole
        # response counts them. It is not its text's length: "<s>" is a token string, not text.
        self.num_chars: dict[int, int] = collections.Counter()

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
        """The completion: a whole output, or a streamed delta.

        With echo, the prompt comes first (in a choice's first chunk), or alone with max_tokens 0."""
        if isinstance(result, RequestOutput):
            completion = result.outputs[0]
            text, token_ids, logprobs, finish_reason = (completion.text, completion.token_ids, completion.logprobs,
                                                        completion.finish_reason)
        else:
            text, token_ids, finish_reason = result.text, result.token_ids, result.finish_reason
            logprobs = result.logprobs
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
        if logprobs is not None:
            self.num_chars[index] += sum(map(len, logprobs["tokens"]))
        return dict(index=index, **text_or_token_ids(shown.text, shown.token_ids), logprobs=logprobs,
                    finish_reason=shown.finish_reason)

    def logprobs_object(self, shown: Shown, offset: int) -> dict | None:
        """OpenAI's completions logprobs, as vLLM writes them.

        Per token: its string, its logprob, and top_logprobs {string: logprob}. A prompt's first token has
        None. top_logprobs holds the token's own, then the num_top most likely: num_top or num_top + 1
        entries. Tokens whose strings coincide share an entry. text_offset says where a token's string
        starts, after the strings before it. It counts from `offset`, the token strings a stream sent
        before. So a stream's chunks' offsets, end to end, are the whole response's."""
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


def prompt_list(prompt: str | list[int] | list[str] | list[list[int]]) -> list[str | list[int]]:
    """One prompt (a string or a list of token ids) or a list of them -> a list of prompts; none empty."""
    if not prompt:
        raise APIError("prompt is empty", param="prompt")
    prompts = [prompt] if isinstance(prompt, str) or isinstance(prompt[0], int) else prompt
    empty = next((i for i, p in enumerate(prompts) if not p), None)
    if empty is not None:
        raise APIError(f"prompt {empty} is empty", param="prompt")
    return prompts


def check_num_prompts(prompt: object, limit: int) -> None:
    """Refuse more prompts than one request may have completions, before the body is validated.

    Checking 200,000 prompts alone held the event loop for over a second."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)) and len(prompt) > limit:
        raise APIError(f"{len(prompt)} prompts, more than this server completes in one request ({limit}, "
                       f"--max-completions-per-request)", param="prompt")


async def create_completion(request: Request) -> Response:
    arrival_time = time.perf_counter()  # TTFT, queue time and latency count from the HTTP request's arrival
    serving: Serving = request.app.state.serving
    raw = await read_json(request, serving.limits, serving.max_body_values)
    check_num_prompts(raw.get("prompt"), serving.limits.max_completions_per_request)
    body = parse(CompletionBody, raw)
    prompts = prompt_list(body.prompt)
    serving.check_request_bytes([p for p in prompts if isinstance(p, str)], "prompt")

    def prepare() -> list[Prompt]:  # token ids are checked by add_request
        return [Prompt(p, serving.decode(p) if body.echo else None) if isinstance(p, list)
                else Prompt(serving.tokenize(p, "prompt"), p) for p in prompts]
    return await generate_response(serving, request, CompletionAPI, body, len(prompts), prepare, arrival_time)

