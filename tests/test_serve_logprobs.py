"""The server's logprobs, echo and n (nanoserve/entrypoints/openai/) over HTTP on 127.0.0.1, read by the openai
client or as JSON: logprob values against transformers' log_softmax on the same weights (float32),
token strings against the tokenizer's decode of each token alone (as vLLM writes them), choices
against LLM.generate / LLM.chat offline, completion i of a prompt seeded seed + i."""
import pytest

# Test extras (pyproject.toml's [test]) this module needs: without one it is skipped, not an error
pytest.importorskip("httpx")
pytest.importorskip("openai")
pytest.importorskip("fastapi")
import itertools

import httpx
import openai
import torch
from test_serve import KEY, NAME, PROMPTS, events, model_path, offline, post, start_server  # noqa: F401 (fixtures)
from transformers import AutoModelForCausalLM

from nanoserve import LLMEngine, SamplingParams
from nanoserve.config import Config
from nanoserve.entrypoints.openai.api_server import ServerThread, build_app
from nanoserve.entrypoints.openai.protocol import Limits


@pytest.fixture(scope="module")
def server(model_path):  # noqa: F811
    server = start_server(model_path, api_key=KEY)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(offline):  # noqa: F811
    return offline.engine.tokenizer


@pytest.fixture(scope="module")
def hf(model_path):  # noqa: F811
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def hf_rows(hf, token_ids: list[int]) -> torch.Tensor:
    """[len - 1, vocab]: row p is transformers' log-distribution of token p + 1."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([token_ids])).logits[0, :-1].float(), dim=-1)


def strings(tokenizer, token_ids: list[int]) -> list[str]:
    return [tokenizer.decode([t]) for t in token_ids]


# Catches: logprobs of the wrong position (a token scored by the row that predicts the next one), taken
# after temperature, top_logprobs without the token's own entry or with the wrong count, token strings
# written as the tokenizer's pieces ("Ġsky") instead of each token decoded alone, a text_offset that is
# not the running length of the token strings.
def test_completion_logprobs_equal_transformers(client, offline, hf, tokenizer):  # noqa: F811
    params = SamplingParams(temperature=1.5, seed=11, max_tokens=8)
    expected = offline.generate(PROMPTS[0], params, use_tqdm=False)[0]
    reply = client.completions.create(model=NAME, prompt=PROMPTS[0], temperature=1.5, seed=11, max_tokens=8,
                                      logprobs=3)
    [choice] = reply.choices
    assert choice.text == expected.text
    ids, num_prompt = expected.token_ids, len(expected.prompt_token_ids)
    rows = hf_rows(hf, expected.prompt_token_ids + ids)[num_prompt - 1:]  # row i scores ids[i]
    assert choice.logprobs.tokens == strings(tokenizer, ids)
    assert choice.logprobs.token_logprobs == pytest.approx([rows[i, t].item() for i, t in enumerate(ids)], abs=1e-4)
    for i, (t, top) in enumerate(zip(ids, choice.logprobs.top_logprobs)):
        best = rows[i].topk(3)
        want = {tokenizer.decode([t]): rows[i, t].item()}  # the token's own, then the 3 most likely
        want |= {tokenizer.decode([u]): v for u, v in zip(best.indices.tolist(), best.values.tolist())}
        assert top == pytest.approx(want, abs=1e-4)
    assert any(len(top) == 4 for top in choice.logprobs.top_logprobs), "no sampled token outside the top 3"
    assert choice.logprobs.text_offset == list(itertools.accumulate(map(len, choice.logprobs.tokens), initial=0))[:-1]


# Catches what lm-eval's loglikelihood requests (token-id prompts, echo, max_tokens=1, logprobs=1) trip on:
# the generated token dropped from the echo (lm-eval's [ctxlen:-1] then eats a continuation token), the
# first prompt token's null missing (every logprob one position off), a second BOS on token-id prompts,
# a batch's choices out of order; and max_tokens=0 with echo refused or showing a generated token, echo
# without logprobs losing the prompt or the completion.
def test_echo_with_max_tokens_1_and_0(server, offline, hf, tokenizer):  # noqa: F811
    prompts = [tokenizer.encode(p) for p in PROMPTS[:3]]  # with the <s> a string prompt gets
    expected = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    body = dict(model=NAME, prompt=prompts, echo=True, max_tokens=1, logprobs=1, temperature=0, seed=1234)
    reply = post(server, "/v1/completions", body).json()
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2]
    for prompt, output, choice in zip(prompts, expected, reply["choices"], strict=True):
        full = prompt + output.token_ids
        rows = hf_rows(hf, full)
        assert choice["text"] == tokenizer.decode(prompt) + output.text and choice["finish_reason"] == "length"
        assert choice["logprobs"]["tokens"] == strings(tokenizer, full)
        assert choice["logprobs"]["token_logprobs"][0] is None and choice["logprobs"]["top_logprobs"][0] is None
        assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(
            [rows[p, t].item() for p, t in enumerate(full[1:])], abs=1e-4)
        top = choice["logprobs"]["top_logprobs"][-1]  # the generated (greedy) token: its own entry is the top one
        assert top == {tokenizer.decode(output.token_ids): choice["logprobs"]["token_logprobs"][-1]}
    assert reply["usage"] == dict(prompt_tokens=sum(map(len, prompts)), completion_tokens=3,
                                  total_tokens=sum(map(len, prompts)) + 3)

    body = dict(model=NAME, prompt=PROMPTS[0], echo=True, max_tokens=0, logprobs=2)  # the prompt alone
    reply = post(server, "/v1/completions", body).json()
    [choice] = reply["choices"]
    assert choice["text"] == PROMPTS[0] and choice["finish_reason"] == "length"  # a string echoes as given
    assert choice["logprobs"]["tokens"] == strings(tokenizer, prompts[0])
    rows = hf_rows(hf, prompts[0])
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(
        [rows[p, t].item() for p, t in enumerate(prompts[0][1:])], abs=1e-4)
    assert reply["usage"]["completion_tokens"] == 0

    output = offline.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0]
    reply = post(server, "/v1/completions", dict(prompt=PROMPTS[1], echo=True, max_tokens=5, temperature=0)).json()
    assert reply["choices"][0]["text"] == PROMPTS[1] + output.text and reply["choices"][0]["logprobs"] is None


# Catches: vLLM's prompt_logprobs field missing, one position off, or without each token's rank.
def test_prompt_logprobs_field(server, hf, tokenizer):
    prompt = tokenizer.encode(PROMPTS[3])
    reply = post(server, "/v1/completions", dict(prompt=prompt, max_tokens=2, prompt_logprobs=1)).json()
    [choice] = reply["choices"]
    assert choice["logprobs"] is None and choice["prompt_logprobs"][0] is None
    rows = hf_rows(hf, prompt)
    for p, (t, found) in enumerate(zip(prompt[1:], choice["prompt_logprobs"][1:], strict=True)):
        entry = found[str(t)]
        assert entry["logprob"] == pytest.approx(rows[p, t].item(), abs=1e-4)
        assert entry["rank"] == 1 + (rows[p] > rows[p, t]).sum().item()
        assert entry["decoded_token"] == tokenizer.decode([t])
        assert str(rows[p].argmax().item()) in found


# Catches: n ignored (one choice), choices numbered i * num_prompts + p instead of p * n + i (vLLM's
# order), completions sharing one seed (identical) or seeded otherwise than seed + i, a prompt's tokens
# counted n times in usage; the same when streamed.
def test_n_completions_are_seed_plus_index_in_prompt_order(client, server, offline):  # noqa: F811
    prompts = PROMPTS[:2]
    expected = [offline.generate(p, SamplingParams(temperature=1.0, seed=5 + i, max_tokens=8), use_tqdm=False)[0]
                for p in prompts for i in range(3)]
    assert len({e.text for e in expected[:3]}) == 3, "the seeds should give different completions"
    reply = client.completions.create(model=NAME, prompt=prompts, n=3, seed=5, temperature=1.0, max_tokens=8)
    assert [c.index for c in reply.choices] == list(range(6))
    assert [c.text for c in reply.choices] == [e.text for e in expected]
    assert reply.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected[::3])
    assert reply.usage.completion_tokens == sum(len(e.token_ids) for e in expected)
    body = dict(model=NAME, prompt=prompts, n=3, seed=5, temperature=1.0, max_tokens=8, stream=True,
                stream_options={"include_usage": True})
    *chunks, usage, done = events(server, body)
    texts = ["".join(c["choices"][0]["text"] for c in chunks if c["choices"][0]["index"] == i) for i in range(6)]
    assert texts == [e.text for e in expected] and done == "[DONE]"
    assert usage["usage"] == reply.usage.model_dump(exclude_none=True)


# Catches: chat logprobs left null or in the completions' shape, top_logprobs other than the k most likely
# in rank order, bytes other than the token's UTF-8, logprobs=True without top_logprobs refused or
# with top entries, n ignored on chat, streamed chat chunks without their token's logprobs or without a
# role chunk for each choice.
def test_chat_logprobs_and_n(client, offline, hf, tokenizer):  # noqa: F811
    messages = [{"role": "user", "content": "Who is Mr. Darcy?"}]
    args = dict(model=NAME, messages=messages, logprobs=True, top_logprobs=2, n=2, seed=3, temperature=1.0,
                max_tokens=6)
    reply = client.chat.completions.create(**args)
    for i, choice in enumerate(reply.choices):
        expected = offline.chat(messages, SamplingParams(temperature=1.0, seed=3 + i, max_tokens=6), use_tqdm=False)[0]
        assert choice.index == i and choice.message.content == expected.text
        rows = hf_rows(hf, expected.prompt_token_ids + expected.token_ids)[len(expected.prompt_token_ids) - 1:]
        assert [e.token for e in choice.logprobs.content] == strings(tokenizer, expected.token_ids)
        for j, (t, entry) in enumerate(zip(expected.token_ids, choice.logprobs.content, strict=True)):
            assert entry.bytes == list(entry.token.encode())
            assert entry.logprob == pytest.approx(rows[j, t].item(), abs=1e-4)
            best = rows[j].topk(2)
            assert [e.token for e in entry.top_logprobs] == strings(tokenizer, best.indices.tolist())
            assert [e.logprob for e in entry.top_logprobs] == pytest.approx(best.values.tolist(), abs=1e-4)
    assert reply.choices[0].message.content != reply.choices[1].message.content

    chunks = list(client.chat.completions.create(**args, stream=True))
    assert [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"] == [0, 1]
    for i, choice in enumerate(reply.choices):
        streamed = [e for c in chunks if c.choices[0].index == i and c.choices[0].logprobs
                    for e in c.choices[0].logprobs.content]
        assert streamed == choice.logprobs.content

    bare = client.chat.completions.create(model=NAME, messages=messages, logprobs=True, max_tokens=3, temperature=0)
    assert len(bare.choices[0].logprobs.content) == 3
    assert all(e.top_logprobs == [] for e in bare.choices[0].logprobs.content)
    plain = client.chat.completions.create(model=NAME, messages=messages, max_tokens=3, temperature=0)
    assert plain.choices[0].logprobs is None


# Catches: a streamed delta whose text is held back (it may start a stop string) sent without its
# token's logprobs, or not at all; the prompt echoed in no chunk or in every chunk; text_offset
# restarting at 0 in each chunk, or in another frame than the whole response's; a streamed echo with
# max_tokens=0 showing a generated token.
def test_streamed_logprobs_equal_the_whole_response(server):
    body = dict(model=NAME, prompt=PROMPTS[2], echo=True, logprobs=2, max_tokens=12, temperature=0,
                stop=[" letter was, and was nothing"])  # held back from " letter" on, until " not"
    whole = post(server, "/v1/completions", body).json()["choices"][0]
    chunks = [event["choices"][0] for event in events(server, {**body, "stream": True})[:-1]]
    assert any(c["text"] == "" for c in chunks), "no delta was held back: the test tests nothing"
    assert "".join(c["text"] for c in chunks) == whole["text"]
    for field in ("tokens", "token_logprobs", "top_logprobs"):
        assert [x for c in chunks for x in c["logprobs"][field]] == whole["logprobs"][field]
    assert chunks[0]["text"].startswith(PROMPTS[2]) and not any(PROMPTS[2] in c["text"] for c in chunks[1:])
    assert [x for c in chunks for x in c["logprobs"]["text_offset"]] == whole["logprobs"]["text_offset"]

    *chunks, done = events(server, {**body, "max_tokens": 0, "stream": True})
    [[choice]] = [c["choices"] for c in chunks]
    assert choice["text"] == PROMPTS[2] and choice["finish_reason"] == "length" and done == "[DONE]"
    assert len(choice["logprobs"]["tokens"]) == len(whole["logprobs"]["tokens"]) - 12


# Catches: n not counted in --max-num-queued-requests (2 prompts with n=3 take 6 slots, not 2), or
# slots taken for prompts x n but given back for the prompts alone (the server fills up for good).
def test_max_num_queued_requests_counts_prompts_times_n(model_path):  # noqa: F811
    server = start_server(model_path, limits=Limits(max_num_queued_requests=4))
    try:
        reply = post(server, "/v1/completions", dict(prompt=PROMPTS[:2], n=3, max_tokens=1))
        assert reply.status_code == 400 and "6 completions" in reply.json()["error"]["message"]
        for _ in range(3):
            assert post(server, "/v1/completions", dict(prompt=PROMPTS[:2], n=2, max_tokens=1)).status_code == 200
    finally:
        server.stop()


# Catches: logprobs failing (a 500) for a model without a tokenizer, instead of naming tokens by id as
# vLLM's return_tokens_as_token_ids does.
def test_logprobs_without_a_tokenizer_name_tokens_by_id(tiny_models):
    server = ServerThread(build_app(LLMEngine(Config.from_kwargs(tiny_models["gqa"], block_size=4)), NAME)).start()
    try:
        body = dict(prompt=[5, 6, 7], echo=True, logprobs=1, max_tokens=2, temperature=0)
        [choice] = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"]
        assert choice["text"] == "" and choice["token_ids"][:3] == [5, 6, 7] and len(choice["token_ids"]) == 5
        assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
        assert choice["logprobs"]["token_logprobs"][0] is None and None not in choice["logprobs"]["token_logprobs"][1:]
    finally:
        server.stop()
