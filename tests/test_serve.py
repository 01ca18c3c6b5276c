"""The OpenAI-compatible server (nanoserve/entrypoints/openai/), started on 127.0.0.1 and a free port, against
the bundled model with a chat template added; replies must equal LLM.generate / LLM.chat offline."""
import pytest

# Test extras (pyproject.toml's [test]) this module needs: without one it is skipped, not an error
pytest.importorskip("httpx")
pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
import json
import logging
import shutil
import socket
import threading
import time
from dataclasses import replace

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

import nanoserve
from nanoserve import LLM, LLMEngine, SamplingParams
from nanoserve.config import Config
from nanoserve.entrypoints.openai import api_server
from nanoserve.entrypoints.openai.api_server import ServerThread, build_app
from nanoserve.entrypoints.openai.protocol import Limits

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
# 24 usable blocks of 8 slots: 32 concurrent requests cannot all fit, so some wait or are preempted.
ENGINE = dict(device="cpu", block_size=8, num_kvcache_blocks=25, max_model_len=128)
NAME, KEY = "tiny-austen", "sk-test"
LIMITS = Limits(max_body_bytes=256 * 1024)
PROMPTS = ["It is a truth universally acknowledged", "Mr. Darcy looked at her, and", "Elizabeth", "She was"]
GREEDY = SamplingParams(temperature=0, max_tokens=12)
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = shutil.copytree(nanoserve.DEFAULT_MODEL, tmp_path_factory.mktemp("serve") / "chat-model")
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return str(path)


@pytest.fixture(scope="module")
def offline(model_path):
    return LLM(model_path, **ENGINE)


def start_server(model_path, **app_options) -> ServerThread:
    header_timeout = app_options.pop("header_timeout", 10.0)
    engine = LLMEngine(Config.from_kwargs(model_path, **ENGINE))
    return ServerThread(build_app(engine, NAME, **app_options), header_timeout=header_timeout).start()


@pytest.fixture(scope="module")
def server(model_path):
    server = start_server(model_path, api_key=KEY, limits=LIMITS)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def post(server, path, body, headers=AUTH, timeout=60):
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json", **headers},
                      timeout=timeout)


def events(server, body, headers=AUTH) -> list[dict | str]:
    """A streamed request's data events, each parsed (or "[DONE]")."""
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        return [line[6:] if line == "data: [DONE]" else json.loads(line[6:])
                for line in r.iter_lines() if line.startswith("data: ")]


def metrics(server) -> dict[str, float]:
    """Every sample but histogram buckets, by name and its labels other than model_name (always NAME)."""
    text = httpx.get(server.url + "/metrics", headers=AUTH).text
    values = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert sample.labels["model_name"] == NAME
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()) if k != "model_name")
            if "le" not in sample.labels:
                values[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return values


def wait_for_free_blocks(server, seconds=10.0) -> dict[str, float]:
    deadline = time.time() + seconds
    while (m := metrics(server))["vllm:kv_cache_usage_perc"] > 0 and time.time() < deadline:
        time.sleep(0.05)
    return m


def slow_steps(monkeypatch, server, seconds):
    engine = server.serving.async_llm.engine
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: time.sleep(seconds) or step())


# --- What the server answers equals what the engine generates offline ----------------------------

# Catches: completions (plain and streamed) whose text, finish_reason or usage differ from LLM.generate.
def test_completions_match_generate(client, offline):
    expected = offline.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0]
    reply = client.completions.create(model=NAME, prompt=PROMPTS[0], temperature=0, max_tokens=12)
    assert reply.choices[0].text == expected.text and reply.choices[0].finish_reason == expected.finish_reason
    assert reply.id.startswith("cmpl-") and reply.object == "text_completion" and reply.model == NAME
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (len(expected.prompt_token_ids), 12)
    assert reply.usage.total_tokens == len(expected.prompt_token_ids) + 12
    chunks = list(client.completions.create(model=NAME, prompt=expected.prompt_token_ids, temperature=0,
                                            max_tokens=12, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices


# Catches: stream_options taken as include_usage whatever it says; vLLM's default (include_usage
# left out: included) not followed; stream_options without stream accepted.
def test_stream_options_include_usage(server):
    body = dict(model=NAME, prompt=PROMPTS[2], max_tokens=3, temperature=0, stream=True)
    assert not any("usage" in e for e in events(server, body)[:-1])
    assert not any("usage" in e for e in events(server, {**body, "stream_options": {"include_usage": False}})[:-1])
    for options in ({"include_usage": True}, {}):
        *chunks, done = events(server, {**body, "stream_options": options})
        assert done == "[DONE]" and chunks[-1]["usage"]["completion_tokens"] == 3 and chunks[-1]["choices"] == []
    reply = post(server, "/v1/completions", {**body, "stream": False, "stream_options": {"include_usage": True}})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "stream_options"


# Catches: a list of prompts served as one, out of order, or with one prompt's choice under another's index.
def test_a_list_of_prompts_is_one_choice_each_in_order(server, offline):
    params = SamplingParams(temperature=0, max_tokens=6)
    expected = offline.generate(PROMPTS, params, use_tqdm=False)
    for prompts in (PROMPTS, [o.prompt_token_ids for o in expected]):
        body = dict(model=NAME, prompt=prompts, max_tokens=6, temperature=0)
        reply = post(server, "/v1/completions", body).json()
        assert [c["index"] for c in reply["choices"]] == [0, 1, 2, 3]
        assert [c["text"] for c in reply["choices"]] == [o.text for o in expected]
        assert reply["usage"]["prompt_tokens"] == sum(len(o.prompt_token_ids) for o in expected)
        chunks = events(server, {**body, "stream": True})[:-1]
        texts = ["".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i) for i in range(4)]
        assert texts == [o.text for o in expected]
        assert sum(c["choices"][0]["finish_reason"] is not None for c in chunks) == 4


# Catches: ignore_eos not passed to the engine (the request stops at EOS).
def test_ignore_eos(server, offline):
    prompt = "She was"
    greedy = SamplingParams(temperature=0, max_tokens=100)
    assert offline.generate(prompt, greedy, use_tqdm=False)[0].finish_reason == "stop"
    expected = offline.generate(prompt, replace(greedy, ignore_eos=True), use_tqdm=False)[0]
    reply = post(server, "/v1/completions", dict(prompt=prompt, max_tokens=100, temperature=0, ignore_eos=True)).json()
    assert reply["choices"][0]["text"] == expected.text and reply["usage"]["completion_tokens"] == 100


# Catches: chat not formatted as LLM.chat formats it (template, no second <s>), a missing role chunk,
# max_completion_tokens ignored, stop strings not passed to the engine.
def test_chat_matches_llm_chat(client, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Who is Mr. Darcy?"}]
    cases = [(GREEDY, dict(max_completion_tokens=12)),
             (SamplingParams(temperature=0, max_tokens=30, stop=[" the"]), dict(max_tokens=30, stop=" the"))]
    for params, extra in cases:
        expected = offline.chat(messages, params, use_tqdm=False)[0]
        reply = client.chat.completions.create(model=NAME, messages=messages, temperature=0, **extra)
        assert reply.choices[0].message.content == expected.text and reply.choices[0].message.role == "assistant"
        assert reply.choices[0].finish_reason == expected.finish_reason and reply.id.startswith("chatcmpl-")
        assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)
        chunks = list(client.chat.completions.create(model=NAME, messages=messages, temperature=0, stream=True,
                                                     **extra))
        assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
        assert chunks[-1].choices[0].finish_reason == expected.finish_reason


# Catches: content as a list of text parts (OpenAI's format) refused, or its parts not joined as vLLM joins them.
def test_chat_content_as_text_parts(server, offline):
    parts = [{"type": "text", "text": "Who is"}, {"type": "text", "text": "Mr. Darcy?"}]
    expected = offline.chat([{"role": "user", "content": "Who is\nMr. Darcy?"}], GREEDY, use_tqdm=False)[0]
    reply = post(server, "/v1/chat/completions", dict(messages=[{"role": "user", "content": parts}], max_tokens=12,
                                                      temperature=0))
    assert reply.json()["choices"][0]["message"]["content"] == expected.text


# Catches: requests crossed between streams, lost or repeated deltas under load, an engine touched from
# two threads (32 streaming clients at once on a KV cache too small for all of them); the preemption
# counter adding the engine's running total at every step instead of what is new.
def test_concurrent_streams_match_generate(server, offline):
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(32)]
    params = [SamplingParams(temperature=0, max_tokens=40 + i % 9, ignore_eos=True) for i in range(32)]
    expected = [o.text for o in offline.generate(prompts, params, use_tqdm=False)]
    texts: list[str | None] = [None] * 32
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
    engine = server.serving.async_llm.engine
    before, preemptions_before = metrics(server), engine.stats()["num_preemptions"]

    def run(i):
        stream = client.completions.create(model=NAME, prompt=prompts[i], temperature=0, stream=True,
                                           max_tokens=params[i].max_tokens, extra_body={"ignore_eos": True})
        texts[i] = "".join(c.choices[0].text for c in stream)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert texts == expected
    after = wait_for_free_blocks(server)
    assert after["nanoserve:num_free_blocks"] == 24
    num_preemptions = engine.stats()["num_preemptions"] - preemptions_before
    assert num_preemptions > 0, "nothing was preempted: the counter is not tested"
    assert after["vllm:num_preemptions_total"] - before["vllm:num_preemptions_total"] == num_preemptions


# --- Clients that leave --------------------------------------------------------------------------

# Catches: a client that leaves mid-stream keeping its request running and its KV blocks held; its
# e2e latency observed (it says when the client left, not how fast the server is); TTFT observed only
# when a request finishes (as vLLM, at the first token: a running request's shows while it runs, and
# an aborted stream that got a token counts, once); TTFT counted from the step, not the arrival.
def test_disconnect_mid_stream_frees_blocks(server, monkeypatch):
    slow_steps(monkeypatch, server, 0.02)  # 100 tokens take 2 s
    before = metrics(server)
    body = dict(model=NAME, prompt=PROMPTS[1], max_tokens=100, temperature=0, stream=True, ignore_eos=True)
    sent = time.perf_counter()
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                waited = time.perf_counter() - sent  # the first token's time, as this client saw it
                running = metrics(server)
                assert running["vllm:kv_cache_usage_perc"] > 0  # held while we listen
                break  # leave (httpx closes the connection here)
    m = wait_for_free_blocks(server)
    assert m["vllm:kv_cache_usage_perc"] == 0 and m["vllm:num_requests_running"] == 0
    # aborted, not run to the end
    assert m["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < 50
    assert m["vllm:request_success_total{finished_reason=abort}"] - before.get(
        "vllm:request_success_total{finished_reason=abort}", 0) == 1
    ttft = "vllm:time_to_first_token_seconds"
    assert running[ttft + "_count"] - before[ttft + "_count"] == 1
    assert m[ttft + "_count"] - before[ttft + "_count"] == 1
    assert 0.02 <= m[ttft + "_sum"] - before[ttft + "_sum"] <= waited  # at least the slowed prefill step
    assert m["vllm:e2e_request_latency_seconds_count"] == before["vllm:e2e_request_latency_seconds_count"]


# Catches: a non-streamed request whose client gave up running on to the end (200 clients that left
# after 0.3 s cost 40,000 tokens).
def test_disconnect_before_a_whole_response_aborts(server, monkeypatch):
    slow_steps(monkeypatch, server, 0.02)
    before = metrics(server)
    with pytest.raises(httpx.ReadTimeout):
        post(server, "/v1/completions", dict(prompt=PROMPTS[1], max_tokens=100, temperature=0, ignore_eos=True),
             timeout=0.4)
    m = wait_for_free_blocks(server)
    assert m["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] < 50
    assert m["vllm:request_success_total{finished_reason=abort}"] - before.get(
        "vllm:request_success_total{finished_reason=abort}", 0) == 1


# --- Bad input: an OpenAI error naming the problem, and the server serves on ----------------------

BAD = [  # (path, body, status, words the message must name, param)
    ("/v1/completions", "{not json", 400, "JSON", None),
    ("/v1/completions", b'{"prompt": "\xff"}', 400, "JSON", None),        # not UTF-8
    ("/v1/completions", "[" * 100_000, 400, "JSON", None),                 # nested too deep
    ("/v1/completions", '{"prompt": "a", "seed": 1' + "0" * 5000 + "}", 400, "JSON", None),  # 5001 digits
    ("/v1/completions", "[]", 400, "JSON object", None),
    ("/v1/completions", dict(model=NAME), 400, "prompt", "prompt"),
    ("/v1/completions", dict(model=NAME, prompt=5), 400, "prompt", "prompt"),
    ("/v1/completions", dict(model=NAME, prompt=[1, "a"]), 400, "prompt", "prompt"),
    ("/v1/completions", dict(model=NAME, prompt=[]), 400, "empty", "prompt"),
    ("/v1/completions", dict(model=NAME, prompt="Hi", max_tokens="5"), 400, "max_tokens", "max_tokens"),
    ("/v1/completions", dict(model="gpt-4", prompt="Hi"), 404, "gpt-4", "model"),
    ("/v1/completions", dict(model=NAME, prompt="Hi " * 200), 400, "max_model_len", "prompt"),
    ("/v1/completions", dict(model=NAME, prompt="Hi", max_tokens=127), 400, "context length exceeded", "max_tokens"),
    ("/v1/completions", dict(model=NAME, prompt=[99999]), 400, "vocab_size", "prompt"),
    ("/v1/completions", dict(model=NAME, prompt="Hi", max_tokens=0), 400, "max_tokens", "max_tokens"),
    ("/v1/completions", dict(model=NAME, prompt="Hi", temperature=-1), 400, "temperature", "temperature"),
    ("/v1/completions", dict(model=NAME, prompt="Hi", top_p=0), 400, "top_p", "top_p"),
    ("/v1/completions", dict(model=NAME, prompt="Hi", stop_token_ids=[99999]), 400, "stop_token_ids", "stop_token_ids"),
    ("/v1/completions", dict(model=NAME, prompt="Hi", stream=True, max_tokens=-3), 400, "max_tokens", "max_tokens"),
    ("/v1/completions", dict(model=NAME, prompt="Hi", stop=["x"] * 33), 400, "at most 32", "stop"),
    ("/v1/completions", dict(model=NAME, prompt="Hi", stop="x" * 1025), 400, "1024 characters", "stop"),
    ("/v1/completions", dict(model=NAME, prompt="Hi", stop=[""]), 400, "stop", "stop"),
    ("/v1/completions", dict(model=NAME, prompt="Hi", n=0), 400, "n must be from 1 to 128", "n"),
    ("/v1/completions", dict(model=NAME, prompt="Hi", n=129), 400, "n must be from 1 to 128", "n"),
    ("/v1/completions", dict(model=NAME, prompt="Hi", n=2.0), 400, "n", "n"),
    ("/v1/completions", dict(model=NAME, prompt="Hi", logprobs=21), 400,
     "Requested logprobs of 21, which is greater than max allowed: 20", "logprobs"),
    ("/v1/completions", dict(model=NAME, prompt="Hi", logprobs=-1), 400, "logprobs must be from 0 to 20", "logprobs"),
    ("/v1/completions", dict(model=NAME, prompt="Hi", logprobs=True), 400, "logprobs", "logprobs"),
    ("/v1/completions", dict(model=NAME, prompt="Hi", prompt_logprobs=21), 400,
     "Requested prompt_logprobs of 21, which is greater than max allowed: 20", "prompt_logprobs"),
    ("/v1/completions", dict(model=NAME, prompt="Hi", prompt_logprobs=1, stream=True), 400, "streamed",
     "prompt_logprobs"),
    ("/v1/completions", dict(model=NAME, prompt="Hi", top_logprobs=2), 400, "not supported", "top_logprobs"),
    ("/v1/completions", dict(model=NAME, prompt="Hi", best_of=2), 400, "not supported", "best_of"),
    ("/v1/completions", dict(model=NAME, prompt="Hi", suffix="x"), 400, "not supported", "suffix"),
    ("/v1/completions", dict(model=NAME, prompt="Hi", frequency_penalty=2.5), 400, "[-2, 2]", "frequency_penalty"),
    ("/v1/completions", dict(model=NAME, prompt="Hi", presence_penalty=-3), 400, "[-2, 2]", "presence_penalty"),
    ("/v1/completions", dict(model=NAME, prompt="Hi", logit_bias={"4096": 10}), 400, "vocab_size", "logit_bias"),
    ("/v1/completions", dict(model=NAME, prompt="Hi", logit_bias={"a": 10}), 400, "token ids", "logit_bias"),
    ("/v1/completions", dict(model=NAME, prompt="Hi", structured_outputs={"regex": "(a"}), 400, "grammar",
     "structured_outputs"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=21), 400,
     "Requested top_logprobs of 21, which is greater than max allowed: 20", "top_logprobs"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "x"}], top_logprobs=2), 400,
     "`logprobs` must be set to true", "top_logprobs"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "x"}], logprobs=2), 400, "logprobs",
     "logprobs"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "x"}], n=129), 400, "128", "n"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "x"}], echo=True), 400, "not supported",
     "echo"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "x"}], prompt_logprobs=1), 400, "not supported",
     "prompt_logprobs"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "x"}], tools=[{"type": "function"}]), 400,
     "tools.0.function: Field required", "tools"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "x"}], response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}), 400, "grammar",
     "response_format"),
    ("/v1/chat/completions", dict(model=NAME, messages=[{"role": "user"}]), 400, "content", "messages"),
    ("/v1/chat/completions", dict(model=NAME, messages="hi"), 400, "messages", "messages"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]),
     400, "text parts", "messages"),
    ("/v1/chat/completions", dict(messages=[{"role": "user", "content": "hi \ud800"}]), 400, "Unicode", "messages"),
    ("/v1/chat/completions", dict(model=NAME, messages=[{"role": "user", "content": "x"}], max_completion_tokens=0),
     400, "max_tokens", "max_tokens"),
    ("/v1/completions", {"model": NAME, "prompt": "x" * 300_000}, 413, "262144 bytes", None),
    ("/tokenize", dict(prompt="a", messages=[]), 400, "either", "prompt"),
    ("/detokenize", dict(tokens=[5, 99999]), 400, "outside", "tokens"),
    ("/v1/nothing", dict(prompt="a"), 404, "Not Found", None),
]


# Catches: bad input answered with a 500, FastAPI's {"detail": ...}, an error that does not say what
# is wrong or names the wrong field ("prompt.str"), a silently ignored or cut parameter (best_of,
# penalties, tools, max_tokens past the context), n or logprobs past their caps taken, top_logprobs
# without logprobs taken, or a bad request that disturbs everyone else.
@pytest.mark.parametrize("path, body, status, words, param", BAD)
def test_bad_input_is_an_openai_error(server, path, body, status, words, param):
    if isinstance(body, dict):
        body = json.dumps(body)  # ASCII, so "\ud800" is sent as the escape json.dumps writes for half an emoji
    reply = post(server, path, body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert words in error["message"] and error["type"] == "invalid_request_error" and error["param"] == param
    assert post(server, "/v1/completions", dict(model=NAME, prompt="Hi", max_tokens=2)).status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200


# Catches: fields that mean "not used" refused (clients send n=1, penalties of 0, ...), and unknown
# fields refused instead of ignored with a log line, as vLLM does.
def test_fields_that_change_nothing_are_accepted_and_unknown_ones_logged(server, caplog):
    body = dict(prompt="Hi", max_tokens=2, n=1, logprobs=None, echo=False, frequency_penalty=0, presence_penalty=0.0,
                best_of=1, response_format={"type": "text"}, user="someone", temperature=None, frobnicate=3)
    with caplog.at_level(logging.WARNING, logger="nanoserve.entrypoints.openai.protocol"):
        reply = post(server, "/v1/completions", body)
    assert reply.status_code == 200, reply.text
    assert any("frobnicate" in r.getMessage() for r in caplog.records)


# Catches: a model name of a megabyte echoed whole in the 404.
def test_a_huge_model_name_is_not_echoed_whole(server):
    reply = post(server, "/v1/completions", dict(model="m" * 100_000, prompt="Hi"))
    assert reply.status_code == 404 and len(reply.text) < 1000


# Catches: a prompt too long for the context tokenized anyway (a 10 MiB prompt held every stream for
# half a minute): refused from its byte length alone.
def test_a_prompt_too_long_by_its_bytes_is_never_tokenized(server, monkeypatch):
    tokenizer, calls = server.serving.tokenizer, []
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text, **kwargs: calls.append(len(text)) or encode(text, **kwargs))
    reply = post(server, "/v1/completions", dict(prompt="Mr. Darcy " * 20_000))
    assert reply.status_code == 400 and "bytes" in reply.json()["error"]["message"] and calls == []
    assert post(server, "/v1/completions", dict(prompt="Mr. Darcy", max_tokens=2)).status_code == 200 and calls


# Catches: chat templates rendered or prompts tokenized on the event loop (a 200k-message chat held
# every stream for 10 s) or on the engine thread (every request waits).
def test_templates_and_tokenizing_run_on_the_tokenizer_thread(server, monkeypatch):
    tokenizer, threads = server.serving.tokenizer, []
    for name in ("encode", "apply_chat_template"):
        method = getattr(tokenizer, name)
        monkeypatch.setattr(tokenizer, name, lambda *args, method=method, **kwargs:
                            threads.append(threading.current_thread().name) or method(*args, **kwargs))
    assert post(server, "/v1/completions", dict(prompt="Hi", max_tokens=2)).status_code == 200
    reply = post(server, "/v1/chat/completions", dict(messages=[{"role": "user", "content": "Hi"}], max_tokens=2))
    assert reply.status_code == 200
    assert len(threads) == 3 and all(name.startswith("nanoserve-tokenizer") for name in threads), threads


# --- Authentication, models, health, tokenize ----------------------------------------------------

# Catches: an API key that is not checked, checked by substring or prefix, a "bearer" in another case
# refused (the scheme is case-insensitive), /health behind the key or without HEAD.
def test_api_key_and_health(server):
    body = dict(prompt="Hi", max_tokens=1)
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {KEY}x"},
                    {"Authorization": f"Bearer x{KEY}"}, {"Authorization": f"Token {KEY}"}, {"Authorization": KEY},
                    {"Authorization": f"Bearer {KEY[:-1]}"}, {"Authorization": f"xBearer {KEY}"}):
        reply = post(server, "/v1/completions", body, headers=headers)
        assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key", headers
    for scheme in ("Bearer", "bearer", "BEARER"):
        assert post(server, "/v1/completions", body, headers={"Authorization": f"{scheme} {KEY}"}).status_code == 200
    assert httpx.get(server.url + "/metrics").status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200
    assert httpx.head(server.url + "/health").status_code == 200


# Catches: /v1/models without what load generators read (id, root, max_model_len).
def test_models(server, model_path):
    [card] = httpx.get(server.url + "/v1/models", headers=AUTH).json()["data"]
    assert (card["id"], card["root"], card["max_model_len"], card["object"]) == (NAME, model_path, 128, "model")
    assert [m.id for m in openai.OpenAI(base_url=server.url + "/v1", api_key=KEY).models.list()] == [NAME]


# Catches: /tokenize counting otherwise than the completions it is used to size (a chat without its
# template, a prompt without <s>), /detokenize not the inverse, a missing /version.
def test_tokenize_detokenize_version(server, offline):
    tokenizer = offline.engine.tokenizer
    reply = post(server, "/tokenize", dict(model=NAME, prompt=PROMPTS[0], return_token_strs=True)).json()
    expected = offline.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].prompt_token_ids
    assert reply == dict(count=len(expected), max_model_len=128, tokens=expected,
                         token_strs=tokenizer.convert_ids_to_tokens(expected))
    messages = [{"role": "user", "content": "Who is Mr. Darcy?"}]
    reply = post(server, "/tokenize", dict(messages=messages)).json()
    assert reply["tokens"] == offline.chat(messages, GREEDY, use_tqdm=False)[0].prompt_token_ids
    assert post(server, "/detokenize", dict(tokens=expected)).json() == {"prompt": tokenizer.decode(expected)}
    assert isinstance(httpx.get(server.url + "/version", headers=AUTH).json()["version"], str)


# --- Metrics -------------------------------------------------------------------------------------

# Catches: /metrics that does not parse, counters that do not count, vLLM's names or model_name label missing,
# requests added not counted (scripts/soak.py compares them with those finished).
def test_metrics_count(server, client):
    before = metrics(server)
    prompt = "Mr. Bennet was among the earliest of those who waited on Mr. Bingley."  # 2 blocks for the second
    replies = [client.completions.create(model=NAME, prompt=prompt, temperature=0, max_tokens=5) for _ in range(2)]
    after = wait_for_free_blocks(server)

    def grew(name):
        return after[name] - before.get(name, 0)
    num_prompt_tokens = replies[0].usage.prompt_tokens
    assert grew("vllm:prompt_tokens_total") == grew("vllm:prefix_cache_queries_total") == 2 * num_prompt_tokens
    assert 16 <= grew("vllm:prefix_cache_hits_total") < num_prompt_tokens  # the first request finds none
    assert grew("vllm:generation_tokens_total") == 10
    assert grew("vllm:request_success_total{finished_reason=length}") == grew("nanoserve:requests_added_total") == 2
    for histogram in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        assert grew(f"vllm:{histogram}_seconds_count") == 2
    assert grew("vllm:time_per_output_token_seconds_count") == 8
    assert after["vllm:kv_cache_usage_perc"] == after["vllm:gpu_cache_usage_perc"] == 0
    assert {"vllm:num_requests_waiting", "vllm:num_requests_running", "nanoserve:requests_rejected_total"} <= set(after)


# Catches: TTFT, queue time and latency counted from add_request, not from the HTTP request's arrival
# (a request that waited 26.7 s reported a TTFT of 0.035 s).
def test_times_count_from_the_http_request(server, monkeypatch):
    engine = server.serving.async_llm.engine
    add_request = engine.add_request
    monkeypatch.setattr(engine, "add_request", lambda *args, **kwargs: time.sleep(0.5) or add_request(*args, **kwargs))
    before = metrics(server)
    assert post(server, "/v1/completions", dict(prompt="Hi", max_tokens=2)).status_code == 200
    after = wait_for_free_blocks(server)
    for histogram in ("time_to_first_token", "e2e_request_latency", "request_queue_time"):
        name = f"vllm:{histogram}_seconds"
        assert after[name + "_count"] - before[name + "_count"] == 1
        assert after[name + "_sum"] - before[name + "_sum"] >= 0.5, histogram


def test_a_fresh_server_shows_its_free_blocks(model_path):
    # Catches: gauges that read 0 (no free blocks) until the first request.
    server = start_server(model_path)
    try:
        assert metrics(server)["nanoserve:num_free_blocks"] == 24
    finally:
        server.stop()


# --- Failures ------------------------------------------------------------------------------------

# Catches: an error inside step() killing the engine loop, a 500 that says "invalid_request_error", a
# stream cut without an error event or [DONE] ("Exception in ASGI application").
def test_engine_error_is_a_500_then_serving_goes_on(server, monkeypatch):
    engine = server.serving.async_llm.engine
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: monkeypatch.setattr(engine, "step", step) or 1 / 0)  # fails once
    reply = post(server, "/v1/completions", dict(model=NAME, prompt="Hi", max_tokens=2))
    assert reply.status_code == 500 and "ZeroDivisionError" in reply.json()["error"]["message"]
    assert reply.json()["error"]["type"] == "server_error"
    assert post(server, "/v1/completions", dict(model=NAME, prompt="Hi", max_tokens=2)).status_code == 200
    steps = []

    def fail_on_the_fourth_step():
        steps.append(1)
        return 1 / 0 if len(steps) == 4 else step()
    monkeypatch.setattr(engine, "step", fail_on_the_fourth_step)
    *chunks, error, done = events(server, dict(prompt="Hi", max_tokens=10, stream=True))
    assert 1 <= len(chunks) <= 3 and all(c["choices"][0]["text"] for c in chunks)
    assert error["error"]["type"] == "server_error" and "ZeroDivisionError" in error["error"]["message"]
    assert done == "[DONE]"
    monkeypatch.setattr(engine, "step", step)
    assert post(server, "/v1/completions", dict(model=NAME, prompt="Hi", max_tokens=2)).status_code == 200
    assert wait_for_free_blocks(server)["nanoserve:num_free_blocks"] == 24


# Catches: an exception while adding a request (not a ValueError) killing the engine thread, so that
# every later request hangs.
def test_an_error_in_add_request_fails_that_request_only(server, monkeypatch):
    engine = server.serving.async_llm.engine
    add_request = engine.add_request

    def fail_once(*args, **kwargs):
        monkeypatch.setattr(engine, "add_request", add_request)
        raise TypeError("boom")
    monkeypatch.setattr(engine, "add_request", fail_once)
    reply = post(server, "/v1/completions", dict(prompt="Hi", max_tokens=2))
    assert reply.status_code == 500 and "TypeError" in reply.json()["error"]["message"]
    assert post(server, "/v1/completions", dict(prompt="Hi", max_tokens=2)).status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200


# Catches: an engine loop that dies silently: /health still 200 and every request hanging.
def test_a_dead_engine_loop_says_so(model_path):
    server = start_server(model_path)
    try:
        engine = server.serving.async_llm.engine
        engine.has_unfinished_requests = lambda: 1 / 0  # the loop's own code fails, outside any request
        reply = post(server, "/v1/completions", dict(prompt="Hi", max_tokens=2), timeout=10)
        assert reply.status_code == 503 and reply.json()["error"]["type"] == "server_error"
        assert httpx.get(server.url + "/health").status_code == 503
        assert post(server, "/v1/completions", dict(prompt="Hi", max_tokens=2), timeout=10).status_code == 503
    finally:
        server.stop()


# Catches: an unbounded queue (a burst queues everything), 429s that come only after a wait, accepted
# requests that do not complete exactly, rejections not counted.
def test_a_burst_past_max_num_queued_requests_gets_429_at_once(model_path, offline):
    server = start_server(model_path, limits=Limits(max_num_queued_requests=2))
    engine = server.serving.async_llm.engine
    step = engine.step
    engine.step = lambda: time.sleep(0.05) or step()  # an accepted request takes at least 0.5 s
    try:
        expected = offline.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)[0]
        replies: list[tuple[float, httpx.Response]] = []

        def send():
            reply = post(server, "/v1/completions", dict(prompt=PROMPTS[0], max_tokens=10, temperature=0))
            replies.append((time.perf_counter(), reply))
        threads = [threading.Thread(target=send) for _ in range(20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        accepted = [(t, r) for t, r in replies if r.status_code == 200]
        refused = [(t, r) for t, r in replies if r.status_code == 429]
        assert (len(accepted), len(refused)) == (2, 18)
        assert max(t for t, _ in refused) < min(t for t, _ in accepted)  # refused before any accepted one finished
        assert all(r.json()["choices"][0]["text"] == expected.text for _, r in accepted)
        assert refused[0][1].json()["error"]["type"] == "rate_limit_error"
        assert metrics(server)["nanoserve:requests_rejected_total"] == 18
        assert post(server, "/v1/completions", dict(prompt=PROMPTS[:3], max_tokens=1)).status_code == 400  # never fits
    finally:
        server.stop()


# Catches: no header-read timeout: a connection that never finishes its request head is held for good.
def test_a_connection_that_never_sends_its_head_is_closed(model_path):
    server = start_server(model_path, header_timeout=0.5)
    try:
        host, port = server.server.servers[0].sockets[0].getsockname()[:2]
        with socket.create_connection((host, port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and nothing more
            assert sock.recv(1024) == b""  # closed by the server (a timeout here raises instead)
        assert httpx.get(server.url + "/health").status_code == 200
    finally:
        server.stop()


# Catches: a model without a tokenizer (token ids in, token ids out) streaming no chunk per token
# (every delta's text is None) and answering "text": null.
def test_a_model_without_tokenizer_streams_token_ids(tiny_models):
    engine = LLMEngine(Config.from_kwargs(tiny_models["gqa"], block_size=4))
    server = ServerThread(build_app(engine, NAME)).start()
    try:
        [expected] = LLM(tiny_models["gqa"], block_size=4).generate([[5, 6, 7, 8]], GREEDY, use_tqdm=False)
        body = dict(model=NAME, prompt=[5, 6, 7, 8], max_tokens=12, temperature=0)
        whole = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
        assert (whole["text"], whole["token_ids"]) == ("", expected.token_ids)
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == expected.token_ids
        assert len(chunks) == len(expected.token_ids) and chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert httpx.post(server.url + "/v1/completions", json={**body, "prompt": "text"}).status_code == 400
    finally:
        server.stop()


# --- The command line ----------------------------------------------------------------------------

@pytest.mark.parametrize("argv, words", [
    (["--block-size", "0"], "block_size"),
    (["--max-num-queued-requests", "0"], "max-num-queued-requests"),
    (["--port", "x"], "--port"),
    (["--dtype", "int3"], "dtype"),
    (["--bogus"], "--bogus"),
])
def test_bad_options_fail_at_once_in_one_line(argv, words, monkeypatch, capsys):
    # Catches: a mistake in the options found only after the model loaded (7-15 s), or told in a
    # traceback or the whole usage text instead of one line.
    monkeypatch.setattr(api_server, "LLMEngine", lambda config: pytest.fail("the model was loaded"))
    with pytest.raises(SystemExit) as exit_:
        api_server.main([nanoserve.DEFAULT_MODEL, *argv])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "error:" in err and words in err, err


def test_a_port_in_use_fails_before_the_model_loads(monkeypatch, capsys):
    # Catches: a port in use found only after loading the model (uvicorn exits after it).
    monkeypatch.setattr(api_server, "LLMEngine", lambda config: pytest.fail("the model was loaded"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(SystemExit):
            api_server.main([nanoserve.DEFAULT_MODEL, "--port", str(taken.getsockname()[1])])
    assert capsys.readouterr().err.count("\n") == 1


def test_prompt_tokens_count_when_scheduled():
    # Catches: vllm:prompt_tokens_total counting a prompt when add_request took it, so that a request
    # aborted before it was ever scheduled counted tokens the engine never served.
    from nanoserve.entrypoints.openai.metrics import Metrics
    from nanoserve.outputs import CompletionOutput, RequestOutput, StepResult
    stats = Metrics(NAME, num_usable_blocks=24)
    stats.record_added("never-scheduled", num_prompt_tokens=7, arrival_time=time.perf_counter())
    stats.record_added("scheduled", num_prompt_tokens=5, arrival_time=time.perf_counter())
    aborted = RequestOutput("never-scheduled", None, [1] * 7, [CompletionOutput(0, "", [], "abort")], 0, None, 0.0)
    stats.record_finished(aborted)
    assert stats.prompt_tokens._value.get() == 0
    stats.record_step(StepResult(None, scheduled=[("scheduled", 5)], decode_ids=[], outputs=[], deltas=[]), 0.0, 0.0)
    assert stats.prompt_tokens._value.get() == 5
