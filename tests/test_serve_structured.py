"""Structured outputs and the penalties through the OpenAI-compatible server: the `openai` client's
chat.completions.parse() with a pydantic model, response_format, vLLM's structured_outputs extra."""
import pytest

# Test extras (pyproject.toml's [test]) this module needs: without one it is skipped, not an error
pytest.importorskip("jsonschema")
pytest.importorskip("pydantic")
import json
from typing import Literal

import jsonschema
from pydantic import BaseModel, Field
from test_serve import ENGINE, NAME, model_path, post  # noqa: F401 (a fixture)
from test_serve_logprobs import client, server  # noqa: F401 (fixtures: a server with an API key, its openai client)

from nanoserve import LLM, SamplingParams
from nanoserve.entrypoints.openai.protocol import APIError, CompletionBody, parse


class Visit(BaseModel):
    guest: str = Field(max_length=10)
    rooms: int = Field(ge=1, le=9)
    mood: Literal["glad", "cross"]
    dishes: list[Literal["soup", "fish", "pie"]] = Field(max_length=3)


def test_chat_completions_parse_with_a_pydantic_model(client):  # noqa: F811
    # Catches: response_format ignored (Austen's prose is no JSON), the schema lost on its way to the engine.
    reply = client.chat.completions.parse(model=NAME, messages=[{"role": "user", "content": "Who came?"}],
                                          response_format=Visit, max_tokens=100, temperature=0.8, seed=1)
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Visit)


def test_json_object_and_structured_outputs_on_completions(server):  # noqa: F811
    body = dict(model=NAME, prompt="Emma", max_tokens=60, temperature=0,
                structured_outputs={"json": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3}})
    reply = post(server, "/v1/completions", body).json()
    jsonschema.validate(json.loads(reply["choices"][0]["text"]), body["structured_outputs"]["json"])
    body = dict(model=NAME, prompt="Emma", max_tokens=20, temperature=0, structured_outputs={"choice": ["yes", "no"]})
    assert post(server, "/v1/completions", body).json()["choices"][0]["text"] in ("yes", "no")
    body = dict(model=NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=20, temperature=0,
                structured_outputs={"regex": "[a-c]{3}"})
    text = post(server, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    assert len(text) == 3 and set(text) <= set("abc")
    body = dict(model=NAME, prompt="Emma", max_tokens=60, temperature=0, response_format={"type": "json_object"})
    reply = post(server, "/v1/completions", body).json()["choices"][0]
    assert reply["text"].startswith("{")  # an object, never Austen's prose
    assert reply["finish_reason"] == "length" or isinstance(json.loads(reply["text"]), dict)


def test_sampling_fields_reach_the_engine(server, model_path):  # noqa: F811
    # Catches: a field accepted but dropped on the way to SamplingParams (the server's text differs from offline's).
    fields = dict(frequency_penalty=0.7, presence_penalty=0.3, repetition_penalty=1.2, min_p=0.1, min_tokens=5,
                  include_stop_str_in_output=True, stop=["a"])
    expected = LLM(model_path, **ENGINE).generate(["Emma"], SamplingParams(temperature=0, max_tokens=16,
                                                  logit_bias={100: 5.0}, **fields))[0].outputs[0].text
    body = dict(model=NAME, prompt="Emma", max_tokens=16, temperature=0, logit_bias={"100": 5}, **fields)
    assert post(server, "/v1/completions", body).json()["choices"][0]["text"] == expected


def test_an_invalid_spec_names_its_field_as_sent():
    """pydantic reports a field by its alias ("json", not our json_): the 400 must still name it. Catches the
    alias dropped from the path (it read "structured_outputs: Input should be a valid dictionary")."""
    with pytest.raises(APIError, match=r"^structured_outputs\.json: Input should be a valid dictionary"):
        parse(CompletionBody, {"prompt": "a", "structured_outputs": {"json": 3}})
