"""EleutherAI's lm-evaluation-harness against the server: its `local-completions` backend, pointed at
`python -m nanoserve.serve` (a subprocess on 127.0.0.1), runs a small local task in both modes
(loglikelihood and generate_until) and gets what lm-eval's own `hf` backend gets on the same weights
in float32: every loglikelihood within 1e-4, the same is_greedy, the same generations.

What the server must get right for that (each one planted and seen to fail this test): prompt
logprobs at the right positions (the first prompt token's null), echo with max_tokens=1 keeping the
generated token (lm-eval reads token_logprobs[ctxlen:-1]), no second BOS on token-id prompts,
top_logprobs of each token's own position (only is_greedy sees that one: the task has an item whose
answer is the model's greedy continuation), and prompt logprobs of prompts the prefix cache has seen
(block_size 4, shared contexts, a repeated item). lm-eval sorts a batch's choices by index, so their
order is tested in test_serve_logprobs.py."""
import pytest

# Test extras (pyproject.toml's [test]) this module needs: without one it is skipped, not an error
pytest.importorskip("httpx")
pytest.importorskip("fastapi")
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import httpx
from transformers import AutoTokenizer

import nanoserve
from conftest import build_tiny_llama, hf_greedy

pytest.importorskip("lm_eval", reason="lm-eval is in the [test] extra: pip install -e '.[test]'")

MC = [  # multiple choice: one loglikelihood request per (question, choice), scored " " + choice
    {"question": "The capital of France is", "choices": ["Paris.", "Rome.", "a city in Spain."], "answer": 0},
    {"question": "Two plus two is", "choices": ["four.", "five.", "six."], "answer": 0},
    # a context ending in a space: lm-eval moves the space into the continuation
    {"question": "Question: what colour is the grass? Answer: ", "choices": ["green", "blue"], "answer": 0},
    {"question": "Café au lait is", "choices": ["très bon", "ça va"], "answer": 0},  # bytes of one character
    # a long shared context, choices sharing a prefix: the prefix cache would hit (block_size 4)
    {"question": "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
                 "must be in want of", "choices": ["a wife.", "a wife and a house.", "a house."], "answer": 0},
    {"question": "", "choices": ["Paris.", "Rome."], "answer": 0},  # an empty context: the BOS alone
    {"question": "The capital of France is", "choices": ["Paris.", "Rome.", "a city in Spain."], "answer": 0},
]
GEN = [  # generate_until: greedy, up to "\n" or 8 tokens
    {"prompt": "The capital of France is", "target": " Paris."},
    {"prompt": "It is a truth universally", "target": " acknowledged."},
    {"prompt": "Question: what colour is the sky? Answer:", "target": " blue"},
]
ENGINE_OPTIONS = ["--device", "cpu", "--dtype", "float32", "--block-size", "4", "--num-kvcache-blocks", "256",
                  "--enforce-eager"]  # eager, as in-process tests are (conftest): compiling is tested elsewhere


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A tiny random Llama with the bundled model's tokenizer (BPE, 4096 tokens, <s> prepended)."""
    path = tmp_path_factory.mktemp("lmeval") / "model"
    build_tiny_llama(str(path), vocab_size=4096)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(nanoserve.DEFAULT_MODEL, name), path)
    return str(path)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """`python -m nanoserve.serve` on a free port; started first, so that it loads while hf scores."""
    log = tmp_path_factory.mktemp("server") / "stderr.txt"
    with open(log, "w") as stderr:
        process = subprocess.Popen([sys.executable, "-m", "nanoserve.serve", model_dir, "--port", "0",
                                    "--served-model-name", "tiny", *ENGINE_OPTIONS], stderr=stderr)

    def url() -> str:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None:
            if found := re.search(r"serving 'tiny' at (http://\S+)", log.read_text()):
                try:
                    if httpx.get(found[1] + "/health", timeout=5).status_code == 200:
                        return found[1]
                except httpx.TransportError:
                    pass
            time.sleep(0.2)
        pytest.fail(f"the server did not start:\n{log.read_text()}")
    yield url
    process.send_signal(signal.SIGINT)
    try:
        assert process.wait(timeout=30) == 0, log.read_text()
    finally:
        process.kill()


def task(name: str, rows: list[dict], folder, **config) -> dict:
    """An lm-eval task as a dict: its rows in a local JSON-lines file, read by datasets' json loader."""
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return dict(task=name, dataset_path="json", test_split="test", **config,
                dataset_kwargs={"data_files": {"test": str(data)}, "cache_dir": str(folder / "datasets")})


@pytest.fixture(scope="module")
def tasks(model_dir, tmp_path_factory) -> list[dict]:
    # An item whose answer is the model's greedy continuation, so that is_greedy is True there (it reads
    # top_logprobs). lm-eval scores " " + choice and tokenizes context + continuation together: the
    # continuation must start with a space and come back as the same tokens.
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    greedy = []
    for context in ["The capital of France is", "The sky is", "Two plus two is"]:
        ids = tokenizer(context).input_ids
        out = hf_greedy(model_dir, [ids], [3])[0]
        text = tokenizer.decode(out)
        if text.startswith(" ") and tokenizer(context + text).input_ids == ids + out:
            greedy = [{"question": context, "choices": [text[1:], "nonsense"], "answer": 0}]
            break
    assert greedy, "no greedy continuation comes back as its tokens: pick other contexts"
    folder = tmp_path_factory.mktemp("tasks")
    return [task("nano_mc", MC + greedy, folder, output_type="multiple_choice", doc_to_text="{{question}}",
                 doc_to_choice="{{choices}}", doc_to_target="answer", metric_list=[{"metric": "acc"}]),
            task("nano_gen", GEN, folder, output_type="generate_until", doc_to_text="{{prompt}}",
                 doc_to_target="{{target}}", metric_list=[{"metric": "exact_match"}],
                 generation_kwargs={"until": ["\n"], "max_gen_toks": 8, "do_sample": False})]


def evaluate(model: str, model_args: dict, tasks: list[dict], **kwargs) -> dict:
    """lm-eval's Python API; TaskManager(include_defaults=False) skips indexing its ~14,700 built-in tasks."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    return simple_evaluate(model=model, model_args=model_args, tasks=tasks, log_samples=True, bootstrap_iters=0,
                           task_manager=TaskManager(include_defaults=False), **kwargs)["samples"]


def test_lm_eval_local_completions_equals_hf(model_dir, tasks, server):
    hf = evaluate("hf", {"pretrained": model_dir, "dtype": "float32"}, tasks, device="cpu", batch_size=1)
    url = server()
    for batch_size in (1, 4):  # 4: several prompts of different lengths in one request
        served = evaluate("local-completions", {
            "model": "tiny", "base_url": url + "/v1/completions", "max_length": 256,
            "tokenizer": model_dir, "tokenizer_backend": "huggingface",  # the same tokens as hf's
            "add_bos_token": True,  # hf's tokenizer prepends <s>
            "max_retries": 1, "timeout": 60}, tasks, batch_size=batch_size)
        pairs = [(h, s) for h_doc, s_doc in zip(hf["nano_mc"], served["nano_mc"], strict=True)
                 for (h,), (s,) in zip(h_doc["resps"], s_doc["resps"], strict=True)]
        assert len(pairs) == sum(len(row["choices"]) for row in MC) + 2
        for (h_loglikelihood, h_greedy), (s_loglikelihood, s_greedy) in pairs:
            assert float(s_loglikelihood) == pytest.approx(float(h_loglikelihood), abs=1e-4)
            assert s_greedy == h_greedy
        assert any(is_greedy for (_, is_greedy), _ in pairs), "the greedy item must come back greedy"
        assert [d["filtered_resps"] for d in served["nano_gen"]] == [d["filtered_resps"] for d in hf["nano_gen"]]
