"""Echo with n > 1 and several prompts, over HTTP only: each choice shows its own prompt.

The completions API numbers the choices prompt by prompt, n per prompt (choice i is completion i % n
of prompt i // n, as in vLLM and OpenAI), so the prompt a choice echoes is found by the same rule."""
import pytest

# Test extras (pyproject.toml's [test]) this module needs: without one it is skipped, not an error
pytest.importorskip("httpx")
pytest.importorskip("fastapi")
import json

import httpx

import nanoserve
from nanoserve import LLMEngine
from nanoserve.config import Config
from nanoserve.entrypoints.openai.api_server import ServerThread, build_app

PROMPTS = ["It is a truth universally acknowledged", "Mr. Darcy looked at her, and", "Elizabeth"]
ENGINE = dict(device="cpu", block_size=8, num_kvcache_blocks=25, max_model_len=128)


@pytest.fixture(scope="module")
def server():
    engine = LLMEngine(Config.from_kwargs(nanoserve.DEFAULT_MODEL, **ENGINE))
    server = ServerThread(build_app(engine, "tiny")).start()
    yield server
    server.stop()


@pytest.mark.parametrize("stream", [False, True])
def test_each_choice_echoes_its_own_prompt(server, stream):
    """3 prompts, n=2: choices 0, 1 echo prompt 0, choices 2, 3 prompt 1, 4, 5 prompt 2. Catches the
    prompt of choice i taken as prompts[i % num_prompts] instead of prompts[i // n] (choice 1 would
    echo prompt 1), and a streamed choice echoing its prompt in no chunk or in more than one."""
    body = dict(model="tiny", prompt=PROMPTS, n=2, echo=True, max_tokens=3, temperature=0, stream=stream)
    texts = ["" for _ in range(len(PROMPTS) * 2)]
    if stream:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as reply:
            assert reply.status_code == 200, reply.read()
            for line in reply.iter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        texts[choice["index"]] += choice["text"]
    else:
        reply = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        for choice in reply.json()["choices"]:
            texts[choice["index"]] = choice["text"]
    for i, text in enumerate(texts):
        prompt = PROMPTS[i // 2]
        assert text.startswith(prompt), (i, text)
        assert len(text) > len(prompt) and text.count(prompt) == 1
