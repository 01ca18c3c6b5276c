"""The roofline: how fast a step could run on this machine.
- `measure_machine` times the two limits: a GEMM's FLOP/s (π) and a large copy's bytes/s (β).
- `ModelShape` reads what a step's FLOPs and bytes depend on from config.json.
- `step_limit` takes a step's time as max(FLOPs / π, bytes / β).
- `describe_cpu` names the CPU behind the numbers: the first line a run prints."""
from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from nanoserve.benchmarks.workload import Step
from nanoserve.device import has_onednn
from nanoserve.models import get_head_dim


@dataclass(frozen=True)
class Machine:
    """The two limits, measured in the run's dtype: GEMM rate π (FLOP/s) and stream bandwidth β (bytes/s)."""
    flops: float
    bandwidth: float


def best_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)  # the machine's rate, not the neighbours' load: the best of a few


def measure_machine(dtype: torch.dtype, device: str = "cpu", size: int = 1024, stream_mb: int = 256) -> Machine:
    """π from a square GEMM, β from copying a tensor far larger than the caches (read + write), on `device`."""
    a, b = torch.randn(size, size, dtype=dtype, device=device), torch.randn(size, size, dtype=dtype, device=device)
    src = torch.empty(stream_mb * 2 ** 20, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    done = torch.cuda.synchronize if torch.device(device).type == "cuda" else lambda: None  # GPU work is queued
    return Machine(flops=2 * size ** 3 / best_seconds(lambda: (a @ b, done()), 20),
                   bandwidth=2 * src.numel() / best_seconds(lambda: (dst.copy_(src), done()), 5))


@dataclass(frozen=True)
class ModelShape:
    """What a step's FLOPs and bytes depend on, from config.json."""
    layers: int
    hidden: int
    q_size: int       # heads * head_dim
    kv_size: int      # kv heads * head_dim
    intermediate: int
    vocab: int
    itemsize: int     # bytes per weight and KV element in the run's dtype

    @classmethod
    def read(cls, path: str, dtype: torch.dtype) -> ModelShape:
        from transformers import AutoConfig
        c = AutoConfig.from_pretrained(path)
        head_dim = get_head_dim(c)
        return cls(c.num_hidden_layers, c.hidden_size, c.num_attention_heads * head_dim,
                   c.num_key_value_heads * head_dim, c.intermediate_size, c.vocab_size, dtype.itemsize)

    @property
    def layer_params(self) -> int:  # qkv, o, gate_up, down
        qkv, o = self.hidden * (self.q_size + 2 * self.kv_size), self.q_size * self.hidden
        return qkv + o + 3 * self.hidden * self.intermediate


def step_limit(step: Step, m: ModelShape, machine: Machine) -> tuple[float, bool]:
    """The step's roofline time max(FLOPs / π, bytes / β), and whether FLOPs are the bound.
    FLOPs: linear layers for every token, q·Kᵀ and P·V over each query's visible keys, lm_head per
    sampled row. Bytes: the layers' weights and lm_head read once, KV read and KV written."""
    tokens = sum(step.query_lens)
    # a request with q queries over k keys (causal, its queries last): q*k - q*(q-1)/2 query-key pairs
    pairs = sum(q * k - q * (q - 1) // 2 for q, k in zip(step.query_lens, step.seq_lens))
    flops = 2 * m.layers * (m.layer_params * tokens + 2 * m.q_size * pairs) + 2 * m.hidden * m.vocab * step.num_sampled
    weights = m.layers * m.layer_params + (m.hidden * m.vocab if step.num_sampled else 0)
    kv = 2 * m.layers * m.kv_size * (sum(step.seq_lens) + tokens)  # read every context, write the new tokens
    compute, memory = flops / machine.flops, (weights + kv) * m.itemsize / machine.bandwidth
    return max(compute, memory), compute >= memory


def describe_cpu() -> str:
    """Which CPU a run measured, for every table. It names:
    - its model name;
    - the ISA extensions that pick torch's and oneDNN's kernels, as the hardware reports them;
    - torch's kernel level (ATEN_CPU_CAPABILITY can lower it);
    - whether oneDNN runs bfloat16 here;
    - the threads, and any env var that holds an ISA back."""
    model = platform.processor() or platform.machine()
    if os.path.isfile("/proc/cpuinfo"):  # Linux: the marketing name ("AMD EPYC 9B14")
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    isa = {"avx2": torch.cpu._is_avx2_supported(), "avx512f": torch.cpu._is_avx512_supported(),
           "avx512_bf16": torch.cpu._is_avx512_bf16_supported(), "amx": torch.cpu._is_amx_tile_supported()}
    held = [f"{k}={os.environ[k]}" for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
            if k in os.environ]
    # the thread settings every engine of the run shares: its OpenMP reads these from the environment
    omp = [f"{k}={os.environ[k]}" for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
           if k in os.environ]
    bf16 = has_onednn(torch.bfloat16)
    return (f"CPU: {model}; ISA {' '.join(k if v else f'no-{k}' for k, v in isa.items())}; torch capability "
            f"{torch.backends.cpu.get_cpu_capability()}; oneDNN bf16 {'yes' if bf16 else 'no'}; "
            f"{torch.get_num_threads()} threads, OpenMP {' '.join(omp) or 'as its defaults'}"
            + (f"; held back by {' '.join(held)}" if held else ""))

