"""The OpenAI-compatible HTTP server over one LLMEngine (FastAPI + uvicorn, as vLLM's api_server).

    nanoserve serve MODEL [--host 127.0.0.1] [--port 8000] [--api-key KEY ...] [options]
    python -m nanoserve.serve MODEL [options]                 (the same)

Three kinds of thread take part in a request.
- uvicorn's event loop (one thread) runs the HTTP handlers. They are `create_completion` in
  serving_completion.py, `create_chat_completion` in serving_chat.py (its tools in serving_tools.py),
  `create_response` in serving_responses.py, and the small ones in routes.py. A handler reads and checks
  the body (protocol.py). It takes its slots of --max-num-queued-requests, or answers 429 at once.
  It hands the slow work to the tokenizer thread.
- The tokenizer thread (serving_engine.py) renders the chat template and tokenizes. So neither the event
  loop (serving every other client) nor the engine thread (stepping every other request) waits on a long
  input. With the token ids, the handler submits one engine request per choice (n per prompt).
- The engine thread, run by the AsyncLLM, alone calls the engine. (async_llm.py draws its queue and
  messages.) It sends each request's deltas and output back to the handler that submitted it.

A client that leaves is noticed on the event loop (streaming.py), which aborts its engine requests.
Their KV blocks are free before the next step. If something fails on the engine thread, the requests it
concerns fail (500) and the loop goes on. If the loop itself dies, /health says 503. Then every request
fails at once (503) instead of hanging.

`build_app` makes the app: the routes, the error handlers, the API key, and a `Serving` as its state
(serving_engine.py). The Serving's AsyncLLM runs while the app does (`lifespan`). For tests and
notebooks, `ServerThread(app).start()` serves the app on a free port.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import hmac
import ipaddress
import logging
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable

import h11
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware
from uvicorn.protocols.http.h11_impl import H11Protocol

from nanoserve import LLMEngine
from nanoserve.entrypoints.openai.protocol import APIError, Limits
from nanoserve.entrypoints.openai.routes import ROUTES
from nanoserve.entrypoints.openai.serving_engine import Serving
from nanoserve.entrypoints.openai.tool_parsers import PARSERS
from nanoserve.entrypoints.utils import OneLineParser, add_engine_arguments, engine_config, positive

HEADER_TIMEOUT = 10.0  # seconds a connection may take to send a request's head (line and headers)


# --- The app -------------------------------------------------------------------------------------

async def api_error(request: Request, error: APIError) -> Response:
    return error.response()


async def http_error(request: Request, error: HTTPException) -> Response:  # no such route or method
    return APIError(str(error.detail), status=error.status_code).response()


async def server_error(request: Request, error: Exception) -> Response:  # a bug: still OpenAI's error body
    return APIError(f"internal error: {error!r}", status=500).response()


class RequireAPIKey:
    """ASGI middleware: every route but /health needs `Authorization: Bearer <key>`, else 401.

    The key is one of the server's keys. The scheme may be in any case. Each key is compared whole, in
    constant time."""

    def __init__(self, app: Callable, api_keys: list[str]) -> None:
        self.app, self.keys = app, [key.encode() for key in api_keys]

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            values = [value for name, value in scope["headers"] if name == b"authorization"]
            # Two headers: this check would read one, and client_key the other (a new client each time).
            error = (APIError("more than one Authorization header", status=400) if len(values) > 1 else
                     None if self.authorized(values[0] if values else b"") else
                     APIError("missing or wrong API key (Authorization: Bearer ...)", status=401,
                              code="invalid_api_key"))
            if error is not None:
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def authorized(self, value: bytes) -> bool:
        scheme, _, key = value.partition(b" ")
        matches = [hmac.compare_digest(key.strip(), known) for known in self.keys]  # each compared: constant time
        return scheme.lower() == b"bearer" and any(matches)


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """The AsyncLLM's engine thread runs while the app does."""
    serving: Serving = app.state.serving
    serving.async_llm.start()
    yield
    serving.async_llm.shutdown()
    serving.tokenizer_thread.shutdown()


def build_app(engine: LLMEngine, served_model_name: str, api_key: str | list[str] | None = None,
              limits: Limits = Limits(), chat_template: str | None = None,
              tool_call_parser: str | None = None) -> FastAPI:
    """The HTTP app; its AsyncLLM's engine thread starts and stops with it.

    `api_key` is the key, or keys, a request must bring. With several, each key is a client of its own,
    for fair turns and shares. `chat_template` replaces the model's. `tool_call_parser` (tool_parsers.py)
    reads tool_choice "auto"'s calls (None: plain text)."""
    api_keys = [api_key] if isinstance(api_key, str) else api_key or []
    app = FastAPI(title="nanoserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.serving = Serving(engine, served_model_name, limits, chat_template, tool_call_parser,
                                clients_by_api_key=len(api_keys) > 1)
    for path, endpoint, methods in ROUTES:
        app.add_api_route(path, endpoint, methods=methods)
    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, server_error)
    if api_keys:
        app.add_middleware(RequireAPIKey, api_keys=api_keys)
    return app


# --- Running it ----------------------------------------------------------------------------------

class ClientAddress:
    """ASGI middleware: the request's client address as client_key takes it.

    An IPv4 peer of a dual-stack socket (--host ::) arrives as ::ffff:a.b.c.d. It becomes a.b.c.d, so
    that --forwarded-allow-ips 127.0.0.1 matches it. Then, from a trusted proxy, uvicorn's middleware
    takes X-Forwarded-For's rightmost address that is not a trusted proxy."""

    def __init__(self, app: Callable, forwarded_allow_ips: str | None) -> None:
        self.app = app  # the FastAPI app itself: ServerThread.serving reads its state
        inner = functools.partial(self.plain_client, app)
        self.forwarded = inner if forwarded_allow_ips is None else ProxyHeadersMiddleware(inner, forwarded_allow_ips)

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        await self.plain_client(self.forwarded, scope, receive, send)

    @staticmethod
    async def plain_client(app: Callable, scope: dict, receive: Callable, send: Callable) -> None:
        client = scope.get("client")
        if client and client[0].lower().startswith("::ffff:"):
            with contextlib.suppress(ValueError):
                mapped = ipaddress.IPv6Address(client[0]).ipv4_mapped
                scope["client"] = (str(mapped), client[1]) if mapped else client
        await app(scope, receive, send)


class HTTPProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request's head, and TCP_NODELAY on every connection.

    The head is the request line and headers. A client may connect and send its head slowly, or never.
    It is cut off after `header_timeout` seconds, instead of holding a connection for good."""

    def __init__(self, *args: object, header_timeout: float, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout, self.head_timer = header_timeout, None

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)
        set_nodelay(transport)
        self.start_head_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.start_head_timer()  # for the next request on this kept-alive connection

    def start_head_timer(self) -> None:
        if self.head_timer is not None:
            self.head_timer.cancel()
        self.head_timer = self.loop.call_later(self.header_timeout, self.close_without_head)

    def close_without_head(self) -> None:
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():  # no whole head came
            self.transport.close()


def set_nodelay(transport: asyncio.Transport) -> None:
    """TCP_NODELAY on a connection: a response goes out at once instead of waiting ~40 ms.

    Without it, Nagle's algorithm holds the last small segment. It waits for the client's delayed ACK of
    the segment before. asyncio sets it only on sockets created with proto IPPROTO_TCP.
    `bind`'s socket (proto 0) is not one of them."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):  # not a Unix socket
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def uvicorn_server(app: FastAPI, host: str = "127.0.0.1", port: int = 0, header_timeout: float = HEADER_TIMEOUT,
                   log_level: str = "warning", forwarded_allow_ips: str | None = None) -> uvicorn.Server:
    """`forwarded_allow_ips`: the proxies whose X-Forwarded-For names the client (uvicorn's option).

    None trusts none. By default uvicorn trusts 127.0.0.1, so any local client could name itself anyone.
    "*" is refused: uvicorn then takes the header's first address, which the client writes itself."""
    check_proxies(forwarded_allow_ips)
    http = functools.partial(HTTPProtocol, header_timeout=header_timeout)
    return uvicorn.Server(uvicorn.Config(ClientAddress(app, forwarded_allow_ips), host=host, port=port, http=http,
                                         log_level=log_level, proxy_headers=False))


def check_proxies(forwarded_allow_ips: str | None) -> None:
    if forwarded_allow_ips is not None and "*" in [ip.strip() for ip in forwarded_allow_ips.split(",")]:
        raise ValueError("--forwarded-allow-ips '*' would believe the address a client writes in X-Forwarded-For; "
                         "name the proxies' addresses or networks instead")


class ServerThread:
    """Run an app under uvicorn in a background thread (tests, notebooks); `port=0` picks a free one.

    It listens on a socket made by `bind`, as `main` does. So tests serve as the command line does."""

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0,
                 header_timeout: float = HEADER_TIMEOUT, forwarded_allow_ips: str | None = None) -> None:
        self.server = uvicorn_server(app, host, port, header_timeout, forwarded_allow_ips=forwarded_allow_ips)
        self.sock = bind(host, port)
        self.thread = threading.Thread(target=self.server.run, kwargs=dict(sockets=[self.sock]), daemon=True)

    def start(self) -> ServerThread:
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the server failed to start")
            time.sleep(0.01)
        return self

    @property
    def url(self) -> str:
        host, port = self.sock.getsockname()[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    @property
    def serving(self) -> Serving:
        return self.server.config.app.app.state.serving

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join()


def port_number(text: str) -> int:
    """A TCP port, 0 (any free one) to 65535: past it, argparse's one line instead of bind's OverflowError."""
    port = int(text)
    if not 0 <= port <= 65535:
        raise ValueError
    return port


def build_parser(prog: str) -> OneLineParser:
    parser = OneLineParser(prog=prog, description="nanoserve's OpenAI-compatible server")
    parser.add_argument("model")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=port_number, default=8000)
    parser.add_argument("--api-key", action="append", default=None,
                        help="a key requests must bring (Authorization: Bearer KEY); give it more than once for "
                             "several clients' keys: each key is then a client of its own for fair turns and shares")
    parser.add_argument("--api-key-file", default=None,
                        help="a file of keys, one per line, taken as --api-key each")
    parser.add_argument("--forwarded-allow-ips", default=None,
                        help="the proxies (addresses or networks, comma-separated) whose X-Forwarded-For names "
                             "the client; default: none, the client is the connection's peer")
    parser.add_argument("--served-model-name", default=None, help="default: the model path")
    parser.add_argument("--max-num-queued-requests", type=positive(int), default=None,
                        help="completions (prompts x n) in flight at once, counted from arrival until the engine "
                             "finishes them: tokenizing, waiting and running, not only queued; more get 429 "
                             "(default: 4 x --max-num-seqs)")
    parser.add_argument("--max-num-queued-requests-per-client", type=positive(int), default=None,
                        help="of those, what one client (its API key where the server takes several, else its "
                             "address) may hold; more get 429 (default: 7/8 of --max-num-queued-requests)")
    parser.add_argument("--max-completions-per-request", type=positive(int),
                        default=Limits.max_completions_per_request,
                        help="completions (prompts x n) one request may ask for; more get 400")
    parser.add_argument("--write-timeout", type=positive(float), default=Limits.write_timeout,
                        help="seconds a response, streamed or whole, waits for its client to read before "
                             "closing the connection")
    parser.add_argument("--max-request-body-bytes", type=positive(int), default=Limits.max_body_bytes)
    parser.add_argument("--body-timeout", type=positive(float), default=Limits.body_timeout,
                        help="seconds a request's body may take to arrive; past it, 408")
    parser.add_argument("--header-timeout", type=positive(float), default=HEADER_TIMEOUT,
                        help="seconds a connection may take to send a request's head")
    parser.add_argument("--max-grammar-bytes", type=positive(int), default=Limits.max_grammar_bytes,
                        help="bytes of one request's schema, regex, grammar or choices (structured outputs)")
    parser.add_argument("--max-grammar-depth", type=positive(int), default=Limits.max_grammar_depth,
                        help="nesting of a schema, and of brackets in a regex, grammar or pattern")
    parser.add_argument("--max-grammar-compile-seconds", type=positive(float),
                        default=Limits.max_grammar_compile_seconds,
                        help="seconds a request waits for its grammar to compile before a 400")
    parser.add_argument("--chat-template", default=None,
                        help="a Jinja chat template (a file, or the template's text) instead of the model's")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='tool_choice "auto" (the default with tools) reads tool calls from the output with '
                             "--tool-call-parser; without it, \"auto\" answers plain text")
    parser.add_argument("--tool-call-parser", choices=sorted(PARSERS), default=None,
                        help="the format of the model's tool calls (hermes: <tool_call>{json}</tool_call>, as "
                             "Qwen2.5/3; llama3_json: Llama 3.1's JSON)")
    add_engine_arguments(parser)
    return parser


def read_chat_template(text: str | None) -> str | None:
    """--chat-template: a file's text, else the argument itself if it looks like Jinja (as vLLM takes it)."""
    if text is None:
        return None
    try:
        with open(text) as file:
            return file.read()
    except OSError:
        if "{{" in text or "{%" in text:
            return text
        raise ValueError(f"--chat-template: cannot read the file {text!r}") from None


def auto_tool_parser(args: argparse.Namespace) -> str | None:
    """tool_choice "auto"'s parser: --tool-call-parser where --enable-auto-tool-choice asks for it."""
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
    return args.tool_call_parser if args.enable_auto_tool_choice else None


def read_api_keys(keys: list[str] | None, key_file: str | None) -> list[str]:
    """--api-key (each time given) and the lines of --api-key-file (blank ones skipped)."""
    keys = list(keys or [])
    if key_file is not None:
        try:
            with open(key_file) as file:
                keys += [line.strip() for line in file if line.strip()]
        except OSError as error:
            raise ValueError(f"--api-key-file: cannot read {key_file!r}: {error.strerror}") from None
        if not keys:
            raise ValueError(f"--api-key-file: {key_file!r} holds no key")
    return keys


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound now: a port in use fails before the model loads."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock


def main(argv: list[str] | None = None, prog: str = "python -m nanoserve.serve") -> None:
    """Serve MODEL until Ctrl-C; `nanoserve serve` calls it with prog="nanoserve serve"."""
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:  # everything that can be checked before the model loads, so that a mistake costs no wait
        check_proxies(args.forwarded_allow_ips)
        config = engine_config(args)
        chat_template, tool_call_parser = read_chat_template(args.chat_template), auto_tool_parser(args)
        api_keys = read_api_keys(args.api_key, args.api_key_file)
        sock = bind(args.host, args.port)
        engine = LLMEngine(config)
    except (ValueError, OSError) as error:
        parser.error(str(error))
    limits = Limits(max_body_bytes=args.max_request_body_bytes, max_num_queued_requests=args.max_num_queued_requests,
                    max_num_queued_requests_per_client=args.max_num_queued_requests_per_client,
                    max_completions_per_request=args.max_completions_per_request, write_timeout=args.write_timeout,
                    body_timeout=args.body_timeout,
                    max_grammar_bytes=args.max_grammar_bytes, max_grammar_depth=args.max_grammar_depth,
                    max_grammar_compile_seconds=args.max_grammar_compile_seconds)
    name = args.served_model_name or args.model
    app = build_app(engine, name, api_keys, limits, chat_template, tool_call_parser)
    server = uvicorn_server(app, args.host, args.port, args.header_timeout, log_level="info",
                            forwarded_allow_ips=args.forwarded_allow_ips)
    host, port = sock.getsockname()[:2]  # uvicorn does not say where a socket it was given listens (--port 0)
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    # Everything loaded so far (torch, the model, the tokenizer: millions of objects) lives as long as the
    # server. Freezing it keeps the garbage collector from walking it again. A big request body's many new
    # lists set off a full collection. Without the freeze, that held the GIL (so every thread) for ~0.4 s.
    gc.collect()
    gc.freeze()
    logging.getLogger("uvicorn.error").info("serving %r at %s", name, url)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has shut down gracefully
        pass
    finally:
        engine.close()  # stops tensor-parallel workers
        # Frozen objects are never collected, not even at exit. Torch imports triton, whose nanobind module
        # then found its types alive at exit and printed ~600 "nanobind: leaked" lines. Unfrozen, they are freed.
        gc.unfreeze()


if __name__ == "__main__":
    main()
