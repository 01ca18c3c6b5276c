"""The server under hostile load (nanoserve/entrypoints/openai/): every connection answers at once
(TCP_NODELAY), no request holds the tokenizer thread or the event loop for long, and the small
promises (one-line option errors, empty prompts refused, text_offset one frame) hold."""
import socket
import statistics
import time

import httpx
import pytest
from test_serve import KEY, NAME, PROMPTS, events, model_path, offline, post, start_server  # noqa: F401 (fixtures)

import nanoserve
from nanoserve.entrypoints.openai import api_server
from nanoserve.entrypoints.openai.protocol import Limits


@pytest.fixture(scope="module")
def server(model_path):  # noqa: F811
    server = start_server(model_path, api_key=KEY, limits=Limits(max_body_bytes=256 * 1024))
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


# Catches: the ~40 ms stall itself. The median of 20 kept-alive requests, against a bound well under
# the stall and well over what a 1-token completion of the bundled model costs on a loaded CPU.
def test_a_kept_alive_request_is_answered_without_the_nagle_stall(server):
    body = dict(model=NAME, prompt="Hi", max_tokens=1)
    with httpx.Client(base_url=server.url, headers=AUTH, timeout=60) as client:
        client.post("/v1/completions", json=body)  # warm up (the connection, the first step)
        times = []
        for _ in range(20):
            start = time.perf_counter()
            assert client.post("/v1/completions", json=body).status_code == 200
            times.append(time.perf_counter() - start)
    assert statistics.median(times) < 0.025, times


# --- The command line ----------------------------------------------------------------------------

# Catches: --port 99999 or -1 a traceback from bind (OverflowError, exit 1) instead of one line, exit 2.
@pytest.mark.parametrize("port", ["99999", "-1", "65536"])
def test_a_port_out_of_range_is_one_line(port, monkeypatch, capsys):
    monkeypatch.setattr(api_server, "LLMEngine", lambda config: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as exit_:
        api_server.main([nanoserve.DEFAULT_MODEL, "--port", port])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "--port" in err, err


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
