"""The OpenAI-compatible server (nanoserve/serve.py), started on 127.0.0.1 and a free port, against
the bundled model with a chat template added; replies must equal LLM.generate / LLM.chat offline."""
import json
import shutil
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import nanoserve
from nanoserve import LLM, LLMEngine, SamplingParams
from nanoserve.config import Config
from nanoserve.serve import ServerThread, build_app

TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
# 24 usable blocks of 8 slots: 32 concurrent requests cannot all fit, so some wait or are preempted.
ENGINE = dict(device="cpu", block_size=8, num_kvcache_blocks=25, max_model_len=128)
NAME, KEY = "tiny-austen", "sk-test"
PROMPTS = ["It is a truth universally acknowledged", "Mr. Darcy looked at her, and", "Elizabeth", "She was"]
GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    path = shutil.copytree(nanoserve.DEFAULT_MODEL, tmp_path_factory.mktemp("serve") / "chat-model")
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return str(path)


@pytest.fixture(scope="module")
def offline(model_path):
    return LLM(model_path, **ENGINE)


@pytest.fixture(scope="module")
def server(model_path):
    engine = LLMEngine(Config.from_kwargs(model_path, **ENGINE))
    server = ServerThread(build_app(engine, NAME, api_key=KEY)).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def post(server, path, body, key=KEY):
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    return httpx.post(server.url + path, content=body if isinstance(body, str) else json.dumps(body),
                      headers=headers, timeout=60)


def metrics(server) -> dict[str, float]:
    text = httpx.get(server.url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def wait_for_free_blocks(server, seconds=10.0) -> dict[str, float]:
    deadline = time.time() + seconds
    while (m := metrics(server))["vllm:gpu_cache_usage_perc"] > 0 and time.time() < deadline:
        time.sleep(0.05)
    return m


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
        chunks = list(client.chat.completions.create(model=NAME, messages=messages, temperature=0, stream=True, **extra))
        assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
        assert chunks[-1].choices[0].finish_reason == expected.finish_reason


# Catches: requests crossed between streams, lost or repeated deltas under load, an engine touched from
# two threads (32 streaming clients at once on a KV cache too small for all of them).
def test_concurrent_streams_match_generate(server, offline):
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(32)]
    params = [SamplingParams(temperature=0, max_tokens=8 + i % 9) for i in range(32)]
    expected = [o.text for o in offline.generate(prompts, params, use_tqdm=False)]
    texts: list[str | None] = [None] * 32
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)

    def run(i):
        stream = client.completions.create(model=NAME, prompt=prompts[i], temperature=0,
                                           max_tokens=params[i].max_tokens, stream=True)
        texts[i] = "".join(c.choices[0].text for c in stream)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert texts == expected
    assert wait_for_free_blocks(server)["nanoserve:num_free_blocks"] == 24


# Catches: a client that leaves mid-stream keeping its request running and its KV blocks held.
def test_disconnect_mid_stream_frees_blocks(server, monkeypatch):
    engine = server.server.config.app.state.engine_loop.engine
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: time.sleep(0.02) or step())  # 100 tokens take 2 s
    before = metrics(server)["vllm:generation_tokens_total"]
    body = dict(model=NAME, prompt=PROMPTS[1], max_tokens=100, temperature=0, stream=True, ignore_eos=True)
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                assert metrics(server)["vllm:gpu_cache_usage_perc"] > 0  # held while we listen
                break  # leave (httpx closes the connection here)
    m = wait_for_free_blocks(server)
    assert m["vllm:gpu_cache_usage_perc"] == 0 and m["vllm:num_requests_running"] == 0
    assert m["vllm:generation_tokens_total"] - before < 50  # aborted, not run to the end


BAD = [  # (path, body, status, words the message must name)
    ("/v1/completions", "{not json", 400, "JSON"),
    ("/v1/completions", dict(model=NAME), 400, "prompt"),
    ("/v1/completions", dict(model=NAME, prompt=5), 400, "prompt"),
    ("/v1/completions", dict(model=NAME, prompt="Hi", max_tokens="5"), 400, "max_tokens"),
    ("/v1/completions", dict(model="gpt-4", prompt="Hi"), 404, "gpt-4"),
    ("/v1/completions", dict(model=NAME, prompt="Hi " * 200), 400, "max_model_len"),
    ("/v1/completions", dict(model=NAME, prompt=[99999]), 400, "vocab_size"),
    ("/v1/completions", dict(model=NAME, prompt="Hi", max_tokens=0), 400, "max_tokens"),
    ("/v1/completions", dict(model=NAME, prompt="Hi", temperature=-1), 400, "temperature"),
    ("/v1/completions", dict(model=NAME, prompt="Hi", top_p=0), 400, "top_p"),
    ("/v1/completions", dict(model=NAME, prompt=["a", "b"]), 400, "one prompt"),
    ("/v1/completions", dict(model=NAME, prompt="Hi", stream=True, max_tokens=-3), 400, "max_tokens"),
    ("/v1/chat/completions", dict(model=NAME, messages=[{"role": "user"}]), 400, "content"),
    ("/v1/chat/completions", dict(model=NAME, messages="hi"), 400, "messages"),
    ("/v1/chat/completions", dict(model=NAME, messages=[{"role": "user", "content": "x"}], max_completion_tokens=0),
     400, "max_tokens"),
]


# Catches: bad input answered with a 500, a FastAPI 422, an error body that does not say what is
# wrong, or a bad request that disturbs the engine for everyone else.
@pytest.mark.parametrize("path, body, status, words", BAD)
def test_bad_input_is_an_openai_error(server, path, body, status, words):
    reply = post(server, path, body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert words in error["message"] and error["type"] == "invalid_request_error"
    assert post(server, "/v1/completions", dict(model=NAME, prompt="Hi", max_tokens=2)).status_code == 200


# Catches: an API key that is not checked (or /health behind it), and /v1/models not naming the served model.
def test_api_key_models_and_health(server):
    assert post(server, "/v1/completions", dict(model=NAME, prompt="Hi"), key=None).status_code == 401
    assert post(server, "/v1/completions", dict(model=NAME, prompt="Hi"), key="wrong").status_code == 401
    assert httpx.get(server.url + "/metrics").status_code == 401
    assert httpx.get(server.url + "/health").status_code == 200
    assert [m.id for m in openai.OpenAI(base_url=server.url + "/v1", api_key=KEY).models.list()] == [NAME]


# Catches: /metrics that does not parse, or token counters that do not count.
def test_metrics_count_tokens(server, client):
    before = metrics(server)
    reply = client.completions.create(model=NAME, prompt=PROMPTS[2], temperature=0, max_tokens=5)
    after = wait_for_free_blocks(server)
    assert after["vllm:prompt_tokens_total"] - before["vllm:prompt_tokens_total"] == reply.usage.prompt_tokens
    assert after["vllm:generation_tokens_total"] - before["vllm:generation_tokens_total"] == 5
    assert after["vllm:time_to_first_token_seconds_count"] > before["vllm:time_to_first_token_seconds_count"]
    assert after["vllm:time_per_output_token_seconds_count"] - before["vllm:time_per_output_token_seconds_count"] == 4
    assert {"vllm:num_requests_waiting", "vllm:num_preemptions_total"} <= set(after)


# Catches: an error inside step() killing the engine loop, so that every later request hangs.
def test_engine_error_is_a_500_then_serving_goes_on(server, monkeypatch):
    engine = server.server.config.app.state.engine_loop.engine
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: monkeypatch.setattr(engine, "step", step) or 1 / 0)  # fails once
    reply = post(server, "/v1/completions", dict(model=NAME, prompt="Hi", max_tokens=2))
    assert reply.status_code == 500 and "ZeroDivisionError" in reply.json()["error"]["message"]
    assert post(server, "/v1/completions", dict(model=NAME, prompt="Hi", max_tokens=2)).status_code == 200
    assert wait_for_free_blocks(server)["nanoserve:num_free_blocks"] == 24


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
    finally:
        server.stop()
