"""What /v1/completions and /v1/chat/completions share.

They share the served model, its tokenizer thread and the slots of --max-num-queued-requests.
They also share how prompts are fitted to the context, and how results become choices.

`Serving` is the app's state (app.state.serving). It holds the AsyncLLM (async_llm.py), whose engine
thread alone calls the engine. It holds the tokenizer thread, which tokenizes and renders chat templates.
So neither the event loop nor the engine thread waits on a long input. Clients take turns in that thread
(tokenizer_thread.py). It holds the metrics too. Handlers never call the engine. They use its tokenizer
(from the tokenizer thread) and its constants.

An HTTP request's choices are n completions of each prompt. Choice p * n + i is completion i of
prompt p (as vLLM), and each is its own engine request. A `Generation` (streaming.py) submits them
together and reads them back together. Once the prompts are tokenized, the handler makes its API's
`Formatter` (serving_completion.py, serving_chat.py). The Formatter turns each result into what its
choice shows (`Shown`), then into the API's JSON. A result is a RequestOutput for a whole response,
or a RequestDelta for a stream.
"""
from __future__ import annotations

import asyncio
import collections
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TypeVar

from fastapi import Request

from nanoserve import LLMEngine, RequestDelta, RequestOutput, SamplingParams
from nanoserve.entrypoints.async_llm import AsyncLLM
from nanoserve.entrypoints.openai.metrics import Metrics
from nanoserve.entrypoints.openai.protocol import APIError, Limits, SamplingBody, given, shorten
from nanoserve.entrypoints.tokenizer_thread import TokenizerThread
from nanoserve.extensions.structured_outputs import StructuredOutputsParams
from nanoserve.sampler import Logprob
from nanoserve.sampling_params import InvalidRequest

T = TypeVar("T")


@dataclass
class Prompt:
    """A prompt as the engine takes it, and as echo shows it.

    Echo shows a string as given, and token ids decoded (as vLLM). The text is None without a tokenizer."""
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


class TokenStrings:
    """Each token's text alone, as logprobs name tokens.

    A token's text is tokenizer.decode([id]), as vLLM ("<s>", " sky", "\ufffd" for one byte of a longer
    character). Without a tokenizer it is "token_id:N" (vLLM's return_tokens_as_token_ids).
    Every token the model can sample is decoded once, when the server starts. That is one batch_decode
    (0.07 s for the bundled model's 4,096 tokens). Later lookups happen on the event loop. So logprobs never
    wait for the tokenizer thread, which a long prompt may hold for seconds."""

    def __init__(self, tokenizer: object | None, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        # ids from the model's vocabulary and the tokenizer's (added tokens may lie past the model's rows)
        num_tokens = max(vocab_size, len(tokenizer)) if tokenizer is not None else 0
        self.strings: list[str] = tokenizer.batch_decode([[t] for t in range(num_tokens)]) if num_tokens else []

    def __getitem__(self, token_id: int) -> str:
        return self.strings[token_id] if self.tokenizer is not None else f"token_id:{token_id}"


def clamp(logprob: float) -> float:
    """A logprob as JSON can hold it: -inf (a token ruled out) as OpenAI and vLLM write it."""
    return max(logprob, -9999.0)


def text_or_token_ids(text: str | None, token_ids: list[int]) -> dict:
    """A model without a tokenizer answers token ids, with an empty text."""
    return {"text": text} if text is not None else {"text": "", "token_ids": token_ids}


class Formatter:
    """One API's response and chunk choices, made per request once its prompts are tokenized.

    It holds the request's prompts, its n, and the token strings. Each API (CompletionAPI, ChatAPI) sets
    the names below. It also defines max_tokens, logprobs, show, choice and chunk_choice."""
    id_prefix: str      # the response's id: f"{id_prefix}-{generation id}"
    object: str         # a whole response's "object"
    chunk_object: str   # a stream chunk's "object"
    prompt_field: str   # the body's field that holds the prompt, named by a context-length error
    echo_only = False   # completions' echo with max_tokens 0: the prompt alone

    def __init__(self, body: SamplingBody, prompts: list[Prompt], n: int, strings: TokenStrings) -> None:
        self.prompts, self.n, self.strings = prompts, n, strings

    @staticmethod
    def max_tokens(body: SamplingBody) -> int | None:
        """The body's max_tokens; None: up to the end of the context (`Serving.fit_to_context`)."""
        raise NotImplementedError

    @staticmethod
    def logprobs(body: SamplingBody) -> tuple[int | None, int | None]:
        """The engine's logprobs and prompt_logprobs for this body, checked (a 400 names the field)."""
        raise NotImplementedError

    def show(self, index: int, result: RequestOutput | RequestDelta) -> Shown:
        """What choice `index` shows of a whole output or of a streamed delta."""
        raise NotImplementedError

    def choice(self, index: int, shown: Shown) -> dict:
        """A whole response's choice."""
        raise NotImplementedError

    def chunk_choice(self, index: int, shown: Shown) -> dict | None:
        """A stream chunk's choice; None: nothing to send for this delta."""
        raise NotImplementedError

    def usage(self, outputs: list[RequestOutput]) -> dict:
        """Each prompt's tokens once, whatever n (as vLLM), and the completions' tokens shown."""
        num_prompt = sum(len(p.token_ids) for p in self.prompts)
        num_completion = 0 if self.echo_only else sum(len(o.token_ids) for o in outputs)
        total = num_prompt + num_completion
        return dict(prompt_tokens=num_prompt, completion_tokens=num_completion, total_tokens=total)

    def first_chunk_choice(self, index: int) -> dict | None:
        """What a stream sends for each choice before any token (chat: the assistant's role); None: nothing."""
        return None


API = type[Formatter]


def client_key(headers: dict[str, str], peer: str | None, by_api_key: bool) -> str:
    """Who sent a request, for fair turns and per-client bounds.

    The answer is what the server knows of the request, never what the request says of itself.
    With `by_api_key`, the server takes several API keys, one per client. Then the client is the key the
    request was let in with. It is kept as a hash, never as the key itself. Otherwise the client is the
    peer's address. Behind a proxy the server trusts (--forwarded-allow-ips), that is the address the proxy
    forwards (uvicorn puts it in the request's client). The body's `user` is the client's to choose, and so
    is a Bearer value where no key is checked. A client sending a new one with each request would become a
    new client each time, and take every turn."""
    scheme, _, key = headers.get("authorization", "").partition(" ")
    if by_api_key and scheme.lower() == "bearer" and key.strip():
        return "key:" + hashlib.sha256(key.strip().encode()).hexdigest()[:16]
    return f"peer:{peer}"


def client_of(request: Request) -> str:
    """The request's client, as `client_key` names it."""
    serving: Serving = request.app.state.serving
    return client_key(request.headers, request.client.host if request.client else None, serving.clients_by_api_key)


class Serving:
    """The served model's name and limits, the AsyncLLM, the tokenizer thread and the metrics.
    Handlers never call the engine; they use its tokenizer (from the tokenizer thread) and constants."""

    def __init__(self, engine: LLMEngine, model_name: str, limits: Limits, chat_template: str | None = None,
                 tool_call_parser: str | None = None, clients_by_api_key: bool = False) -> None:
        self.model_name, self.limits = model_name, limits
        self.clients_by_api_key = clients_by_api_key  # several API keys: a client is its key (`client_key`)
        self.chat_template = chat_template        # --chat-template: the model's own if None
        self.tool_call_parser = tool_call_parser  # tool_choice "auto" parses with it (None: plain text)
        self.model_path, self.max_model_len = engine.config.model, engine.max_model_len
        self.tokenizer = engine.tokenizer
        self.grammars = engine.grammars  # thread-safe: handlers compile a request's grammar before submitting it
        self.grammars.max_bytes, self.grammars.max_depth = limits.max_grammar_bytes, limits.max_grammar_depth
        self.metrics = Metrics(model_name, num_usable_blocks=engine.model_runner.num_blocks - 1)  # block 0: unused
        self.async_llm = AsyncLLM(engine, self.metrics)
        self.tokenizer_thread = TokenizerThread()  # its jobs taken in turns across clients
        self.vocab_size = engine.vocab_size
        self.token_strings = TokenStrings(self.tokenizer, self.vocab_size)
        # Completions of accepted HTTP requests that the engine has not finished (event loop only).
        # Their bound is what --max-num-queued-requests says; by default what the engine runs at once x 4.
        self.num_in_flight = 0
        self.max_in_flight = limits.max_num_queued_requests or 4 * engine.config.max_num_seqs
        # and per client (`client_key`): what each holds, and its bound
        self.in_flight_by_client: collections.Counter[str] = collections.Counter()
        self.max_in_flight_per_client = (limits.max_num_queued_requests_per_client
                                         or self.max_in_flight - self.max_in_flight // 8)
        # A token covers at most this many bytes of text. A text longer than max_model_len of them
        # cannot fit, and is refused untokenized. A token's vocabulary entry has at least the bytes of
        # the text it covers. After Unicode normalization the text has at most half more: x2 for safety.
        longest = max((len(t.encode()) for t in self.tokenizer.get_vocab()), default=1) if self.tokenizer else 1
        self.max_prompt_bytes = 2 * longest * self.max_model_len
        # All of one request's prompts (or messages) together: at least what one prompt may hold.
        # Without it, three 2.6 MB prompts (each under SmolLM2's bound) held the tokenizer thread for 7 s.
        self.max_request_prompt_bytes = max(limits.max_request_prompt_bytes, self.max_prompt_bytes)
        # Values (commas) in one body, counted before it is parsed. The bound is twice the tokens that one
        # request's completions can hold, and room for the rest of the body. A comma is at least half a token
        # of text, or one token id. A 200,000-prompt body is refused without building its 600,000 objects.
        self.max_body_values = 2 * limits.max_completions_per_request * self.max_model_len + 4096
        if self.tokenizer is not None:  # the first encode may reset truncation/padding settings: not while the
            self.tokenizer.encode("")   # engine thread decodes with the same tokenizer ("Already borrowed")

    def workers_stopped(self) -> bool:
        """Tensor parallelism's workers stopped (after a failed step): no more steps, for good."""
        return not self.async_llm.engine.model_runner.healthy

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(f"model {shorten(repr(name))} does not exist; this server serves {self.model_name!r}",
                           param="model", status=404, code="model_not_found")

    def admit(self, num_choices: int, client: str = "") -> None:
        """Take a slot of max_in_flight per choice (prompts x n), and one of the client's own bound.

        Otherwise refuse at once (429), before any tokenizing. So a burst costs no more than reading its
        bodies. A request past either bound on its own could never be served: 400."""
        if self.async_llm.error is not None:
            raise APIError("the engine loop has died; the server cannot serve", status=503)
        per_request, limit = self.limits.max_completions_per_request, self.max_in_flight
        if num_choices > per_request:
            raise APIError(f"{num_choices} completions (prompts x n), more than this server takes in one request "
                           f"({per_request}, --max-completions-per-request)", param="prompt")
        if num_choices > limit:
            raise APIError(f"{num_choices} completions (prompts x n), more than this server takes at once ({limit})",
                           param="prompt")
        if self.num_in_flight + num_choices > limit:
            self.metrics.rejected.inc()
            raise APIError(f"the server is busy: {self.num_in_flight} completions in flight, at most {limit} "
                           f"(--max-num-queued-requests); retry later", status=429, code="too_many_requests")
        # A client holding nothing may take more than its share in one request (as the bound above allows).
        held, share = self.in_flight_by_client[client], self.max_in_flight_per_client
        if held > 0 and held + num_choices > share:
            self.metrics.rejected.inc()
            raise APIError(f"this client has {held} completions in flight, at most {share} of the server's {limit} "
                           f"(--max-num-queued-requests-per-client); retry later", status=429,
                           code="too_many_requests")
        self.num_in_flight += num_choices
        self.in_flight_by_client[client] += num_choices

    def release(self, client: str, num_choices: int = 1) -> None:
        """Give back slots `admit` took."""
        self.num_in_flight -= num_choices
        self.in_flight_by_client[client] -= num_choices
        if self.in_flight_by_client[client] <= 0:
            del self.in_flight_by_client[client]

    def check_request_bytes(self, texts: list[str], field: str) -> None:
        """On the event loop, before any tokenizing: check the size of a request's texts.

        Together they are at most max_request_prompt_bytes, else a 400 names `field`.
        A lone surrogate is counted here, and refused by `tokenize`."""
        num_bytes = sum(len(text.encode("utf-8", "surrogatepass")) for text in texts)
        if num_bytes > self.max_request_prompt_bytes:
            raise APIError(f"{field} has {num_bytes} bytes of text in all, more than this server tokenizes for one "
                           f"request ({self.max_request_prompt_bytes} bytes)", param=field)

    async def in_tokenizer_thread(self, work: Callable[[], T], client: str = "") -> T:
        """work() in the tokenizer thread, in `client`'s turn (`client_key`)."""
        return await self.tokenizer_thread.run(work, client)

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
        """In the tokenizer thread: a token-id prompt as echo shows it (special tokens and all, as vLLM).

        None without a tokenizer. "" for ids outside the vocabulary (add_request refuses them)."""
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode(token_ids) if all(0 <= t < self.vocab_size for t in token_ids) else ""

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:
        """In the tokenizer thread: the conversation (and the tools it may call) as the chat template writes it."""
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      tokenize=False, tools=tools, chat_template=self.chat_template)
        except Exception as error:  # the template's own checks (a role it does not know, ...)
            raise APIError(f"messages: the chat template failed: {error}", param="messages") from None

    def check_chat_template(self) -> None:
        if self.tokenizer is None or not (self.chat_template or self.tokenizer.chat_template):
            raise APIError(f"model {self.model_name!r} has no chat template; use /v1/completions", param="messages")

    async def compile_grammar(self, spec: StructuredOutputsParams, field: str, client: str = "") -> None:
        """Check spec's bounds in the tokenizer thread, then wait for its compile.

        The engine's GrammarCompiler compiles it in a worker process, and add_request then hits its cache.
        The wait is at most max_grammar_compile_seconds, counted once the workers have started.
        Some specs fail: one past the bounds, one xgrammar rejects, or one that crashes the worker.
        So does one that fails to compile (`a{2147483648}` parses, lazily), or allows no output
        (`root ::= root`). So does one past the time budget. Each is a 400 naming `field`.
        It fails this request alone, before the request reaches the engine."""
        seconds = self.limits.max_grammar_compile_seconds
        started = self.grammars.start_workers()  # ahead of the compile, in each compile thread
        try:
            await self.in_tokenizer_thread(lambda: self.grammars.check(spec), client)
        except InvalidRequest as error:
            raise APIError(f"{field}: {error}", param=field) from None
        # checked: at once, with no await before `leave`
        future = self.grammars.submit(spec, True, checked=True, client=client)
        try:
            # a worker's start (seconds, once) is not the grammar's fault: not counted against its budget
            await asyncio.shield(asyncio.gather(*map(asyncio.wrap_future, started), return_exceptions=True))
            # shielded: a request that gives up leaves the compile to the others waiting for it (`leave`)
            await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), seconds)
        except InvalidRequest as error:
            raise APIError(f"{field}: {error}", param=field) from None
        except TimeoutError:
            raise APIError(f"{field}: the grammar took over {seconds} s to compile, this server's limit",
                           param=field) from None
        except Exception as error:  # xgrammar's RuntimeError for a grammar that parses but cannot compile
            raise APIError(f"{field}: the grammar cannot be compiled: {shorten(str(error), 300)}",
                           param=field) from None
        finally:
            self.grammars.leave(spec)

    def fit_to_context(self, params: SamplingParams, max_tokens: int | None, num_prompt_tokens: int,
                       field: str, max_tokens_field: str = "max_tokens") -> SamplingParams:
        """params with max_tokens settled (None: up to the end of the context).

        A 400 if the prompt and max_tokens do not fit in max_model_len (vLLM's "context length exceeded")."""
        room = self.max_model_len - num_prompt_tokens
        if room < 1:
            raise APIError(f"context length exceeded: the {field} has {num_prompt_tokens} tokens, which leaves no "
                           f"room for a completion in max_model_len={self.max_model_len}", param=field,
                           code="context_length_exceeded")
        if max_tokens is not None and max_tokens > room:
            raise APIError(f"context length exceeded: {num_prompt_tokens} tokens in the {field} + {max_tokens_field}="
                           f"{max_tokens} > max_model_len={self.max_model_len}; lower {max_tokens_field} or shorten "
                           f"the {field}", param=max_tokens_field, code="context_length_exceeded")
        try:
            return replace(params, max_tokens=given(max_tokens, room))
        except InvalidRequest as error:  # min_tokens past the room left
            raise APIError(str(error), param=error.param) from None
