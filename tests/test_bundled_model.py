"""The tiny Llama that ships with nanoserve (nanoserve.DEFAULT_MODEL): it loads in transformers and
in nanoserve, nanoserve's greedy output equals transformers' token for token, and example.py runs."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer, LlamaConfig

from conftest import hf_greedy
from nanoserve import DEFAULT_MODEL, LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
PROMPTS = ["It is a truth universally acknowledged, that", "My dear Jane,", "She was",
           "\"I cannot think what you mean,\" said Emma.", "Hello, my name is"]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(DEFAULT_MODEL)


def test_files_are_small_and_complete() -> None:
    names = set(os.listdir(DEFAULT_MODEL))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    size = sum(os.path.getsize(os.path.join(DEFAULT_MODEL, n)) for n in names)
    assert size < 40 * 2**20


def test_tokenizer_matches_config(tokenizer) -> None:
    config = LlamaConfig.from_pretrained(DEFAULT_MODEL)
    assert config.num_key_value_heads < config.num_attention_heads  # GQA, as real Llamas
    assert tokenizer.encode("hello")[0] == tokenizer.bos_token_id == config.bos_token_id
    assert tokenizer.eos_token_id == config.eos_token_id
    assert len(tokenizer) <= config.vocab_size
    assert tokenizer.decode(tokenizer.encode("Mr. Darcy"), skip_special_tokens=True) == "Mr. Darcy"


def test_greedy_matches_transformers(tokenizer) -> None:
    max_tokens = 48
    llm = LLM(DEFAULT_MODEL, block_size=16)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]
    assert [o.prompt_token_ids for o in outputs] == prompt_ids
    expected = hf_greedy(DEFAULT_MODEL, prompt_ids, [max_tokens] * len(PROMPTS))  # ends with EOS if it stopped
    assert [o.token_ids for o in outputs] == expected
    assert {o.finish_reason for o in outputs} == {"stop", "length"}  # both ways of ending are compared
    for out in outputs:
        assert out.finish_reason == ("stop" if out.token_ids[-1] == tokenizer.eos_token_id else "length")
        assert re.search(r"[a-z]+ [a-z]+", out.text)  # words, not byte soup


def test_example_runs() -> None:
    result = subprocess.run([sys.executable, "example.py", "--trace", "2"], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "Summary: 8 requests" in result.stdout
    assert re.search(r"prefix cache hits: [1-9]\d* prompt tokens", result.stdout)
    # --trace 2: the first two steps as the walkthrough's arrays (docs/walkthrough.md), no more
    assert result.stdout.count("slot_mapping    = ") == 2 and "\nstep 2: " in result.stdout
