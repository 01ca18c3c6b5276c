"""Tests for nanoserve/models/ (llama.py, loader.py) and layers/: logits equal transformers' model of
each family nanoserve runs (conftest.FAMILIES: Llama, Mistral, Qwen2, Qwen3).

Each test builds a tiny random model with transformers, saves it like a Hub checkpoint into a tmp
folder, loads it with `load_model` and compares logits for the same tokens. Weights use
initializer_range 0.2 (HF's default 0.02 makes logits nearly flat, so a wrong model could still
pass). Nothing is downloaded. The error tests damage a saved checkpoint and expect a ValueError
whose message names the problem.
"""
from __future__ import annotations

import dataclasses
import json
import os
import platform
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, GPT2Config, MistralConfig, PreTrainedModel, Qwen2Config, Qwen3Config
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from conftest import FAMILIES, save_tiny_model
from nanoserve import device
from nanoserve.batch import Batch
from nanoserve.device import resolve_dtype
from nanoserve.layers import linear
from nanoserve.layers.linear import PackedLinear
from nanoserve.layers.rotary_embedding import RotaryEmbedding, apply_rope
from nanoserve.models import get_head_dim, loader
from nanoserve.models.families import MODELS, Family, describe
from nanoserve.models.loader import load_model, read_checkpoint

BLOCK_SIZE = 4
NUM_BLOCKS = 16
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def save_model(path: Path, **overrides: object) -> PreTrainedModel:
    """conftest's tiny model, with weights drawn at initializer_range 0.2 (see above) and hidden 64, 2 layers,
    4 query heads sharing 2 kv heads (GQA), head_dim 16 (Qwen3: its config's 128), vocab 256."""
    return save_tiny_model(path, **{"initializer_range": 0.2, **overrides})


def make_batch(prompts: list[list[int]], cached: list[int] | None = None) -> Batch:
    """One step for several requests by hand: request b brings `prompts[b]`, after `cached[b]` tokens
    already in its KV cache. Request b owns blocks 1 + b * 4 ... (block 0 is the null block)."""
    cached = cached or [0] * len(prompts)
    blocks_per_request = 4
    input_ids, positions, slot_mapping, block_tables = [], [], [], []
    for b, (tokens, start) in enumerate(zip(prompts, cached)):
        blocks = [1 + b * blocks_per_request + j for j in range(blocks_per_request)]
        block_tables.append(blocks)
        for pos in range(start, start + len(tokens)):
            positions.append(pos)
            slot_mapping.append(blocks[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
        input_ids += tokens
    query_lens = torch.tensor([len(p) for p in prompts])
    seq_lens = torch.tensor([len(p) + c for p, c in zip(prompts, cached)], dtype=torch.int32)
    query_start_loc = torch.cat([torch.zeros(1), query_lens.cumsum(0)]).to(torch.int32)
    return Batch(
        input_ids=torch.tensor(input_ids),
        positions=torch.tensor(positions),
        slot_mapping=torch.tensor(slot_mapping),
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        cu_seqlens_k=torch.cat([torch.zeros(1), seq_lens.cumsum(0)]).to(torch.int32),
        block_tables=torch.tensor(block_tables, dtype=torch.int32),
        logits_indices=torch.arange(len(input_ids)),  # every row, to compare all positions
        next_token_ids=torch.empty(0, dtype=torch.int64),  # no prompt-logprob rows
        max_query_len=int(query_lens.max()),
        max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=query_start_loc.numpy(),
        seq_lens_cpu=seq_lens.numpy(),
    )


def empty_kv_cache(model: torch.nn.Module) -> torch.Tensor:
    # [2, num_layers, num_blocks, block_size, num_kv_heads, head_dim]
    return torch.zeros(2, model.num_layers, NUM_BLOCKS, BLOCK_SIZE, model.num_kv_heads, model.head_dim)


def reference_logits(hf_model: PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_model(torch.tensor([tokens])).logits[0].float()  # [n, vocab]


def run_prefill(path: Path, tokens: list[int]) -> torch.Tensor:
    model = load_model(read_checkpoint(str(path)), torch.float32, torch.device("cpu"), "torch")
    with torch.inference_mode():
        return model(make_batch([tokens]), empty_kv_cache(model))  # [n, vocab]


PROMPT = [3, 17, 200, 45, 9, 120, 77, 1, 250, 64, 33]  # 11 tokens: 3 blocks, the last one partly full


def assert_same_logits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(actual.argmax(-1), expected.argmax(-1))


@pytest.mark.parametrize("overrides", [
    {},  # GQA, untied lm_head
    {"tie_word_embeddings": True},
    {"rope_parameters": LLAMA3_ROPE},
    {"num_key_value_heads": 4, "head_dim": 8},  # MHA, head_dim != hidden / heads
], ids=["gqa", "tied", "llama3_rope", "mha_head_dim"])
def test_prefill_matches_transformers(tmp_path: Path, overrides: dict) -> None:
    hf_model = save_model(tmp_path, **overrides)
    assert_same_logits(run_prefill(tmp_path, PROMPT), reference_logits(hf_model, PROMPT))


def test_tied_checkpoint_has_no_lm_head(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_model(tmp_path, tie_word_embeddings=True)
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    monkeypatch.setattr(linear, "choose_linear", lambda dtype, compiled_one_row: "row_major")
    model = load_model(read_checkpoint(str(tmp_path)), torch.float32, torch.device("cpu"), "torch")
    assert model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("layout", ["column_major", "packed", "row_major"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_linear_layout_matches_transformers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: str,
                                                  tied: bool, family: str) -> None:
    """For each family, whatever `choose_linear` picks for this CPU (forced here), the model holds the
    checkpoint's weights in that layout and float32 logits equal transformers' for a prefill and a decode
    step. Catches a layout silently lost (only the speed would drop), a packed weight transposed, a tied
    lm_head packed from the wrong matrix or left row-major at one row (MKL's slowest), or a bias (Qwen2's
    q, k, v) dropped or stacked out of order."""
    if layout == "packed" and not linear.has_onednn(torch.float32):
        pytest.skip("oneDNN float32 is used (and measured) on x86 only")
    hf_model = save_model(tmp_path, family=family, tie_word_embeddings=tied)
    monkeypatch.setattr(linear, "choose_linear", lambda dtype, compiled_one_row: layout)
    model = load_model(read_checkpoint(str(tmp_path)), torch.float32, torch.device("cpu"), "torch")
    linears = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, PackedLinear))]
    assert len(linears) == 2 * 4 + 1  # 4 per layer + lm_head
    if layout == "column_major" and tied and linear.has_onednn(torch.float32):
        assert isinstance(linears.pop(), PackedLinear)  # the tied lm_head: packed, not left row-major
    if layout == "packed":
        assert all(isinstance(m, PackedLinear) for m in linears)
    else:  # column-major: strides (1, out); a tied lm_head without oneDNN stays the (row-major) embedding
        column = [layout == "column_major" and m.weight is not model.model.embed_tokens.weight for m in linears]
        assert [m.weight.stride() == (1, m.weight.shape[0]) for m in linears] == column
    kv_cache = empty_kv_cache(model)
    with torch.inference_mode():
        prefill = model(make_batch([PROMPT]), kv_cache)
        decode = model(make_batch([[42]], cached=[len(PROMPT)]), kv_cache)
    assert_same_logits(prefill, reference_logits(hf_model, PROMPT))
    assert_same_logits(decode[0], reference_logits(hf_model, PROMPT + [42])[-1])


def test_choose_linear_by_what_onednn_does_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN-packed where oneDNN multiplies the dtype, at any batch, except float32 where the compiled
    step runs one row at a time (its templates take plain weights); else column-major float32, row-major
    bfloat16. Catches an emulated bf16 packed on an AVX2 CPU, or the compiled one-row engine's plain
    weights given to eager (10% slower at one row with both threads) or to bfloat16."""
    def choices(compiled_one_row: bool) -> list[str]:
        return [linear.choose_linear(d, compiled_one_row) for d in (torch.float32, torch.bfloat16, torch.float16)]
    monkeypatch.setattr(linear, "has_onednn", lambda dtype: dtype in (torch.float32, torch.bfloat16))
    assert choices(False) == ["packed", "packed", "row_major"]
    assert choices(True) == ["column_major", "packed", "row_major"]
    monkeypatch.setattr(linear, "has_onednn", lambda dtype: dtype == torch.float32)  # an AVX2 x86 CPU
    assert choices(False) == ["packed", "row_major", "row_major"]
    monkeypatch.setattr(linear, "has_onednn", lambda dtype: False)  # Arm, or torch without oneDNN
    assert choices(False) == ["column_major", "row_major", "row_major"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_equals_transformers_bit_for_bit(dtype: torch.dtype) -> None:
    """apply_rope with RotaryEmbedding's signed sin is HF's apply_rotary_pos_emb, bit for bit, at
    positions up to 3000. Catches the wrong half of sin negated, or a rounding a tolerance would hide."""
    rotary, positions = RotaryEmbedding(16, {"rope_theta": 10000.0}), torch.arange(0, 3000, 7)
    freqs = positions[:, None].float() * rotary.inv_freq
    hf_cos, hf_sin = torch.cat((freqs, freqs), -1).cos().to(dtype), torch.cat((freqs, freqs), -1).sin().to(dtype)
    q, k = torch.randn(2, len(positions), 4, 16).to(dtype)  # [N, heads, D] each
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], hf_cos[None], hf_sin[None])
    cos, signed_sin = rotary(positions, dtype)
    assert torch.equal(apply_rope(q, cos, signed_sin), hf_q[0].transpose(0, 1))  # HF: [batch, heads, N, D]
    assert torch.equal(apply_rope(k, cos, signed_sin), hf_k[0].transpose(0, 1))


def test_old_style_rope_scaling(tmp_path: Path) -> None:
    """Llama 3 checkpoints on the Hub write `rope_scaling` + `rope_theta`, not `rope_parameters`."""
    hf_model = save_model(tmp_path, rope_parameters=LLAMA3_ROPE)
    config = json.loads((tmp_path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = rope
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert_same_logits(run_prefill(tmp_path, PROMPT), reference_logits(hf_model, PROMPT))


def test_sharded_checkpoint(tmp_path: Path) -> None:
    hf_model = save_model(tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    assert_same_logits(run_prefill(tmp_path, PROMPT), reference_logits(hf_model, PROMPT))


def test_logits_only_for_logits_indices(tmp_path: Path) -> None:
    hf_model = save_model(tmp_path)
    model = load_model(read_checkpoint(str(tmp_path)), torch.float32, torch.device("cpu"), "torch")
    batch = make_batch([PROMPT])
    last_row = dataclasses.replace(batch, logits_indices=torch.tensor([len(PROMPT) - 1]))
    with torch.inference_mode():
        logits = model(last_row, empty_kv_cache(model))
    assert logits.shape == (1, 256) and logits.dtype == torch.float32
    assert_same_logits(logits, reference_logits(hf_model, PROMPT)[-1:])


def test_batched_prefill_then_decode(tmp_path: Path) -> None:
    """Two requests in one prefill, then one decode step each reading the cache the prefill wrote."""
    hf_model = save_model(tmp_path, rope_parameters=LLAMA3_ROPE)
    model = load_model(read_checkpoint(str(tmp_path)), torch.float32, torch.device("cpu"), "torch")
    prompts = [PROMPT, [5, 6, 7, 8, 9]]
    kv_cache = empty_kv_cache(model)
    with torch.inference_mode():
        prefill = model(make_batch(prompts), kv_cache)  # [11 + 5, vocab]
        decode = model(make_batch([[42], [43]], cached=[len(p) for p in prompts]), kv_cache)  # [2, vocab]
    assert_same_logits(prefill[:len(PROMPT)], reference_logits(hf_model, PROMPT))
    assert_same_logits(prefill[len(PROMPT):], reference_logits(hf_model, prompts[1]))
    assert_same_logits(decode[0], reference_logits(hf_model, PROMPT + [42])[-1])
    assert_same_logits(decode[1], reference_logits(hf_model, prompts[1] + [43])[-1])


def test_bfloat16_load(tmp_path: Path) -> None:
    save_model(tmp_path)
    model = load_model(read_checkpoint(str(tmp_path)), torch.bfloat16, torch.device("cpu"), "torch")
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.model.rotary["full_attention"].inv_freq.dtype == torch.float32  # RoPE angles stay float32


@pytest.mark.skipif(not linear.has_onednn(torch.bfloat16), reason="oneDNN has no bfloat16 kernels on this CPU")
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_packed_linears_equal_nn_linear(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, family: str) -> None:
    """bfloat16 on CPU runs its matmuls through PackedLinear (pack_linears): the same logits, bit for
    bit, as the reference nn.Linear model, for a prefill and a decode step. Catches a packed weight
    that is transposed, rounded or lost its tie to the embedding, or a bias (Qwen2's) left out."""
    save_model(tmp_path, family=family, tie_word_embeddings=True)
    packed = load_model(read_checkpoint(str(tmp_path)), torch.bfloat16, torch.device("cpu"), "torch")
    monkeypatch.setattr(loader, "pack_linears", lambda model, compiled_one_row: model)  # the reference: plain nn.Linear
    plain = load_model(read_checkpoint(str(tmp_path)), torch.bfloat16, torch.device("cpu"), "torch")
    assert sum(isinstance(m, PackedLinear) for m in packed.modules()) == 2 * 4 + 1  # 4 per layer + lm_head
    assert not any(isinstance(m, PackedLinear) for m in plain.modules())
    logits = []
    for model in (packed, plain):
        kv_cache = empty_kv_cache(model).bfloat16()
        with torch.inference_mode():
            prefill = model(make_batch([PROMPT]), kv_cache)
            logits.append(torch.cat([prefill, model(make_batch([[42]], cached=[len(PROMPT)]), kv_cache)]))
    assert torch.equal(logits[0], logits[1])


# ---------------------------------------------------------------------------------------------
# Errors


def load(path: Path) -> None:
    load_model(read_checkpoint(str(path)), torch.float32, torch.device("cpu"), "torch")


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="does not exist"):
        load(tmp_path / "nope")


def test_folder_without_config(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no config.json"):
        load(tmp_path)


def test_not_a_llama(tmp_path: Path) -> None:
    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="'gpt2'"):
        load(tmp_path)


def test_an_unsupported_architecture_names_the_supported_ones(tmp_path: Path) -> None:
    GPT2Config(n_layer=1, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as error:
        load(tmp_path)
    assert all(name in str(error.value) for name in MODELS)  # Llama, Mistral, Qwen2, Qwen3


@pytest.mark.parametrize("family, row, tensor", [
    ("qwen2", Family("Qwen2ForCausalLM"), "q_proj.bias"),
    ("qwen3", Family("Qwen3ForCausalLM"), "q_norm.weight"),
], ids=["qwen2_without_qkv_bias", "qwen3_without_qk_norm"])
def test_a_checkpoint_tensor_no_parameter_reads_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           family: str, row: Family, tensor: str) -> None:
    """A family registered as plain Llama (Qwen2 without its q, k, v bias, Qwen3 without its q/k norm): those
    tensors would be left unread and every logit wrong. Catches a row in MODELS missing a field: the loader
    refuses, naming the tensor."""
    save_model(tmp_path, family=family)
    monkeypatch.setitem(MODELS, row.architecture, row)
    with pytest.raises(ValueError, match=rf"'model\.layers\.0\.self_attn\.{tensor}' has no parameter"):
        load(tmp_path)


def test_a_parameter_the_checkpoint_lacks_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama registered with Qwen2's bias flag: our q, k, v biases have no checkpoint tensor. Catches a
    KeyError deep in the loader, or a bias left at whatever the meta device gave it."""
    save_model(tmp_path)
    monkeypatch.setitem(MODELS, "LlamaForCausalLM", Family("LlamaForCausalLM", qkv_bias=True))
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.0\.self_attn\.k_proj\.bias'"):
        load(tmp_path)


def test_head_dim_from_the_config_or_from_hidden_size_over_heads() -> None:
    """Mistral's config gives head_dim (here not hidden / heads), Qwen3's gives 128 unless told otherwise,
    Qwen2's has none: the runner sizes the KV cache and picks the attention backend from the same head_dim
    the model is built with (the Family's). Catches hidden / heads where the config says otherwise."""
    sizes = dict(hidden_size=64, num_attention_heads=4)
    assert get_head_dim(MistralConfig(**sizes, head_dim=8)) == 8
    assert not hasattr(Qwen2Config(), "head_dim") and get_head_dim(Qwen2Config(**sizes)) == 16
    qwen3 = Qwen3Config(**sizes, architectures=["Qwen3ForCausalLM"])
    assert get_head_dim(qwen3) == describe(qwen3).head_dim == 128


def test_a_family_is_its_row_completed_from_the_config() -> None:
    """`describe` keeps the architecture's row (Qwen3's q/k norm) and reads the rest from config.json. Catches
    a field left at the row's default (an untied head for a tied checkpoint, Llama's RoPE theta)."""
    rope = {"rope_type": "default", "rope_theta": 1e6}
    config = Qwen3Config(hidden_size=64, num_attention_heads=4, head_dim=32, tie_word_embeddings=True,
                         rope_parameters=rope, architectures=["Qwen3ForCausalLM"])
    assert describe(config) == Family("Qwen3ForCausalLM", qk_norm=True, head_dim=32, tie_word_embeddings=True,
                                      rope_parameters=rope, sliding_window=None,
                                      layer_types=("full_attention",) * config.num_hidden_layers)


def test_unsupported_rope_type(tmp_path: Path) -> None:
    save_model(tmp_path, rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(ValueError, match="'linear'"):
        load(tmp_path)


def test_missing_tensor(tmp_path: Path) -> None:
    save_model(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load(tmp_path)


def test_wrong_shape(tmp_path: Path) -> None:
    save_model(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)  # 1 kv head, not 2
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.k_proj\.weight' has shape "
                                         r"\[16, 64\], expected \[32, 64\]"):
        load(tmp_path)


def write_config(folder: Path, **fields: object) -> torch.dtype | None:
    """A config.json with these fields, read back as the engine reads it: the dtype resolve_dtype gets."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", **fields}))
    return AutoConfig.from_pretrained(folder).dtype


def test_auto_dtype_follows_the_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(device, "why_not_native_bf16", lambda batched=False: None)  # a CPU with AMX
    cpu, cuda = torch.device("cpu"), torch.device("cuda")  # only resolved here, nothing runs on CUDA
    fp32 = write_config(tmp_path / "fp32", dtype="float32")
    bf16 = write_config(tmp_path / "bf16", dtype="bfloat16")
    old_name = write_config(tmp_path / "old", torch_dtype="bfloat16")  # transformers before v5
    unnamed = write_config(tmp_path / "none")
    assert resolve_dtype("auto", cpu, fp32) == torch.float32  # a float32 checkpoint stays float32 on CPU
    assert resolve_dtype("auto", cpu, bf16) == torch.bfloat16
    assert resolve_dtype("auto", cpu, old_name) == torch.bfloat16
    assert resolve_dtype("auto", cpu, unnamed) == torch.float32
    assert resolve_dtype("auto", cuda, fp32) == torch.bfloat16  # flash-attn needs 16 bits
    assert resolve_dtype("auto", cuda, unnamed) == torch.bfloat16
    assert resolve_dtype("float32", cpu, bf16) == torch.float32  # a name given wins


@pytest.mark.parametrize("capability, saved, expected", [((7, 5), "float32", torch.float16),
                                                         ((7, 5), "bfloat16", torch.float16),
                                                         ((8, 0), "float32", torch.bfloat16),
                                                         ((9, 0), "float16", torch.float16)])
def test_float16_below_sm80(monkeypatch, tmp_path, capability, saved, expected):
    """dtype "auto" on CUDA: bfloat16, but float16 where the GPU has no bfloat16 tensor cores (a T4)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert resolve_dtype("auto", torch.device("cuda"), write_config(tmp_path, dtype=saved)) == expected


def test_auto_dtype_never_emulates_bfloat16(tmp_path, monkeypatch, caplog):
    """Without native bf16 matmuls "auto" runs a bfloat16 checkpoint in float32 and logs one line
    saying why; bfloat16 asked for by name obeys, with a warning. Catches "auto" picking an
    emulated dtype (2-5x slower at batch decode on an AVX2 CPU), or overruling an explicit name."""
    monkeypatch.setattr(device, "why_not_native_bf16", lambda batched=False: "an emulating CPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    bf16 = write_config(tmp_path / "bf16", dtype="bfloat16")
    cpu = torch.device("cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_dtype("auto", cpu, bf16) == torch.float32
        assert resolve_dtype("float32", cpu, bf16) == torch.float32
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "float32" in caplog.records[0].message
    with pytest.warns(UserWarning, match="slow"):
        assert resolve_dtype("bfloat16", cpu, bf16) == torch.bfloat16
    assert resolve_dtype("auto", torch.device("cuda"), bf16) == torch.bfloat16  # the rule is the CPU's


@pytest.mark.parametrize("amx", [False, True])
def test_auto_dtype_keeps_bfloat16_on_a_cpu_only_where_it_beats_float32(tmp_path, monkeypatch, amx):
    """An x86 CPU with AVX512-BF16 multiplies bfloat16 natively, but without AMX batch decode ran slower
    than in float32 (measured on two such CPUs): "auto" picks float32 there, bfloat16 with AMX; bfloat16
    asked for by name runs without a warning on both. Catches "auto" slower than float32 on such a CPU,
    or a warning (or a refusal) for a bfloat16 that is native."""
    monkeypatch.setattr(device.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: True)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    bf16, cpu = write_config(tmp_path / "bf16", dtype="bfloat16"), torch.device("cpu")
    assert resolve_dtype("auto", cpu, bf16) == (torch.bfloat16 if amx else torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_dtype("bfloat16", cpu, bf16) == torch.bfloat16


# CPUs without native (or without fast batched) bfloat16, as torch reports them: (machine, oneDNN built in,
# oneDNN bf16 kernels, AVX512-BF16, AMX), and the cause the dtype warning must name.
SLOW_BF16_CPUS = {
    "torch without oneDNN": (("x86_64", False, False, True, True), "without oneDNN"),
    "AVX2 x86": (("x86_64", True, False, False, False), "they need AVX-512"),
    "Arm without BF16": (("aarch64", True, False, False, False), "Arm CPU has no BF16"),
    "AVX-512 without BF16": (("x86_64", True, True, False, False), "no AVX512-BF16 nor AMX"),
    "AVX512-BF16 without AMX": (("x86_64", True, True, True, False), "no AMX:"),
}


@pytest.mark.parametrize("cpu", SLOW_BF16_CPUS)
def test_bfloat16_warning_names_its_cause(tmp_path, monkeypatch, caplog, cpu):
    """Each CPU without fast bfloat16, forced: "auto" logs why it runs float32 and bfloat16 by name warns
    why it is slow, naming this CPU's cause and no other's (AVX512-BF16 alone is native, only slower at
    batch decode: no warning by name). Catches a message that names one cause for all ("no AMX" on Arm)."""
    (machine, mkldnn, onednn_bf16, avx512_bf16, amx), cause = SLOW_BF16_CPUS[cpu]
    monkeypatch.setattr(device.platform, "machine", lambda: machine)
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: mkldnn)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: onednn_bf16)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    bf16, cpu_device = write_config(tmp_path, dtype="bfloat16"), torch.device("cpu")
    others = [other for name, (_, other) in SLOW_BF16_CPUS.items() if name != cpu]
    assert resolve_dtype("auto", cpu_device, bf16) == torch.float32
    [record] = caplog.records
    assert cause in record.message and not any(other in record.message for other in others)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert resolve_dtype("bfloat16", cpu_device, bf16) == torch.bfloat16
    messages = [str(w.message) for w in caught]
    if cpu == "AVX512-BF16 without AMX":
        assert messages == []
    else:
        assert len(messages) == 1 and cause in messages[0] and not any(other in messages[0] for other in others)


@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="oneDNN's ISA names are x86's")
def test_no_native_bfloat16_under_avx2_emulation() -> None:
    """With oneDNN held to AVX2 (how an AVX2 laptop is approximated on an AVX-512 machine), bf16 is
    not native and not packed, whatever /proc/cpuinfo says. Catches a check of the CPU's flags only."""
    env = os.environ | {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    code = "import torch; from nanoserve import device; from nanoserve.layers import linear; " \
           "print(device.why_not_native_bf16() is None, linear.has_onednn(torch.bfloat16))"
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=Path(__file__).parents[1], capture_output=True,
                         text=True, check=True).stdout
    assert out.split() == ["False", "False"]
