"""What every benchmark shares:
- the requests it sends (`Request`, `make_workload`, the named `WORKLOADS`);
- what an engine's run measured (`Result`, and the `Step`s the roofline reads);
- the default model, a random ~40M-parameter Llama, built once;
- the percentile every table prints."""
from __future__ import annotations

import os
import random
from dataclasses import dataclass, field

import torch

from nanoserve.config import cdiv

# The warm-up prompt: ids below 3, which workloads never draw. It is shorter than any block, so it
# leaves nothing in the prefix cache that a workload's prompt could hit.
WARM_UP = [1, 2]
# The named workloads' shapes (`--workload`); "random" takes --num-requests, --input-len, --output-len.
WORKLOADS = {
    # nano-vllm's bench.py: 256 requests, prompt and output lengths uniform in 100-1024, temperature
    # 0.6, ignore_eos; scaled to a CPU: a quarter of the requests, an eighth of the lengths
    "nanovllm": dict(num_requests=64, input_len=(13, 128), output_len=(13, 128), temperature=0.6),
    # on a GPU, nano-vllm's own shape, on a random Qwen3 of Qwen3-0.6B's shape (NANOVLLM_MODEL)
    "nanovllm-gpu": dict(num_requests=256, input_len=(100, 1024), output_len=(100, 1024), temperature=0.6),
    # many users, one system prompt, arriving together
    "shared-prefix": dict(num_requests=32, input_len=(16, 64), output_len=(16, 64), shared_prefix=256),
}
DEFAULT_MODEL = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                     intermediate_size=1408, vocab_size=32000, max_position_embeddings=1024)
# Qwen3-0.6B's shape (~0.6B parameters, tied head), the model nano-vllm publishes its numbers on
NANOVLLM_MODEL = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                      head_dim=128, intermediate_size=3072, vocab_size=151936, max_position_embeddings=4096,
                      tie_word_embeddings=True, rms_norm_eps=1e-6, rope_theta=1000000.0)


@dataclass
class Request:
    """One request of a workload: token ids in, `output_len` tokens out (EOS ignored)."""
    prompt: list[int]
    output_len: int
    temperature: float = 0.0  # nanoserve's engines sample at it; transformers' are always greedy


@dataclass
class Step:
    """One engine step as the roofline sees it."""
    seconds: float
    query_lens: list[int]   # tokens each request runs this step
    seq_lens: list[int]     # each request's context after this step
    num_sampled: int        # rows that go through lm_head

    @property
    def phase(self) -> str:
        decode = sum(n == 1 for n in self.query_lens)
        return "decode" if decode == len(self.query_lens) else "prefill" if decode == 0 else "mixed"


@dataclass
class Result:
    """What one engine's offline run of a whole workload measured."""
    engine: str
    seconds: float
    output_tokens: int            # useful tokens: each request's own output_len, no padding waste
    prompt_tokens: int
    ttft: list[float]             # per request, seconds from arrival
    tpot: list[float]             # per request, seconds per output token after the first
    peak_kv_used: int | None = None       # KV slots holding tokens, at the peak
    peak_kv_allocated: int | None = None  # KV slots held by requests (allocated blocks), at the peak
    kv_total: int | None = None           # KV slots in the whole cache (in --json only)
    extra: dict = field(default_factory=dict)
    steps: list[Step] = field(default_factory=list)  # nanoserve's steps, for the roofline

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds

    @property
    def total_tok_s(self) -> float:
        return (self.output_tokens + self.prompt_tokens) / self.seconds


def build_default_model(folder: str, nanovllm_gpu: bool = False) -> str:
    """The default workload's random Llama, built once with transformers and kept in `folder`.
    With `nanovllm_gpu` it is a random Qwen3 of Qwen3-0.6B's shape in bfloat16, built on the GPU (fast)."""
    name, family, sizes, device = "nanoserve-bench-llama-40m", "llama", DEFAULT_MODEL, "cpu"
    if nanovllm_gpu:
        name, family, sizes, device = "nanoserve-bench-qwen3-0.6b-shape", "qwen3", NANOVLLM_MODEL, "cuda"
    path = os.path.join(folder, name)
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        from transformers import AutoConfig, AutoModelForCausalLM
        torch.manual_seed(0)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **sizes))
        model.to(torch.bfloat16 if nanovllm_gpu else torch.float32).save_pretrained(path)
    return path


def make_workload(num_requests: int, input_len: tuple[int, int], output_len: tuple[int, int],
                  vocab_size: int, seed: int, temperature: float = 0.0, shared_prefix: int = 0) -> list[Request]:
    """Random token-id prompts and output lengths, each drawn uniformly from its range.
    With `shared_prefix`, every prompt starts with the same that many tokens (a system prompt)."""
    rng = random.Random(seed)
    system = [rng.randrange(3, vocab_size) for _ in range(shared_prefix)]
    return [Request(system + [rng.randrange(3, vocab_size) for _ in range(rng.randint(*input_len))],
                    rng.randint(*output_len), temperature) for _ in range(num_requests)]


def whole_blocks(num_tokens: int, block_size: int) -> int:
    """`num_tokens` rounded up to whole KV blocks (the engine wants max_model_len >= block_size)."""
    return cdiv(num_tokens, block_size) * block_size


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q / 100 * len(values)))] if values else float("nan")

