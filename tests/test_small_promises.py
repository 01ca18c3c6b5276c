"""Small promises a planted bug once broke unnoticed, each with the test that now fails on it: the queue-time
metric, /detokenize's bound, an Arm CPU's native bfloat16, the warm-up's sampling rows, the KV bytes of
tensor-parallel ranks that share a CPU's RAM."""
import types

import pytest
import torch
from test_serve import KEY, NAME, model_path, post, start_server  # noqa: F401 (fixtures)

import nanoserve.device as device_module
import nanoserve.model_runner as model_runner_module
from nanoserve import LLM
from nanoserve.entrypoints.openai.metrics import Metrics
from nanoserve.outputs import StepResult


# Catches: queue time observed at the end of the request's first step instead of its start (it then counted
# the step's own compute as waiting).
def test_queue_time_runs_until_the_first_step_starts():
    metrics = Metrics("m", num_usable_blocks=10)
    metrics.record_added("r", num_prompt_tokens=3, arrival_time=10.0)
    metrics.record_step(StepResult(None, [("r", 3)], [], [], []), start=12.5, end=20.0)
    assert metrics.queue_time._sum.get() == pytest.approx(2.5)
    metrics.record_step(StepResult(None, [("r", 1)], ["r"], [], []), start=21.0, end=22.0)
    assert metrics.queue_time._sum.get() == pytest.approx(2.5)  # once: the first step alone


# Catches: /detokenize taking id len(tokenizer) (an off-by-one in its bound: <= for <), which the tokenizer
# decodes as nothing or raises on.
def test_detokenize_refuses_the_first_id_past_the_vocabulary(model_path):  # noqa: F811
    server = start_server(model_path, api_key=KEY)
    try:
        size = len(server.serving.tokenizer)
        assert post(server, "/detokenize", dict(model=NAME, tokens=[size - 1])).status_code == 200
        reply = post(server, "/detokenize", dict(model=NAME, tokens=[1, size]))
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "tokens", reply.text
    finally:
        server.stop()


# Catches: an Arm CPU with BF16 instructions never counted as native (the x86 checks, AVX512-BF16 and AMX,
# applied to it too), so dtype="auto" ran float32 there.
@pytest.mark.parametrize("batched", [False, True])
def test_an_arm_cpu_with_bf16_multiplies_bfloat16_natively(monkeypatch, batched):
    monkeypatch.setattr(device_module.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(device_module.torch.backends.mkldnn, "is_available", lambda: True)
    monkeypatch.setattr(device_module, "has_onednn", lambda dtype: True)  # oneDNN's bf16 kernels: Arm BF16
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)  # x86's alone
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    assert device_module.why_not_native_bf16(batched=batched) is None
    monkeypatch.setattr(device_module, "has_onednn", lambda dtype: False)  # an Arm CPU without BF16
    assert "Arm" in device_module.why_not_native_bf16(batched=batched)


# Catches: the warm-up sampling fewer rows than max_num_seqs: on CUDA its peak sizes the KV cache, so a full
# batch's sampler copies ([max_num_seqs, vocab]) would then find no memory left.
def test_the_warm_up_samples_max_num_seqs_rows(tiny_models, monkeypatch):
    llm = LLM(tiny_models["gqa"], block_size=4, max_num_batched_tokens=40, max_num_seqs=7)
    rows = []
    sample = model_runner_module.sample

    def counting(logits, params, num_generated):
        rows.append((logits.shape[0], len(params)))
        return sample(logits, params, num_generated)
    monkeypatch.setattr(model_runner_module, "sample", counting)
    llm.engine.model_runner.warm_up(llm.engine.config, llm.engine.max_model_len)
    assert rows == [(7, 7)]


# Catches: bytes_per_block counting one rank where tensor-parallel ranks share a CPU's RAM (each holds its
# own cache in the same memory: the cache sized for one took the RAM of all), or counting them on a GPU each.
def test_kv_bytes_per_block_count_the_ranks_that_share_a_cpus_ram(tiny_models):
    runner = LLM(tiny_models["gqa"], block_size=4).engine.model_runner
    one_rank = runner.bytes_per_block()
    runner.shard = types.SimpleNamespace(rank=0, size=2)
    assert runner.bytes_per_block() == 2 * one_rank
    runner.device = torch.device("cuda")  # a GPU per rank: its own memory
    assert runner.bytes_per_block() == one_rank
