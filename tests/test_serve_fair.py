"""The server under hostile load, its admission side: bounded by default (completions per request, and
in flight), slots that follow the engine rather than the socket, and a write timeout for a client that
stops reading. (Fair turns between HTTP requests are tested on AsyncLLM: tests/test_async_llm.py.)"""
import contextlib
import json
import logging
import socket
import threading
import time
from dataclasses import replace

import httpx
import pytest
from test_serve import ENGINE, NAME, model_path, post  # noqa: F401 (fixtures)

from nanoserve import LLMEngine
from nanoserve.config import Config
from nanoserve.entrypoints.openai.api_server import ServerThread, build_app
from nanoserve.entrypoints.openai.protocol import Limits
from nanoserve.entrypoints.openai.serving_engine import client_key


def start_server(path: str, max_num_seqs: int = 256, limits: Limits = Limits()) -> ServerThread:
    engine = LLMEngine(Config.from_kwargs(path, **{**ENGINE, "max_num_seqs": max_num_seqs}))
    return ServerThread(build_app(engine, NAME, limits=limits)).start()


def wait_until(condition, seconds: float = 60.0) -> bool:
    """Poll `condition` until it holds; False if it never did (a deadline for a hang, not a measurement)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def open_unread_stream(server: ServerThread, body: dict) -> socket.socket:
    """A streamed request from a client that never reads: tiny socket buffers (the server's as well: an
    accepted socket takes its listening socket's), so that the server's writes soon block on it."""
    server.server.servers[0].sockets[0].setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: it sets the TCP window
    host, port = server.server.servers[0].sockets[0].getsockname()[:2]
    sock.connect((host, port))
    content = json.dumps(body).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(content)}\r\n\r\n".encode() + content)
    return sock


# Many completions, each chunk large (20 logprobs): far more than the socket's buffers hold.
BIG_STREAM = dict(prompt="It is a truth", n=8, max_tokens=100, logprobs=20, ignore_eos=True, stream=True)


def test_a_huge_fan_out_is_a_400_by_default(model_path):  # noqa: F811
    # Catches: no default bound on completions per request: 1,000 prompts x n=128 in a 15 KB body
    # became 128,000 engine requests.
    server = start_server(model_path)
    try:
        reply = post(server, "/v1/completions", dict(prompt=[[1, 2]] * 1000, n=128, max_tokens=1), timeout=30)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt"
        assert "--max-completions-per-request" in reply.json()["error"]["message"]
        assert "--max-completions-per-request" in reply.json()["error"]["message"]
        assert post(server, "/v1/completions", dict(prompt=[[1, 2]] * 3, n=86, max_tokens=1)).status_code == 400
        assert server.serving.num_in_flight == 0 and not server.serving.async_llm.engine.requests
    finally:
        server.stop()


def test_completions_in_flight_are_bounded_by_default(model_path):  # noqa: F811
    # Catches: no default bound on completions in flight (--max-num-queued-requests off unless set):
    # the default is 4 x max_num_seqs, here 4 x 2.
    server = start_server(model_path, max_num_seqs=2)
    engine, gate = server.serving.async_llm.engine, threading.Event()
    step = engine.step

    def step_once_open():  # nothing finishes until the gate opens
        gate.wait()
        return step()
    engine.step = step_once_open
    try:
        assert server.serving.max_in_flight == 8
        first = threading.Thread(target=post, args=(server, "/v1/completions", dict(prompt="It is", n=8, max_tokens=2)))
        first.start()
        assert wait_until(lambda: server.serving.num_in_flight == 8)
        reply = post(server, "/v1/completions", dict(prompt="It is", max_tokens=1))
        assert reply.status_code == 429 and reply.json()["error"]["type"] == "rate_limit_error"
        assert "at most 8" in reply.json()["error"]["message"]
        gate.set()
        first.join()
        assert post(server, "/v1/completions", dict(prompt="It is", max_tokens=1)).status_code == 200
    finally:
        gate.set()
        server.stop()


def test_a_client_that_does_not_read_holds_no_slots_once_the_engine_is_done(model_path, caplog):  # noqa: F811
    # Catches: slots released when the client's socket closes rather than when the engine finished
    # (a client that never read pinned its slots: every other client got 429 for 120 s), and no write
    # timeout (its connection held for as long as it liked).
    server = start_server(model_path, max_num_seqs=2)  # at most 8 in flight: BIG_STREAM's n=8 takes them all
    serving, sockets = server.serving, []
    try:
        unread = open_unread_stream(server, BIG_STREAM)
        sockets.append(unread)  # write_timeout 30 s: the engine finishes long before
        assert wait_until(lambda: serving.num_in_flight == 8)
        assert wait_until(lambda: serving.num_in_flight == 0)  # the engine finished: its slots are back ...
        assert "whose client took nothing" not in caplog.text  # ... not because the stream gave up
        assert post(server, "/v1/completions", dict(prompt="It is", max_tokens=1)).status_code == 200
        unread.close()

        serving.limits = replace(serving.limits, write_timeout=0.5)
        with caplog.at_level(logging.WARNING):
            unread = open_unread_stream(server, BIG_STREAM)
            sockets.append(unread)
            assert wait_until(lambda: "whose client took nothing for 0.5 s" in caplog.text)
        received = b""
        while chunk := unread.recv(65536):  # what the buffers held, then the end: the server closed it
            received += chunk
        assert b"data: " in received and b"[DONE]" not in received
        unread.close()
        assert wait_until(lambda: serving.num_in_flight == 0 and not serving.async_llm.engine.requests)
    finally:
        for sock in sockets:  # else stop() waits for them
            sock.close()
        server.stop()


def test_a_whole_reply_that_is_not_read_is_closed_after_the_write_timeout(model_path, caplog):  # noqa: F811
    """Catches: --write-timeout applied to streams only (seven unread n=128 whole replies held 427 MB past
    three timeouts)."""
    server = start_server(model_path, limits=Limits(write_timeout=0.5))
    try:
        with caplog.at_level(logging.WARNING), open_unread_stream(server, {**BIG_STREAM, "stream": False}) as unread:
            assert wait_until(lambda: "whose client took nothing for 0.5 s" in caplog.text)
            received = b""
            while chunk := unread.recv(65536):  # what the buffers held, then the end: the server closed it
                received += chunk
        assert received.startswith(b"HTTP/1.1 200") and not received.endswith(b"}")
        assert wait_until(lambda: server.serving.num_in_flight == 0)
    finally:
        server.stop()


def test_each_client_holds_at_most_its_share_of_the_in_flight_slots(model_path):  # noqa: F811
    """Catches: one bound for all clients (one client's 1,024 in flight gave everyone else 429 for 18 s), the
    client taken from what the request says of itself (its user, an unchecked Bearer value), slots not given
    back."""
    default = start_server(model_path, limits=Limits(max_num_queued_requests=16))
    default.stop()
    assert default.serving.max_in_flight_per_client == 14  # 7/8
    server = start_server(model_path, limits=Limits(max_num_queued_requests=6, max_num_queued_requests_per_client=3))
    try:
        serving = server.serving
        peer = client_key({}, "127.0.0.1", by_api_key=False)
        assert peer == client_key({"authorization": "Bearer k1"}, "127.0.0.1", by_api_key=False)
        keyed = client_key({"authorization": "Bearer k1"}, "10.0.0.1", by_api_key=True)
        assert keyed != peer and "k1" not in keyed
        assert keyed == client_key({"authorization": "bearer k1"}, "10.0.0.2", by_api_key=True)
        serving.admit(3, peer)  # as three long streams from this address would
        for user, bearer in ("mallory", "r1"), ("alice", "r2"):  # neither makes a new client
            reply = post(server, "/v1/completions", dict(prompt="Hi", max_tokens=1, user=user),
                         headers={"Authorization": f"Bearer {bearer}"})
            assert reply.status_code == 429 and "this client" in reply.json()["error"]["message"], reply.text
        serving.release(peer, 3)
        assert post(server, "/v1/completions", dict(prompt="Hi", max_tokens=1, user="mallory")).status_code == 200
        assert wait_until(lambda: serving.num_in_flight == 0 and not serving.in_flight_by_client)
    finally:
        server.stop()


def can_bind(address: str) -> bool:
    try:
        with socket.socket() as sock:
            sock.bind((address, 0))
        return True
    except OSError:
        return False


def client_at(address: str) -> httpx.Client:
    """An HTTP client whose connections come from `address` (any 127.x.y.z is the loopback on Linux)."""
    return httpx.Client(timeout=60, transport=httpx.HTTPTransport(local_address=address))


@pytest.mark.skipif(not (can_bind("127.0.0.2") and can_bind("127.0.0.3")),
                    reason="this OS binds only 127.0.0.1 (macOS): no second loopback address to tell clients apart")
def test_a_client_is_its_address_whatever_user_and_bearer_it_sends(model_path):  # noqa: F811
    """Beside a client at its share, from 127.0.0.2, sending a new user and a new Bearer value with each request
    (the server checks no key), a lone client from 127.0.0.3 is served, and the hostile one gets 429 each time.
    Catches: fairness keyed by a value the client chooses (300 streams, each with a random user, made a lone
    client wait 28.7 s for its first token, and took every in-flight slot: six 429s for the lone client)."""
    server = start_server(model_path, limits=Limits(max_num_queued_requests=8, max_num_queued_requests_per_client=3))
    body = dict(prompt="It is a truth", max_tokens=100, ignore_eos=True, stream=True)
    try:
        with client_at("127.0.0.2") as hostile, client_at("127.0.0.3") as lone, contextlib.ExitStack() as streams:
            for i in range(3):
                stream = streams.enter_context(hostile.stream(
                    "POST", server.url + "/v1/completions", json={**body, "user": f"u{i}"},
                    headers={"Authorization": f"Bearer random-{i}"}))
                assert stream.status_code == 200
            assert set(server.serving.in_flight_by_client) == {"peer:127.0.0.2"}
            for i in range(3, 6):
                reply = hostile.post(server.url + "/v1/completions", json=dict(prompt="Hi", max_tokens=1, user=f"u{i}"),
                                     headers={"Authorization": f"Bearer random-{i}"})
                assert reply.status_code == 429 and "this client" in reply.json()["error"]["message"], reply.text
            reply = lone.post(server.url + "/v1/completions", json=dict(prompt="Emma", max_tokens=2))
            assert reply.status_code == 200 and reply.json()["choices"][0]["text"], reply.text
        assert wait_until(lambda: server.serving.num_in_flight == 0)
    finally:
        server.stop()


def test_one_request_of_n_takes_at_most_its_clients_seats_however_often_it_ends(model_path):  # noqa: F811
    """A client's n=8 stream gets 7 of the engine's 8 seats (its share), the 8th waiting its turn. After the
    client leaves (its requests aborted), the same again: the client holds nothing.
    Catches: the engine stream opened without its client (one n=8 request took all 8 seats), and an ended
    request left in the per-client count (aborted twice over: the count went negative, past the share)."""
    server = start_server(model_path, max_num_seqs=8)
    loop, engine = server.serving.async_llm.engine_loop, server.serving.async_llm.engine
    gate, step = threading.Event(), engine.step
    engine.step = lambda: gate.wait() and step()  # the test says when the engine steps: no race with its pace
    body = dict(prompt="It is a truth", n=8, max_tokens=100, ignore_eos=True, stream=True)
    try:
        for _ in range(2):
            gate.clear()
            with open_unread_stream(server, body):  # its first chunk waits for a step: no reply to wait for
                assert wait_until(lambda: len(engine.requests) == 7 and len(loop.pending) == 1)
            assert wait_until(lambda: loop.inbox.qsize() == 8)  # the client left: its 8 requests' aborts
            gate.set()
            assert wait_until(lambda: not engine.requests and not loop.pending)
            assert wait_until(lambda: not loop.num_in_engine and not server.serving.in_flight_by_client)
    finally:
        gate.set()
        server.stop()


@pytest.mark.skipif(not can_bind("127.0.0.3"), reason="this OS binds only 127.0.0.1: no second client address")
def test_a_lone_clients_request_goes_before_another_clients_preempted_ones(model_path):  # noqa: F811
    """One client's three long requests outgrow the KV cache: one is preempted, and goes back to the front of
    the engine's queue. A lone client's request, arriving then, goes before it: its one token comes while all
    three still run. Catches: the lone request queued behind the preempted one, so behind the blocks the
    others hold (it waited 102.6 s on SmolLM2 beside four 1,000-token requests; 0.07 s alone)."""
    server = start_server(model_path)
    engine = server.serving.async_llm.engine
    loop, gate, paused, step = server.serving.async_llm.engine_loop, threading.Event(), threading.Event(), engine.step

    def gated_step():  # the first step that preempts returns when the test says: the lone request waits then
        result = step()
        if engine.scheduler.num_preemptions and not paused.is_set():
            paused.set()
            gate.wait()
        return result
    engine.step, hog = gated_step, None
    try:
        hog = open_unread_stream(server, dict(prompt="It is a truth", n=3, max_tokens=120, ignore_eos=True,
                                              stream=True))
        assert wait_until(paused.is_set)  # a step preempted: the waiting queue's front is the hog's
        assert len(engine.requests) == 3 and len(engine.scheduler.waiting) > 0
        with client_at("127.0.0.3") as lone:
            threading.Thread(target=lambda: wait_until(lambda: loop.inbox.qsize() > 0) and gate.set()).start()
            reply = lone.post(server.url + "/v1/completions", json=dict(prompt="Emma", max_tokens=1))
            assert reply.status_code == 200, reply.text
            assert len(engine.requests) == 3, "none of the hog's requests finished before the lone one"
    finally:
        gate.set()
        engine.step = step
        if hog is not None:
            hog.close()
        server.stop()


def test_with_several_api_keys_each_key_is_a_client_and_a_proxy_is_trusted_only_when_named(model_path):  # noqa: F811
    """Catches: several keys not taken (--api-key given twice, or a file of them), clients of different keys
    sharing one share, X-Forwarded-For believed from any local client (uvicorn's default trusts 127.0.0.1),
    and not believed from a proxy named by --forwarded-allow-ips."""
    limits = Limits(max_num_queued_requests=8, max_num_queued_requests_per_client=3)
    servers = [ServerThread(build_app(LLMEngine(Config.from_kwargs(model_path, **ENGINE)), NAME, limits=limits,
                                      api_key=keys), forwarded_allow_ips=proxies).start()
               for keys, proxies in ((["k1", "k2"], None), (None, "127.0.0.1"), (None, None))]
    keyed, proxied, direct = servers
    try:
        keyed.serving.admit(3, client_key({"authorization": "Bearer k1"}, None, by_api_key=True))
        assert post(keyed, "/v1/completions", dict(prompt="Hi", max_tokens=1),
                    headers={"Authorization": "Bearer k1"}).status_code == 429
        assert post(keyed, "/v1/completions", dict(prompt="Hi", max_tokens=1),
                    headers={"Authorization": "Bearer k2"}).status_code == 200
        assert post(keyed, "/v1/completions", dict(prompt="Hi", max_tokens=1),
                    headers={"Authorization": "Bearer k3"}).status_code == 401
        # Two headers: the key check read the last, client_key the first (a new client each request).
        two = [("Authorization", "Bearer random-1"), ("Authorization", "Bearer k1")]
        reply = httpx.post(keyed.url + "/v1/completions", json=dict(prompt="Hi", max_tokens=1), headers=two)
        assert reply.status_code == 400 and "Authorization" in reply.json()["error"]["message"], reply.text
        for server in proxied, direct:
            server.serving.admit(3, "peer:10.0.0.7")
        forwarded = {"X-Forwarded-For": "10.0.0.7"}
        assert post(proxied, "/v1/completions", dict(prompt="Hi", max_tokens=1), headers=forwarded).status_code == 429
        assert post(proxied, "/v1/completions", dict(prompt="Hi", max_tokens=1),
                    headers={"X-Forwarded-For": "10.0.0.8"}).status_code == 200
        # The proxy appends the address it saw: what comes before it, the client wrote itself.
        assert post(proxied, "/v1/completions", dict(prompt="Hi", max_tokens=1),
                    headers={"X-Forwarded-For": "10.0.0.9, 10.0.0.7"}).status_code == 429
        assert post(direct, "/v1/completions", dict(prompt="Hi", max_tokens=1), headers=forwarded).status_code == 200
    finally:
        for server in servers:
            server.stop()


def test_a_proxy_trusted_as_any_address_is_refused(capsys):
    """Catches: --forwarded-allow-ips '*' taken, and uvicorn then believing X-Forwarded-For's first address,
    which the client writes (12 of 12 requests got past a per-client bound of 8)."""
    from nanoserve.entrypoints.openai.api_server import build_parser, main
    for proxies in ("*", "127.0.0.1, *"):
        with pytest.raises(ValueError, match="forwarded-allow-ips"):
            ServerThread(object(), forwarded_allow_ips=proxies)
        with pytest.raises(SystemExit):
            main(["no-such-model", "--forwarded-allow-ips", proxies, "--port", "0"])
        assert "forwarded-allow-ips '*'" in capsys.readouterr().err
    assert build_parser("serve").parse_args(["m", "--forwarded-allow-ips", "10.0.0.0/8"])


@pytest.mark.parametrize("peer, forwarded, proxies, client", [
    ("::ffff:127.0.0.1", b"10.0.0.7", "127.0.0.1", "10.0.0.7"),   # an IPv4 proxy on --host ::
    ("::ffff:10.0.0.5", None, None, "10.0.0.5"),                   # the same client on either stack
    ("::ffff:127.0.0.1", b"::ffff:10.0.0.7", "127.0.0.1", "10.0.0.7"),
    ("::1", b"10.0.0.7", "127.0.0.1", "::1"),                      # not a trusted proxy
    ("127.0.0.1", b"10.0.0.9, 10.0.0.7, 127.0.0.1", "127.0.0.1", "10.0.0.7"),  # rightmost untrusted
])
def test_the_client_address_is_plain_ipv4_and_the_rightmost_untrusted(peer, forwarded, proxies, client):
    """Catches: an IPv4-mapped peer (::ffff:127.0.0.1 on a dual-stack socket) not matching the trusted
    proxy 127.0.0.1, so every client behind it counted as one; the first forwarded address believed."""
    import asyncio

    from nanoserve.entrypoints.openai.api_server import ClientAddress
    seen = []

    async def app(scope, receive, send):
        seen.append(scope["client"][0])
    headers = [(b"x-forwarded-for", forwarded)] if forwarded else []
    scope = dict(type="http", client=(peer, 5000), headers=headers, path="/")
    asyncio.run(ClientAddress(app, proxies)(scope, None, None))
    assert seen == [client]


def test_api_keys_come_from_the_command_line_and_a_file(tmp_path):
    """Catches: --api-key taken once only (the last given winning), a key file's blank lines taken as keys."""
    from nanoserve.entrypoints.openai.api_server import build_parser, read_api_keys
    (tmp_path / "keys").write_text("k2\n\n k3 \n")
    args = build_parser("serve").parse_args(["m", "--api-key", "k0", "--api-key", "k1", "--api-key-file",
                                              str(tmp_path / "keys")])
    assert read_api_keys(args.api_key, args.api_key_file) == ["k0", "k1", "k2", "k3"]
    with pytest.raises(ValueError, match="cannot read"):
        read_api_keys(None, str(tmp_path / "missing"))
