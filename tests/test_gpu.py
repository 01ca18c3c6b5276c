"""The default path on a GPU, against transformers on the same GPU (marked `gpu`: skipped without CUDA).

One workload reaches what a GPU serves: chunked prefill (32 tokens a step), preemption (a KV cache
too small for every request at once), more than 8 decode rows in a step (the torch backend's decode
groups), prefix hits (prompts sharing 32 tokens), and a seeded sampled request. LLM(path) is left to
choose: CUDA, and block_size 256 with flash-attn where flash-attn 2 can run, else 16 with torch.
scripts/gpu_check.py runs the same functions with sizes of its own, and on the CPU with --dry-run.
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from nanoserve import LLM, SamplingParams

ENGINE = dict(max_num_batched_tokens=32, num_kvcache_blocks=32, max_model_len=128)  # with block_size 16


def workload(seed: int = 0, num_prompts: int = 12, shared: int = 32) -> list[list[int]]:
    """Prompts of 5 to 40 tokens; every third starts with the same `shared` tokens (prefix hits)."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 256) for _ in range(shared)]
    prompts = [[rng.randrange(3, 256) for _ in range(rng.randrange(5, 41))] for _ in range(num_prompts)]
    return [prefix + p if i % 3 == 0 else p for i, p in enumerate(prompts)]


def hf_generate(path: str, prompts: list[list[int]], max_tokens: int, device: str,
                dtype: torch.dtype) -> list[list[int]]:
    """transformers' greedy generate on `device`, one prompt at a time (no padding)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    outputs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt], device=device)
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_tokens, pad_token_id=0)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


def run_engine(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], dict[str, int]]:
    """Greedy tokens for `prompts`, and what the run reached: preemptions, prefix-cached tokens and the
    most decode rows in one step."""
    engine, most_decodes = llm.engine, 0
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens))
    outputs = {}
    while engine.has_unfinished_requests():
        result = engine.step()
        most_decodes = max(most_decodes, result.num_decode_tokens)
        outputs |= {o.request_id: o for o in result.outputs}
    ordered = [outputs[str(i)] for i in range(len(prompts))]
    reached = dict(preemptions=engine.scheduler.num_preemptions, most_decodes=most_decodes,
                   cached_tokens=sum(o.num_cached_tokens for o in ordered))
    return [o.outputs[0].token_ids for o in ordered], reached


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> float:
    """The share of token positions where both generated the same token."""
    return sum(a == b for o, t in zip(ours, theirs) for a, b in zip(o, t)) / sum(len(t) for t in theirs)


@pytest.mark.gpu
def test_default_path_float32_is_token_exact_with_transformers_on_cuda(tiny_models):
    path, prompts = tiny_models["gqa"], workload()
    llm = LLM(path, dtype="float32", **ENGINE)  # float32: the torch backend, block_size 16
    assert llm.engine.device.type == "cuda" and llm.engine.block_size == 16
    ours, reached = run_engine(llm, prompts, 16)
    assert reached["preemptions"] > 0 and reached["cached_tokens"] > 0 and reached["most_decodes"] > 8, reached
    assert ours == hf_generate(path, prompts, 16, "cuda", torch.float32)


@pytest.mark.gpu
def test_default_path_bfloat16_is_close_to_transformers_on_cuda(tiny_models):
    """dtype "auto" on CUDA: bfloat16 (float16 below sm80), flash-attn where it runs. Kernels sum in
    other orders than transformers', so a near-tie may flip a late token: the first token of every
    request must agree, and nearly all tokens overall."""
    path, prompts = tiny_models["gqa"], workload(seed=1)
    llm = LLM(path, **{**ENGINE, "num_kvcache_blocks": None})  # sized from the GPU's memory
    ours, _ = run_engine(llm, prompts, 16)
    theirs = hf_generate(path, prompts, 16, "cuda", llm.engine.model_runner.dtype)
    assert [o[0] for o in ours] == [t[0] for t in theirs]
    assert agreement(ours, theirs) >= 0.8


@pytest.mark.gpu
def test_seeded_sampling_on_cuda_is_the_same_in_any_batch(tiny_models):
    llm = LLM(tiny_models["gqa"], dtype="float32", **ENGINE)
    seeded = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, seed=7, max_tokens=16)
    [alone] = llm.generate([workload()[0]], seeded, use_tqdm=False)
    batch = llm.generate(workload(), [seeded] + [SamplingParams(temperature=1.0, max_tokens=16)] * 11, use_tqdm=False)
    assert batch[0].outputs[0].token_ids == alone.outputs[0].token_ids
    assert len(set(map(tuple, (o.outputs[0].token_ids for o in batch)))) > 1  # the others did sample


def test_gpu_check_dry_run_runs_every_check_on_the_cpu():
    """scripts/gpu_check.py --dry-run: the GPU check's own code on the CPU with tiny sizes, so that the
    script a GPU owner runs is never broken. Every check must have produced its rows, none failed."""
    script = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"
    result = subprocess.run([sys.executable, str(script), "--dry-run"], capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    for row in ("| versions |", "| pytest -m gpu | PASS", "| engine vs transformers, torch.float32 | PASS",
                "| flash branch through the strict reference | PASS", "| per decode step, B=4 |",
                "| peak memory vs KV budget |", "| decode B=8,", "| graphs vs eager B=8 | PASS",
                "| launches per decode step, B=4 |", "| nano-vllm's shape, float32 |"):
        assert row in result.stdout, row
    assert "| FAIL |" not in result.stdout


def test_gpu_check_out_of_time_still_writes_every_row(tmp_path):
    """With its budget spent before the first check, the GPU check still writes its table to --out: a SKIP row
    naming each check. Catches a run that writes nothing until the end, or drops the checks it had no time for."""
    script = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.py"
    out = tmp_path / "table.md"
    result = subprocess.run([sys.executable, str(script), "--dry-run", "--budget", "0", "--out", str(out)],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in out.read_text().splitlines() if line.startswith("| ") and "| check |" not in line]
    assert [row.split(" | ")[0] for row in rows] == ["| environment", "| pytest -m gpu", "| engine vs transformers",
                                                    "| flash contract", "| decoding", "| nano-vllm's shape",
                                                    "| CUDA graphs"]
    assert all("| SKIP | out of time" in row for row in rows)


def test_tests_not_marked_gpu_run_on_the_cpu(tiny_models):
    """conftest hides CUDA from this test, so LLM() picks the CPU even on a GPU machine, and so do the
    subprocesses a test starts. The bug: on a GPU box, tests ran in bfloat16 on CUDA against float32
    references and failed."""
    assert not torch.cuda.is_available() and os.environ.get("CUDA_VISIBLE_DEVICES") == ""
    assert LLM(tiny_models["gqa"], block_size=4).engine.device.type == "cpu"
