"""The server under hostile load (nanoserve/entrypoints/openai/): every connection answers at once
(TCP_NODELAY), no request holds the tokenizer thread or the event loop for long, and the small
promises (one-line option errors, empty prompts refused, text_offset one frame) hold."""
import pytest

# Test extras (pyproject.toml's [test]) this module needs: without one it is skipped, not an error
pytest.importorskip("httpx")
pytest.importorskip("fastapi")
import asyncio
import gc
import json
import logging
import socket
import statistics
import threading
import time

import httpx
from test_serve import KEY, NAME, PROMPTS, events, model_path, offline, post, start_server  # noqa: F401 (fixtures)

import nanoserve
from nanoserve.entrypoints.openai import api_server
from nanoserve.entrypoints.openai.protocol import Limits

json_loads = json.loads


@pytest.fixture(scope="module")
def server(model_path):  # noqa: F811
    limits = Limits(max_body_bytes=256 * 1024, max_request_prompt_bytes=4096)  # 4,096: one prompt's bound too
    server = start_server(model_path, api_key=KEY, limits=limits)
    yield server
    server.stop()


AUTH = {"Authorization": f"Bearer {KEY}"}


# --- TCP_NODELAY ---------------------------------------------------------------------------------

# Catches: accepted connections without TCP_NODELAY (the listening socket made with proto 0, so
# asyncio never set it): every reply on a kept-alive connection waited ~40 ms for Nagle's algorithm
# and the client's delayed ACK.
def test_accepted_connections_have_tcp_nodelay(server):
    with httpx.Client(base_url=server.url, headers=AUTH) as client:
        assert client.get("/health").status_code == 200  # the connection stays open (kept alive)
        connections = list(server.server.server_state.connections)
        assert connections
        for protocol in connections:
            sock = protocol.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0


# Catches: the ~40 ms stall itself. Kept-alive requests against the same requests each on a new
# connection (which the stall spares: a new connection ACKs at once), medians of 20, so that a loaded
# machine slows both alike; with the stall, kept-alive ones took 40-90 ms longer.
def test_a_kept_alive_request_is_answered_without_the_nagle_stall(server):
    body = dict(model=NAME, prompt="Hi", max_tokens=1)

    def median_time(client: httpx.Client) -> float:
        times = []
        for _ in range(20):
            start = time.perf_counter()
            assert client.post(server.url + "/v1/completions", json=body, headers=AUTH).status_code == 200
            times.append(time.perf_counter() - start)
        return statistics.median(times)
    with httpx.Client(timeout=60) as client:
        client.post(server.url + "/v1/completions", json=body, headers=AUTH)  # warm up: the connection, a step
        kept_alive = median_time(client)
    with httpx.Client(timeout=60, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        new_connections = median_time(client)
    assert kept_alive < new_connections + 0.02, (kept_alive, new_connections)


# --- The command line ----------------------------------------------------------------------------

# Catches: --port 99999 or -1 a traceback from bind (OverflowError, exit 1) instead of one line, exit 2.
@pytest.mark.parametrize("port", ["99999", "-1", "65536"])
def test_a_port_out_of_range_is_one_line(port, monkeypatch, capsys):
    monkeypatch.setattr(api_server, "LLMEngine", lambda config: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as exit_:
        api_server.main([nanoserve.DEFAULT_MODEL, "--port", port])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "--port" in err, err


# Catches: the server's start-up objects (torch, model, tokenizer) left to the garbage collector, whose
# full collections, set off by a big body's 200,000 new lists, held the GIL ~0.4 s: `nanoserve serve`
# freezes them before it serves.
def test_the_server_freezes_its_start_up_objects_before_serving(monkeypatch):
    frozen = []
    monkeypatch.setattr(api_server.uvicorn.Server, "run", lambda self, sockets: frozen.append(gc.get_freeze_count()))
    gc.unfreeze()
    try:
        api_server.main([nanoserve.DEFAULT_MODEL, "--port", "0", "--device", "cpu"])
    finally:
        gc.unfreeze()
    assert frozen and frozen[0] > 10_000, frozen  # the model and torch's modules at least


# --- The small ones ------------------------------------------------------------------------------

# Catches: an empty prompt refused alone ({"prompt": ""}) but taken in a list (["", "a"] was a 200), and
# an empty token-id list in a list of them.
@pytest.mark.parametrize("prompt, index", [(["", "a"], 0), (["a", ""], 1), ([[5, 6], []], 1)])
def test_an_empty_prompt_in_a_list_is_refused(server, prompt, index):
    reply = post(server, "/v1/completions", dict(prompt=prompt, max_tokens=1))
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "prompt" and f"prompt {index} is empty" in reply.json()["error"]["message"]


# Catches: a stream with echo whose text_offset changes frame: the prompt's offsets counted in token
# strings ("<s>" and all), the next chunk's from the text sent (shorter), so offsets went backwards, and
# a held-back chunk's offsets repeated; the stream's offsets end to end must be the whole response's.
@pytest.mark.parametrize("prompt", [PROMPTS[0], [1, 450, 338]])  # a string; token ids with <s>, echoed as text
def test_streamed_text_offset_is_the_whole_responses(server, prompt):
    body = dict(model=NAME, prompt=prompt, echo=True, logprobs=1, max_tokens=8, temperature=0)
    whole = post(server, "/v1/completions", body).json()["choices"][0]["logprobs"]["text_offset"]
    chunks = [event["choices"][0] for event in events(server, {**body, "stream": True})[:-1]]
    streamed = [x for c in chunks for x in c["logprobs"]["text_offset"]]
    assert streamed == whole and streamed == sorted(streamed)


# --- Nothing big on the tokenizer thread ---------------------------------------------------------

@pytest.fixture
def encode_calls(server, monkeypatch) -> list[int]:
    """The length of each text the server tokenizes from now on."""
    tokenizer, calls = server.serving.tokenizer, []
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text, **kwargs: calls.append(len(text)) or encode(text, **kwargs))
    return calls


# Catches: the prompt byte bound checked per prompt only: three prompts each under it (2.6 MB each to
# SmolLM2) were all tokenized, 7.2 s of the tokenizer thread, before the request was refused.
@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", dict(prompt=["Mr. Darcy " * 300] * 3), "prompt"),  # 3,000 bytes each, 4,096 per prompt
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "Mr. Darcy " * 300}] * 3), "messages"),
    ("/tokenize", dict(prompt="Mr. Darcy " * 1000), "prompt"),  # /tokenize had no bound at all
    ("/tokenize", dict(messages=[{"role": "user", "content": "Mr. Darcy " * 300}] * 3), "messages"),
])
def test_a_requests_prompts_are_bounded_together_before_tokenizing(server, encode_calls, path, body, param):
    assert server.serving.max_request_prompt_bytes == server.serving.max_prompt_bytes == 4096  # 3,000 each fit
    reply = post(server, path, body)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text
    assert "bytes of text in all" in reply.json()["error"]["message"] and encode_calls == []
    assert post(server, "/tokenize", dict(prompt="Mr. Darcy")).status_code == 200 and encode_calls


# Catches: /detokenize without a bound: 2.6 million ids held the event loop (validating them) and the
# tokenizer thread (decoding them) for seconds.
def test_detokenize_is_bounded(server):
    limit = max(Limits().max_detokenize_tokens, 128)
    reply = post(server, "/detokenize", dict(tokens=[5] * (limit + 1)))
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "tokens", reply.text
    assert post(server, "/detokenize", dict(tokens=[5] * limit)).status_code == 200


# Catches: a list of prompts counted only after the body is validated (pydantic checks each of 200,000
# prompts first, holding the event loop for over a second): too many is refused before validation.
def test_too_many_prompts_are_refused_before_the_body_is_validated(server, monkeypatch):
    from nanoserve.entrypoints.openai import serving_completion
    monkeypatch.setattr(serving_completion, "parse", lambda *args: pytest.fail("the body was validated"))
    too_many = Limits().max_completions_per_request + 1
    for prompt in (["a"] * too_many, [[5, 6]] * too_many):
        reply = post(server, "/v1/completions", dict(prompt=prompt, max_tokens=1))
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt", reply.text
        assert f"{too_many} prompts" in reply.json()["error"]["message"]


# Catches: a body parsed before its values are counted: json.loads of 200,000 small lists builds 600,000
# objects holding the GIL (~0.1 s, every stream and /health waiting), only for the request to be refused.
@pytest.mark.parametrize("path, body", [
    ("/v1/completions", lambda serving: dict(prompt=[5] * (serving.max_body_values + 1), max_tokens=1)),
    ("/v1/chat/completions", lambda serving: dict(messages=[{"role": "user", "content": "a, " * 99}],
                                                  stop_token_ids=[5] * serving.max_body_values)),
    ("/detokenize", lambda serving: dict(tokens=[5] * (max(Limits().max_detokenize_tokens, 128) + 100))),
])
def test_a_body_with_too_many_values_is_refused_before_it_is_parsed(server, monkeypatch, path, body):
    from nanoserve.entrypoints.openai import protocol
    content = json.dumps(body(server.serving)).encode()
    assert len(content) < server.serving.limits.max_body_bytes  # refused for its values, not its bytes
    parsed = []
    monkeypatch.setattr(protocol.json, "loads", lambda raw: parsed.append(raw) or json_loads(raw))
    reply, was_parsed = post(server, path, content), list(parsed)
    assert reply.status_code == 413 and "values" in reply.text and not was_parsed, reply.text
    assert post(server, "/tokenize", dict(prompt="Mr. Darcy, a, b")).status_code == 200 and parsed


# Catches: token strings for logprobs decoded on the tokenizer thread, where they queued behind any long
# tokenization (a logprobs stream stalled with it): they are decoded once, when the server starts.
def test_token_strings_never_use_the_tokenizer_thread(model_path, monkeypatch):  # noqa: F811
    server = start_server(model_path)
    try:
        tokenizer, threads = server.serving.tokenizer, []
        decode = tokenizer.decode
        monkeypatch.setattr(tokenizer, "decode", lambda *args, **kwargs:
                            threads.append(threading.current_thread().name) or decode(*args, **kwargs))
        body = dict(prompt=[1, 450, 338], logprobs=5, max_tokens=8, temperature=1.0, seed=3)
        reply = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
        assert len(reply["choices"][0]["logprobs"]["tokens"]) == 8
        assert events(server, {**body, "stream": True})[-1] == "[DONE]"
        assert not any(name.startswith("nanoserve-tokenizer") for name in threads), threads
    finally:
        server.stop()


# --- Nothing big on the event loop ---------------------------------------------------------------

# Catches: a whole response built and serialized in one go on the event loop (128 choices with 20
# logprobs each, 46 MB, froze every stream and /health for 4.85 s). A callback scheduled while the
# first choice is built must run before the last one is: the loop serves others between choices.
def test_a_whole_response_yields_to_the_event_loop_between_choices(server, monkeypatch):
    from nanoserve.entrypoints.openai.serving_completion import CompletionAPI
    choice, ran, seen = CompletionAPI.choice, threading.Event(), []

    def watched_choice(self, index, shown):
        if not seen:
            asyncio.get_running_loop().call_soon(ran.set)
        seen.append(ran.is_set())
        return choice(self, index, shown)
    monkeypatch.setattr(CompletionAPI, "choice", watched_choice)
    body = dict(model=NAME, prompt=PROMPTS[:2], n=3, logprobs=2, max_tokens=4, temperature=1.0, seed=1)
    reply = post(server, "/v1/completions", body)
    assert reply.status_code == 200 and [c["index"] for c in reply.json()["choices"]] == list(range(6))
    assert reply.json()["usage"]["completion_tokens"] == 24
    assert len(seen) == 6 and seen[-1], seen


# --- Bodies that do not arrive -------------------------------------------------------------------

def send_part_of_a_body(server) -> socket.socket:
    """A request whose head promises 100 bytes of body, of which 10 come."""
    host, port = server.server.servers[0].sockets[0].getsockname()[:2]
    sock = socket.create_connection((host, port))
    sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n".encode()
                 + b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n" + b'{"prompt":')
    return sock


def test_a_body_that_stops_short_is_a_408_and_a_client_that_leaves_mid_body_one_log_line(server, caplog):
    """Catches: no deadline on a request's body (40 connections one byte short of 8 MiB held 315 MB for
    60 s and more), and a client that left mid-body logging the ASGI stack's 56-line traceback."""
    from dataclasses import replace
    limits, uvicorn_log = server.serving.limits, logging.getLogger("uvicorn.error")
    server.serving.limits = replace(limits, body_timeout=0.5)
    uvicorn_log.addHandler(caplog.handler)  # uvicorn's loggers do not propagate to the root
    try:
        with caplog.at_level(logging.INFO), send_part_of_a_body(server) as sock:
            sock.settimeout(60)
            assert sock.recv(65536).startswith(b"HTTP/1.1 408"), "the server answered when the deadline passed"
        with caplog.at_level(logging.INFO):
            send_part_of_a_body(server).close()
            deadline = time.monotonic() + 60
            while "left while sending" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.02)
        assert "left while sending" in caplog.text and "Traceback" not in caplog.text, caplog.text
        assert not [record for record in caplog.records if record.exc_info], caplog.text
    finally:
        server.serving.limits = limits
        uvicorn_log.removeHandler(caplog.handler)


def test_a_context_error_names_the_field_the_client_sent(server):
    """Catches: a chat request's max_completion_tokens past the context answered as max_tokens's error."""
    messages = [{"role": "user", "content": "Hi"}]
    for field in "max_completion_tokens", "max_tokens":
        reply = post(server, "/v1/chat/completions", {"messages": messages, field: 10**6}, headers=AUTH)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == field, reply.text
        assert f"{field}=1000000" in reply.json()["error"]["message"], reply.text
