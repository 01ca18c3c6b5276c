"""The model runner's start-up choices that depend on the machine: how big the KV cache is, and
which device and attention backend serve. Portable: nothing here may need Linux-only calls."""
import os
from collections import namedtuple

import pytest
import torch

import nanoserve.device as device_module
import nanoserve.model_runner as model_runner_module
from conftest import greedy, reference
from nanoserve import LLM
from nanoserve.attention import select_attention
from nanoserve.config import CPU_KV_CACHE_FRACTION, Config
from nanoserve.device import resolve_device
from nanoserve.layers import linear

Memory = namedtuple("Memory", "available total")


def test_kv_cache_is_sized_from_available_memory_without_linux_only_calls(tiny_models, monkeypatch):
    def no_sysconf(name):  # as on macOS, where SC_AVPHYS_PAGES does not exist
        raise ValueError(f"unrecognized configuration name {name!r}")
    monkeypatch.setattr(os, "sysconf", no_sysconf)
    monkeypatch.setattr(device_module.psutil, "virtual_memory", lambda: Memory(10 * 2**20, 64 * 2**20))
    llm = LLM(tiny_models["gqa"], block_size=4, max_num_seqs=64)
    runner = llm.engine.model_runner
    # tiny model: 2 layers x 2 kv heads x head_dim 16 x 4 slots x k and v x 4 bytes = 2 KiB a block
    assert runner.bytes_per_block() == 2048
    assert runner.num_blocks == int(CPU_KV_CACHE_FRACTION * 10 * 2**20 // 2048)


def test_a_budget_too_small_for_one_request_is_an_error_not_a_cache_over_budget(tiny_models, monkeypatch):
    monkeypatch.setattr(device_module.psutil, "virtual_memory", lambda: Memory(100 * 2048, 2**30))
    # 10% of 100 blocks' worth is 10 blocks: fewer than one 256-token request needs (64 + null block)
    with pytest.raises(ValueError, match="9 usable blocks of 4 slots"):
        LLM(tiny_models["gqa"], block_size=4)
    # A budget of 1 block (the null block alone) is refused too, even where 2 blocks would serve a
    # request of max_model_len=4: the bug rounded every budget up to 2 blocks, over the memory given.
    monkeypatch.setattr(device_module.psutil, "virtual_memory", lambda: Memory(15 * 2048, 2**30))
    with pytest.raises(ValueError, match="0 usable blocks"):
        LLM(tiny_models["gqa"], block_size=4, max_model_len=4)


def test_mps_is_a_device_that_runs_the_torch_backend(monkeypatch):
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    device = resolve_device("mps")
    assert device.type == "mps"
    assert select_attention("auto", "auto", device, torch.float32, 16) == ("torch", 16)
    with pytest.raises(ValueError, match="needs an NVIDIA GPU"):
        select_attention("flash", 256, device, torch.bfloat16, 16)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(ValueError, match="'mps' is not available"):
        resolve_device("mps")


def test_the_warm_up_peak_comes_off_the_gpu_budget(tiny_models, monkeypatch):
    runner = LLM(tiny_models["gqa"], block_size=4).engine.model_runner  # 2 KiB a block (above)
    monkeypatch.setattr(model_runner_module, "free_memory", lambda device: (10 * 2**20, 20 * 2**20))
    monkeypatch.setattr(runner, "device", torch.device("cuda"))  # sizing only: nothing runs there
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 7 * 2**20)  # in the warm-up
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 4 * 2**20)  # after it
    # 10 MiB free, less 10% of 20 MiB left to others, less the warm-up's 3 MiB peak: 5 MiB, 2560 blocks
    assert runner.size_kv_cache(Config(model="unused", max_num_seqs=64), 256) == 2560


def test_the_warm_up_runs_the_largest_step_on_a_throwaway_cache(tiny_models):
    """On CUDA it runs before the cache is sized; here it is called on a running engine, which must
    not notice: a warm-up writing into the real KV cache would change the tokens that follow."""
    path, prompts = tiny_models["gqa"], [[5, 6, 7, 8, 9], [5, 6, 7, 8, 9, 10, 11]]
    llm = LLM(path, block_size=4, max_num_batched_tokens=40, max_num_seqs=4, enable_prefix_caching=False)
    first = llm.generate(prompts[:1], greedy(3), use_tqdm=False)
    cache = llm.engine.model_runner.kv_cache.clone()
    llm.engine.model_runner.warm_up(llm.engine.config, llm.engine.max_model_len)
    assert torch.equal(llm.engine.model_runner.kv_cache, cache)
    outputs = first + llm.generate(prompts[1:], greedy(3), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == reference(path, prompts, [3, 3])


@pytest.mark.skipif(not linear.has_onednn(torch.float32), reason="float32 runs column-major wherever oneDNN does not")
def test_eager_float32_linears_are_packed_at_any_batch(tiny_models):
    """Eager float32 takes oneDNN's packed weights at one row too (0.68-0.75x column-major's time with
    torch's default threads); only the compiled one-row engine keeps plain ones (test_compilation.py).
    Catches the compiled engine's choice given to eager."""
    def linears(max_num_seqs: int) -> set[type]:
        model = LLM(tiny_models["gqa"], block_size=4, max_num_seqs=max_num_seqs).engine.model_runner.model
        return {type(m) for m in model.modules() if isinstance(m, (torch.nn.Linear, linear.PackedLinear))}
    assert linears(1) == linears(2) == {linear.PackedLinear}
