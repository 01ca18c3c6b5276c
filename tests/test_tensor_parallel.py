"""Tensor parallelism on CPU (gloo, 2 processes): token-exact with one process and with transformers,
each rank holding only its shard, aborts, bad sizes refused, failing workers reported, nothing left
running after close."""
import gc
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from test_engine import MAX_TOKENS, PROMPTS
from transformers import PretrainedConfig

import conftest
from conftest import greedy
from nanoserve import LLM
from nanoserve.config import Config
from nanoserve.distributed import Shard, check_tensor_parallel
from nanoserve.extensions.parallel import Workers
from nanoserve.models import loader
from nanoserve.models.loader import load_model, read_checkpoint

# Chunked prefill (8 tokens a step), preemption (18 blocks of 4 for 6 requests) and prefix-cache
# hits (prompts 3 and 4 share a prefix with prompt 0) in one run.
PRESSURE = dict(block_size=4, max_num_batched_tokens=8, num_kvcache_blocks=18, max_model_len=64)


def read_config(path: str) -> PretrainedConfig:
    """The checkpoint's config.json, as the engine reads it (`read_checkpoint`)."""
    return read_checkpoint(path).config


def reference(path: str) -> list[list[int]]:
    return conftest.reference(path, PROMPTS, MAX_TOKENS)


def children_alive(pids: list[int]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    return alive


@pytest.mark.parametrize("model", ["gqa", "tied", "mistral", "qwen2", "qwen3", "qwen3_tied"])
def test_tp2_matches_tp1_and_transformers(tiny_models, model):
    """Catches a wrong split (q/k/v slices crossed, GQA heads paired with another rank's KV heads,
    o_proj split on the wrong dim, Qwen2's q/k/v biases not split with their weights, Qwen3's q/k norm
    weights split instead of whole on every rank), a missing
    all-reduce, a vocab range off by one in the embedding or lm_head gather, and tied embeddings sliced
    differently from lm_head."""
    path = tiny_models[model]
    params = [greedy(n) for n in MAX_TOKENS]
    one = LLM(path, **PRESSURE).generate(PROMPTS, params, use_tqdm=False)
    with LLM(path, tensor_parallel_size=2, **PRESSURE) as llm:
        two = llm.generate(PROMPTS, params, use_tqdm=False)
        scheduler, runner = llm.engine.scheduler, llm.engine.model_runner
        assert scheduler.num_preemptions > 0 and scheduler.num_cached_tokens > 0
        assert scheduler.block_manager.num_free_blocks == runner.num_blocks - 1
        # rank 0's cache: its own KV heads only, as many blocks as the block tables use
        assert runner.kv_cache.shape[-2] == read_config(path).num_key_value_heads // 2
        assert runner.kv_cache.shape[2] == PRESSURE["num_kvcache_blocks"]
    assert [o.token_ids for o in two] == [o.token_ids for o in one] == reference(path)


def test_each_rank_holds_only_its_shard(tiny_models, monkeypatch):
    """Loading with Shard(r, 2) gives halves that put together are the whole model: catches slicing
    the wrong dim, taking the same half on both ranks, or q, k, v stacked before slicing."""
    monkeypatch.setattr(loader, "pack_linears", lambda model, compiled_one_row: model)  # the checkpoint's layout
    path, config = tiny_models["gqa"], read_config(tiny_models["gqa"])
    checkpoint = read_checkpoint(path)
    whole = load_model(checkpoint, torch.float32, torch.device("cpu"), "torch")
    halves = [load_model(checkpoint, torch.float32, torch.device("cpu"), "torch", Shard(r, 2)) for r in range(2)]
    head_dim, hidden = whole.head_dim, config.hidden_size
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim

    def qkv(weight, q_size, kv_size):  # [q; k; v] rows
        return weight.split([q_size, kv_size, kv_size])

    full_q, full_k, full_v = qkv(whole.model.layers[0].self_attn.qkv_proj.weight, q, kv)
    parts = [qkv(h.model.layers[0].self_attn.qkv_proj.weight, q // 2, kv // 2) for h in halves]
    for i, full in enumerate((full_q, full_k, full_v)):
        assert torch.equal(torch.cat([p[i] for p in parts]), full)
    for name, dim in (("self_attn.o_proj", 1), ("mlp.down_proj", 1)):  # row-parallel: split on in_features
        full = whole.model.layers[1].get_submodule(name).weight
        assert torch.equal(torch.cat([h.model.layers[1].get_submodule(name).weight for h in halves], dim=dim), full)
    gate_up = [h.model.layers[1].mlp.gate_up_proj.weight.chunk(2) for h in halves]
    full_gate, full_up = whole.model.layers[1].mlp.gate_up_proj.weight.chunk(2)
    assert torch.equal(torch.cat([g for g, _ in gate_up]), full_gate)
    assert torch.equal(torch.cat([u for _, u in gate_up]), full_up)
    assert torch.equal(torch.cat([h.lm_head.weight for h in halves]), whole.lm_head.weight)
    assert halves[0].model.embed_tokens.weight.shape == (config.vocab_size // 2, hidden)
    assert halves[1].num_kv_heads == config.num_key_value_heads // 2


def test_abort_under_tensor_parallelism(tiny_models):
    """An abort on rank 0 frees its blocks and never desynchronises the workers: the other
    requests still match transformers and the next step still runs on every rank."""
    with LLM(tiny_models["gqa"], tensor_parallel_size=2, **PRESSURE) as llm:
        check_abort(llm.engine, reference(tiny_models["gqa"]))


def check_abort(engine, expected):
    ids = [engine.add_request(p, greedy(n)) for p, n in zip(PROMPTS, MAX_TOKENS)]
    engine.step(), engine.step(), engine.step()
    engine.abort_request(ids[2])
    outputs = {}
    while engine.has_unfinished_requests():
        outputs.update((o.request_id, o) for o in engine.step().outputs)
        engine.assert_invariants()
    assert outputs[ids[2]].finish_reason == "abort"
    assert all(outputs[i].token_ids == expected[k] for k, i in enumerate(ids) if k != 2)
    assert engine.scheduler.block_manager.num_free_blocks == engine.model_runner.num_blocks - 1


@pytest.mark.parametrize("model, size, name", [("gqa", 3, "num_attention_heads"), ("llama3", 2, "num_key_value_heads")])
def test_sizes_that_do_not_split_the_model_are_refused(tiny_models, model, size, name):
    """Catches a size that leaves some heads on no rank (silently wrong attention)."""
    with pytest.raises(ValueError, match=name):
        LLM(tiny_models[model], tensor_parallel_size=size)


def test_vocab_and_devices_are_checked(tmp_path, monkeypatch):
    """A vocabulary that does not split evenly, more ranks than GPUs, a second open group, size 0."""
    path = conftest.build_tiny_llama(str(tmp_path / "odd_vocab"), vocab_size=255)
    with pytest.raises(ValueError, match="vocab_size=255"):
        LLM(path, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(path, tensor_parallel_size=0)
    config = read_config(conftest.build_tiny_llama(str(tmp_path / "even"), vocab_size=256))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="CUDA devices"):
        check_tensor_parallel(2, config, torch.device("cuda"))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    with pytest.raises(ValueError, match="close"):
        check_tensor_parallel(2, config, torch.device("cpu"))


def test_a_failed_start_leaves_nothing_running(tiny_models):
    """A ValueError while rank 0 starts (here: a KV cache over free memory) stops the workers it
    had started and leaves the process group, so the next tensor-parallel LLM can start."""
    before = {p.pid for p in multiprocessing.active_children()}
    with pytest.raises(ValueError, match="num_kvcache_blocks"):
        LLM(tiny_models["gqa"], tensor_parallel_size=2, num_kvcache_blocks=10**9)
    assert {p.pid for p in multiprocessing.active_children()} == before and not dist.is_initialized()


def test_a_failed_engine_start_after_the_runner_stops_the_workers(tiny_models):
    """The engine's own checks run after the workers started (here: a cache too small for one
    request): they must stop them too, or the next tensor-parallel LLM could not start."""
    before = {p.pid for p in multiprocessing.active_children()}
    with pytest.raises(ValueError, match="too few for one request"):
        LLM(tiny_models["gqa"], tensor_parallel_size=2, block_size=4, num_kvcache_blocks=3, max_model_len=64)
    assert {p.pid for p in multiprocessing.active_children()} == before and not dist.is_initialized()


def test_a_worker_that_dies_before_joining_is_reported_at_once(tiny_models):
    """Rank 0 must not wait in the group's rendezvous (2 minutes) for a worker that is already dead."""
    config = Config(tiny_models["gqa"], tensor_parallel_size=2)
    workers = Workers(config, 256, torch.device("cpu"), None)  # no weight transform
    os.kill(workers.processes[0].pid, signal.SIGKILL)  # long before it says "started" (spawning takes seconds)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="worker 1 failed to start(.|\n)*died"):
        workers.wait_until_started()
    assert time.monotonic() - start < 10
    workers.close()


def test_each_rank_takes_its_share_of_the_threads(tiny_models):
    """Two ranks on a CPU share its cores: oversubscribed OpenMP threads spin against each other
    (on this machine a step became 20x slower), so rank 0 halves its threads and the worker gets as many."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with LLM(tiny_models["gqa"], tensor_parallel_size=2, block_size=4) as llm:
            assert torch.get_num_threads() == 1
            expected = reference(tiny_models["gqa"])[1][:4]
            assert llm.generate([PROMPTS[1]], greedy(4), use_tqdm=False)[0].token_ids == expected
    finally:
        torch.set_num_threads(threads)


def test_a_worker_that_raises_is_reported_on_rank0(tiny_models):
    """A worker's exception comes back as rank 0's RuntimeError with the worker's traceback, not a
    hang; the LLM then refuses to run (its ranks are out of step) and close() still cleans up."""
    llm = LLM(tiny_models["gqa"], tensor_parallel_size=2, block_size=4)
    runner = llm.engine.model_runner
    pids = [p.pid for p in runner.workers.processes]
    runner.workers.pipes[0].send("not a batch")  # the worker fails on it: a str is no (tensors, others) pair
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="worker 1 failed(.|\n)*ValueError: too many values to unpack"):
        llm.generate([PROMPTS[0]], greedy(3), use_tqdm=False)
    assert time.monotonic() - start < 30
    with pytest.raises(RuntimeError, match="stopped"):
        llm.generate([PROMPTS[0]], greedy(3), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    llm.close()
    assert not children_alive(pids) and not dist.is_initialized()


def test_a_worker_that_dies_is_reported_and_close_frees_everything(tiny_models):
    """A killed worker is an error on rank 0 within seconds; close() ends every process and frees
    the port, so another tensor-parallel LLM starts in the same process."""
    llm = LLM(tiny_models["gqa"], tensor_parallel_size=2, block_size=4)
    runner = llm.engine.model_runner
    pids, port = [p.pid for p in runner.workers.processes], runner.workers.store.port
    os.kill(pids[0], signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="worker 1 died"):
        llm.generate([PROMPTS[0]], greedy(3), use_tqdm=False)
    assert time.monotonic() - start < 30
    llm.close()
    assert not children_alive(pids) and not dist.is_initialized()
    gc.collect()  # the failed collective's traceback (frames, hence the group) was a reference cycle
    with socket.socket() as s:  # raises if rank 0 still listens on the rendezvous port
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # closed connections may linger in TIME_WAIT
        s.bind(("127.0.0.1", port))
        s.listen()
    with LLM(tiny_models["gqa"], tensor_parallel_size=2, block_size=4) as again:
        expected = reference(tiny_models["gqa"])[1][:4]
        assert again.generate([PROMPTS[1]], greedy(4), use_tqdm=False)[0].token_ids == expected


def test_close_stops_a_worker_stuck_in_a_collective(tiny_models):
    """A worker waiting in an all-reduce for a rank 0 that never comes (as after a Ctrl-C mid-step)
    never reads the pipe: close() must terminate it, not wait for it forever."""
    llm = LLM(tiny_models["gqa"], tensor_parallel_size=2, block_size=4)
    llm.engine.add_request(PROMPTS[0], greedy(3))
    batch = llm.engine.step().batch
    workers = llm.engine.model_runner.workers
    pids = [p.pid for p in workers.processes]
    workers.send(batch)  # the worker runs it alone and blocks in its first collective
    start = time.monotonic()
    llm.close()
    assert time.monotonic() - start < 20 and not children_alive(pids)


def test_an_llm_dropped_without_close_makes_room_for_the_next(tiny_models):
    """As with vLLM, users rarely call close(): a tensor-parallel LLM that is garbage stops its
    workers and leaves the process group, so the next one starts instead of raising."""
    first = LLM(tiny_models["gqa"], tensor_parallel_size=2, block_size=4)
    pids = [p.pid for p in first.engine.model_runner.workers.processes]
    del first
    second = LLM(tiny_models["gqa"], tensor_parallel_size=2, block_size=4)
    assert not children_alive(pids)
    assert second.generate([PROMPTS[1]], greedy(4), use_tqdm=False)[0].token_ids == reference(tiny_models["gqa"])[1][:4]
    second.close()


def test_interpreter_exit_stops_the_workers(tiny_models):
    """A script that never calls close() leaves no worker behind when it exits."""
    script = (f"from nanoserve import LLM\nif __name__ == '__main__':\n"
              f"    llm = LLM({tiny_models['gqa']!r}, tensor_parallel_size=2)\n"
              f"    print(*[p.pid for p in llm.engine.model_runner.workers.processes])\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    pids = [int(pid) for pid in result.stdout.split()]
    assert pids
    deadline = time.monotonic() + 10
    while children_alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not children_alive(pids)


def test_a_script_without_a_main_guard_is_told_why_its_worker_died(tiny_models, tmp_path):
    """A spawned worker imports the script again; unguarded, it fails at start-up. The error must
    say so: a bare "worker 1 died (exit code 1)" leaves the user guessing."""
    script = tmp_path / "unguarded.py"
    script.write_text(f"from nanoserve import LLM\nLLM({tiny_models['gqa']!r}, tensor_parallel_size=2)\n")
    root = str(Path(__file__).resolve().parent.parent)  # this checkout's nanoserve, installed or not
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode != 0
    assert "worker 1 died (exit code 1)" in result.stderr and 'if __name__ == "__main__":' in result.stderr


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL)")
def test_tp2_on_two_gpus_matches_tp1(tiny_models):
    path = tiny_models["gqa"]
    params = [greedy(n) for n in MAX_TOKENS]
    one = LLM(path, dtype="float32", attention_backend="torch", **PRESSURE).generate(PROMPTS, params, use_tqdm=False)
    with LLM(path, dtype="float32", attention_backend="torch", tensor_parallel_size=2, **PRESSURE) as llm:
        two = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in two] == [o.token_ids for o in one]
