"""Tiny random models of each family nanoserve runs (Llamas first), built with transformers and saved
to a temp folder: no hub, no downloads.

Tests run on the CPU even where CUDA exists (LLM() would pick it, in bfloat16, against float32
references), their subprocesses too; only tests marked `gpu` see the GPU, and they are skipped
without one."""
import functools
import importlib
import json
import os

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GemmaConfig,
    LlamaConfig,
    MistralConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)

from nanoserve import SamplingParams

HAS_CUDA = torch.cuda.is_available()  # asked before any test hides the GPU (CUDA reads its env once)

# torch's process-wide settings as the suite found them, before any test ran: tests/test_settings_restored.py,
# which runs last, finds them unchanged (a test must change them through torch's own `patch`, which restores)
TORCH_CONFIGS = {name: importlib.import_module(name)
                 for name in ("torch._dynamo.config", "torch._inductor.config", "torch.fx.experimental._config")}
SETTINGS_AT_START = {name: module.get_config_copy() for name, module in TORCH_CONFIGS.items()}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("gpu") and not HAS_CUDA:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))
    items.sort(key=lambda item: item.path.name == "test_settings_restored.py")  # stable: that file runs last


@pytest.fixture(autouse=True)
def cpu_unless_marked_gpu(request, monkeypatch):
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # for the subprocesses a test starts


TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=256, max_position_embeddings=256,
            bos_token_id=1, eos_token_id=2, initializer_range=0.1)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
# Each architecture in nanoserve/models/families.py's MODELS, by the config class transformers builds it from.
FAMILIES = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
            "gemma": GemmaConfig, "gemma2": Gemma2Config, "gemma3": Gemma3TextConfig}
MODELS = {
    "gqa": {},
    "tied": dict(tie_word_embeddings=True, num_key_value_heads=4),
    "llama3": dict(rope_parameters=LLAMA3_ROPE, num_key_value_heads=1),
    # Mistral's 4096-token window covers the 256-token context; its head_dim is given, and not hidden / heads
    "mistral": dict(family="mistral", head_dim=8, seed=1),
    "qwen2": dict(family="qwen2"),
    # Qwen3's q/k norm; head_dim 32, not hidden / heads (16); Qwen3-0.6B's RoPE theta
    "qwen3": dict(family="qwen3", head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    # tied, and Qwen3Config's own default head_dim (128), which is not hidden / heads either
    "qwen3_tied": dict(family="qwen3", tie_word_embeddings=True, seed=2),
}


def save_tiny_model(path: str | os.PathLike, family: str = "llama", seed: int = 0, old_style_rope: bool = False,
                    max_shard_size: str | None = None, **overrides) -> PreTrainedModel:
    """The one tiny-model builder: save a random model of `family` (FAMILIES) to `path`, TINY's sizes unless
    `overrides` say otherwise, and return it (the transformers reference). Biases (Qwen2's q, k, v), which
    transformers starts at zero, are drawn at random too (`randomize_extras`): a bias lost or misplaced must
    change the tokens. With old_style_rope the config.json carries `rope_scaling` + `rope_theta` as real
    Llama 3 checkpoints do, instead of v5's rope_parameters; max_shard_size splits the weights into files."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(FAMILIES[family](**{**TINY, **overrides})).eval()
    randomize_extras(model)
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    if old_style_rope:
        config_file = os.path.join(path, "config.json")
        config = json.load(open(config_file))
        rope = config.pop("rope_parameters")
        config["rope_theta"] = rope.pop("rope_theta")
        config["rope_scaling"] = rope
        json.dump(config, open(config_file, "w"))
    return model


def build_tiny_model(path: str, family: str = "llama", **kwargs) -> str:
    """save_tiny_model, returning the folder (what LLM() takes)."""
    save_tiny_model(path, family, **kwargs)
    return path


def randomize_extras(model: torch.nn.Module) -> None:
    """Draw at random what transformers starts constant: biases (Qwen2's q, k, v; zero), Qwen3's q/k
    norm weights (one) and every Gemma norm's weight (zero: it scales by 1 + weight; std 2, else the tied
    embedding of the last token wins every step), so that a bias or norm
    lost, q's and k's swapped, or Gemma's 1 + weight read as weight changes the logits."""
    gemma = model.config.model_type.startswith("gemma")
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith(".bias"):
                parameter.normal_(0, 0.2)
            if gemma and name.endswith("norm.weight"):
                parameter.normal_(0, 2.0)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                parameter.normal_(1, 0.3)


def build_tiny_llama(path: str, **kwargs) -> str:
    """A tiny random Llama: build_tiny_model's first family."""
    return build_tiny_model(path, "llama", **kwargs)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """Folder of each tiny model by name; 'llama3_old' is llama3 with an old-style config."""
    root = tmp_path_factory.mktemp("models")
    paths = {name: build_tiny_model(str(root / name), **kw) for name, kw in MODELS.items()}
    paths["llama3_old"] = build_tiny_llama(str(root / "llama3_old"), old_style_rope=True, **MODELS["llama3"])
    return paths


@functools.cache
def hf_greedy_cached(path: str, prompts: tuple[tuple[int, ...], ...], max_tokens: tuple[int, ...]) -> list[list[int]]:
    return hf_greedy(path, [list(p) for p in prompts], list(max_tokens))


def reference(path: str, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    """hf_greedy, computed once per (model, prompts, max_tokens) in a test session."""
    return hf_greedy_cached(path, tuple(map(tuple, prompts)), tuple(max_tokens))


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens)


def hf_greedy(path: str, prompts: list[list[int]], max_tokens: list[int],
              attn_implementation: str | None = None) -> list[list[int]]:
    """The reference: transformers' greedy generate, one prompt at a time (no padding)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation=attn_implementation).eval()
    outputs = []
    with torch.no_grad():
        for prompt, n in zip(prompts, max_tokens):
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=n, pad_token_id=0)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs
