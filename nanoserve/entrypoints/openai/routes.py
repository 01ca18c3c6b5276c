"""Which URL runs which handler (`ROUTES`), and the small handlers that need no module of their own.

The small ones are /tokenize, /detokenize, /v1/models, /health, /metrics and /version.
The completions, chat and responses handlers live in serving_completion.py, serving_chat.py and
serving_responses.py. `build_app` (api_server.py) adds every route of `ROUTES` to the app.
"""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from nanoserve.entrypoints.openai.chat_api import template_messages
from nanoserve.entrypoints.openai.protocol import (
    APIError,
    DetokenizeBody,
    TokenizeBody,
    given,
    parse,
    read_json,
)
from nanoserve.entrypoints.openai.serving_chat import create_chat_completion
from nanoserve.entrypoints.openai.serving_completion import create_completion
from nanoserve.entrypoints.openai.serving_engine import Serving, client_of
from nanoserve.entrypoints.openai.serving_responses import create_response


async def tokenize_text(request: Request) -> Response:
    """vLLM's /tokenize: {count, max_model_len, tokens, token_strs if return_token_strs}."""
    serving: Serving = request.app.state.serving
    body = parse(TokenizeBody, await read_json(request, serving.limits, serving.max_body_values))
    serving.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError("give either prompt or messages", param="prompt")
    if body.messages is not None:
        serving.check_chat_template()
        messages = template_messages(body.messages)
        serving.check_request_bytes([m["content"] for m in messages], "messages")

        def prepare() -> list[int]:
            text = serving.render_chat(messages, body.add_generation_prompt)
            return serving.tokenize(text, "messages", given(body.add_special_tokens, False), bounded=False)
    else:
        serving.check_request_bytes([body.prompt], "prompt")

        def prepare() -> list[int]:
            return serving.tokenize(body.prompt, "prompt", given(body.add_special_tokens, True), bounded=False)
    token_ids = await serving.in_tokenizer_thread(prepare, client_of(request))
    reply = dict(count=len(token_ids), max_model_len=serving.max_model_len, tokens=token_ids)
    if body.return_token_strs:
        reply["token_strs"] = serving.tokenizer.convert_ids_to_tokens(token_ids)
    return JSONResponse(reply)


async def detokenize_tokens(request: Request) -> Response:
    """vLLM's /detokenize: {"prompt": the tokens' text}. The tokens are counted before the body is
    checked: validating 1.6 million ids alone held the event loop for a second."""
    serving: Serving = request.app.state.serving
    limit = max(serving.limits.max_detokenize_tokens, serving.max_model_len)
    raw = await read_json(request, serving.limits, limit + 64)
    if isinstance(raw.get("tokens"), list) and len(raw["tokens"]) > limit:
        raise APIError(f"tokens has {len(raw['tokens'])} ids, more than this server decodes at once ({limit})",
                       param="tokens")
    body = parse(DetokenizeBody, raw)
    serving.check_model(body.model)
    tokenizer = serving.tokenizer
    if tokenizer is None:
        raise APIError(f"model {serving.model_name!r} has no tokenizer", param="tokens")
    bad = [t for t in body.tokens if not 0 <= t < len(tokenizer)]
    if bad:
        raise APIError(f"tokens {bad[:5]} are outside [0, {len(tokenizer)})", param="tokens")
    text = await serving.in_tokenizer_thread(lambda: tokenizer.decode(body.tokens), client_of(request))
    return JSONResponse({"prompt": text})


async def list_models(request: Request) -> Response:
    serving: Serving = request.app.state.serving
    card = dict(id=serving.model_name, object="model", created=0, owned_by="nanoserve", root=serving.model_path,
                parent=None, max_model_len=serving.max_model_len, permission=[])
    return JSONResponse(dict(object="list", data=[card]))


async def check_health(request: Request) -> Response:
    serving: Serving = request.app.state.serving
    return Response(status_code=503 if serving.async_llm.error is not None or serving.workers_stopped() else 200)


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
    ("/v1/responses", create_response, ["POST"]),
    ("/v1/models", list_models, ["GET"]),
    ("/tokenize", tokenize_text, ["POST"]),
    ("/detokenize", detokenize_tokens, ["POST"]),
    ("/health", check_health, ["GET", "HEAD"]),
    ("/metrics", show_metrics, ["GET"]),
    ("/version", show_version, ["GET"]),
]
