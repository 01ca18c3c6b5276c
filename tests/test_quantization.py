"""Int8 and int4 weight-only quantization (nanoserve/extensions/quantization.py).

A layer's products equal a matmul by its dequantized weight. The engine is token-exact with transformers
running weights dequantized by the rules written out here (`quantize_by_hand`, `quantize_int4_by_hand`).
That holds alone, compiled and under tensor parallelism. Bad values are named errors."""
from functools import partial

import pytest
import torch
from test_engine import MAX_TOKENS, PROMPTS
from test_llama import PROMPT, make_batch, reference_logits
from torch import nn
from transformers import AutoModelForCausalLM

import conftest
from conftest import greedy
from nanoserve import LLM
from nanoserve.config import Config
from nanoserve.extensions import quantization
from nanoserve.extensions.quantization import DEQUANTIZE_ROWS, Int4Linear, Int8Linear, check_kernel, quantize_linears
from nanoserve.models.loader import load_model, read_checkpoint


def quantize_by_hand(weight: torch.Tensor) -> torch.Tensor:
    """The rule, independently of the code under test: a scale per row (output channel) = its largest
    |w| / 127, each weight rounded to the nearest multiple of it; returned dequantized, in float32."""
    scale = weight.float().abs().amax(dim=1, keepdim=True) / 127  # [out, 1]
    return torch.round(weight.float() / scale) * scale


def quantize_int4_by_hand(weight: torch.Tensor, group_size: int = 32) -> torch.Tensor:
    """int4's rule, independently of the code under test. Each run of `group_size` weights in a row is cut
    into 15 equal steps from its min to its max, each weight rounded to the nearest step. The scale and the
    point 8 steps above the min are rounded to the weight's dtype first. Returned dequantized, in float32."""
    out_features, in_features = weight.shape
    groups = weight.float().reshape(out_features, in_features // group_size, group_size)
    low, high = groups.amin(dim=2, keepdim=True), groups.amax(dim=2, keepdim=True)
    step = ((high - low) / 15).to(weight.dtype).float()
    middle = (low + 8 * step).to(weight.dtype).float()
    steps = torch.clamp(torch.round((groups - middle) / step), -8, 7)
    return (steps * step + middle).reshape(out_features, in_features)


def save_dequantized(path: str, out: str, row_parallel_parts: int = 1, quantize=quantize_by_hand) -> str:
    """transformers' model of `path` with every linear's weight (lm_head's too, untied from the embedding)
    dequantized by hand, saved to `out`. With tensor parallelism over `row_parallel_parts` ranks, o_proj
    and down_proj are split on their input dim, and each rank's columns get scales of their own."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.config.tie_word_embeddings = False
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                parts = row_parallel_parts if name.endswith(("o_proj", "down_proj")) else 1
                weight = torch.cat([quantize(part) for part in module.weight.chunk(parts, dim=1)], dim=1)
                module.weight = nn.Parameter(weight)
    model.save_pretrained(out)
    return out


def test_int8_linear_follows_the_rule_by_hand():
    """The layer's weight is, bit for bit, the rule `quantize_by_hand` writes out (the rule the engine tests
    compare with), on a float32 weight with rows of very different sizes. Catches the layer's rule changed
    (a scale per group, clipping, another rounding) without the tests' rule, or the other way round."""
    torch.manual_seed(0)
    linear = nn.Linear(96, 40, bias=False)
    with torch.no_grad():
        linear.weight[3] *= 50
    assert torch.equal(Int8Linear(linear).dequantize(), quantize_by_hand(linear.weight.detach()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_equals_dequantize_then_matmul(dtype, bias):
    """Catches a scale per tensor or per input channel (a row whose largest |q| is not 127), rounding
    toward zero (errors up to a whole scale, not half), a scale kept in float32 where the kernel takes
    dtype, a lost bias, and a zero row's scale of 0 (NaN from 0 / 0)."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=bias).to(dtype)
    with torch.no_grad():
        linear.weight[5] = 0
        linear.weight[7] *= 100  # one row much larger: a scale shared across rows would crush the others
    layer = Int8Linear(linear)
    weight = linear.weight.detach().float()
    assert layer.weight_int8.dtype == torch.int8 and layer.scale.dtype == dtype
    q = layer.weight_int8.int()
    assert (q.abs().amax(dim=1)[weight.abs().amax(dim=1) > 0] == 127).all() and (q[5] == 0).all()
    # rounding to the nearest step: no weight further than half a step from its dequantized value
    steps = layer.scale.float()[:, None]
    assert ((layer.dequantize() - weight).abs() <= steps / 2 * 1.01).all()
    for rows in (1, 5, DEQUANTIZE_ROWS + 3):  # a prompt's rows take the other route: converted q, then a matmul
        x = torch.randn(rows, 64).to(dtype)
        expected = x.float() @ layer.dequantize().T + (linear.bias.detach().float() if bias else 0)
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(layer(x).float(), expected, atol=tolerance * expected.abs().max(), rtol=tolerance)


@pytest.mark.parametrize("model", ["gqa", "tied", "mistral", "qwen2", "qwen3", "qwen3_tied"])
def test_engine_int8_matches_transformers_on_dequantized_weights(tiny_models, tmp_path, model):
    """Greedy tokens equal transformers' on the weights dequantized by hand. Catches a linear left
    unquantized or quantized by another rule (fused q/k/v or gate/up quantized as separate tensors are the
    same rows, so the same numbers), a tied lm_head left in float, and the embedding quantized too."""
    path = tiny_models[model]
    llm = LLM(path, quantization="int8", block_size=4)
    ours = llm.generate(PROMPTS, [greedy(n) for n in MAX_TOKENS], use_tqdm=False)
    expected = conftest.reference(save_dequantized(path, str(tmp_path / "dequantized")), PROMPTS, MAX_TOKENS)
    assert [o.token_ids for o in ours] == expected
    net = llm.engine.model_runner.model
    assert isinstance(net.lm_head, Int8Linear) and not any(isinstance(m, nn.Linear) for m in net.modules())
    assert net.model.embed_tokens.weight.dtype == torch.float32


def test_a_long_prompt_is_token_exact_on_the_converted_weights(tiny_models, tmp_path, monkeypatch):
    """A prompt of more than DEQUANTIZE_ROWS tokens is prefilled with q converted and multiplied whole, and
    decoded by the int8 kernel: still token-exact with transformers on the dequantized weights. Catches
    that route dropping the scale or the bias, or applying the scale per input channel."""
    rows = []
    kernel = torch.ops.aten._weight_int8pack_mm
    monkeypatch.setattr(torch.ops.aten, "_weight_int8pack_mm", lambda x, *rest: rows.append(len(x)) or kernel(x, *rest))
    prompt = [(7 * i) % 250 + 3 for i in range(DEQUANTIZE_ROWS + 40)]
    llm = LLM(tiny_models["qwen2"], quantization="int8", block_size=4)  # qwen2: q, k, v have biases
    rows.clear()  # what the load's check ran
    ours = llm.generate([prompt], greedy(10), use_tqdm=False)
    expected = conftest.reference(save_dequantized(tiny_models["qwen2"], str(tmp_path / "dq")), [prompt], [10])
    assert [o.token_ids for o in ours] == expected
    assert rows and max(rows) < DEQUANTIZE_ROWS  # the prompt's step took the other route, the decodes this one


def test_prompts_keep_the_kernel_where_bfloat16_is_emulated(monkeypatch):
    """A prompt's rows take the converted weight only where the CPU multiplies that dtype natively: held to
    AVX2, an emulated bfloat16 matmul took 2.9x the int8 kernel's time. Catches converting there too, by the
    attribute or by a forward that ignores it."""
    monkeypatch.setattr(quantization, "has_onednn", lambda dtype: False)  # as on an AVX2 CPU
    layer = Int8Linear(nn.Linear(64, 48).bfloat16())
    assert not layer.convert_prompts
    assert Int8Linear(nn.Linear(64, 48)).convert_prompts  # float32: MKL's, native everywhere
    rows = []
    kernel = torch.ops.aten._weight_int8pack_mm
    monkeypatch.setattr(torch.ops.aten, "_weight_int8pack_mm", lambda x, *rest: rows.append(len(x)) or kernel(x, *rest))
    layer(torch.randn(DEQUANTIZE_ROWS, 64, dtype=torch.bfloat16))
    assert rows == [DEQUANTIZE_ROWS]  # a prompt's rows, on the kernel


@pytest.mark.parametrize("model", ["gqa", "tied"])
def test_int8_logits_are_the_dequantized_models(tiny_models, tmp_path, model):
    """The same at the logits, which tokens alone may not show: close to transformers' on the dequantized
    weights and measurably apart from the float model's (so a layer left in float would fail)."""
    path = tiny_models[model]
    int8 = partial(quantize_linears, quantization="int8")  # the weight transform seam (seams.py)
    net = load_model(read_checkpoint(path), torch.float32, torch.device("cpu"), "torch", transform=int8)
    kv_cache = torch.zeros(2, net.num_layers, 16, 4, net.num_kv_heads, net.head_dim)
    with torch.inference_mode():
        ours = net(make_batch([PROMPT]), kv_cache)  # [n, vocab]
    dequantized = AutoModelForCausalLM.from_pretrained(save_dequantized(path, str(tmp_path / "dq")))
    torch.testing.assert_close(ours, reference_logits(dequantized, PROMPT), atol=1e-4, rtol=1e-4)
    original = reference_logits(AutoModelForCausalLM.from_pretrained(path), PROMPT)
    assert (ours - original).abs().max() > 1e-3


def test_compiled_int8_is_token_exact(tiny_models, tmp_path):
    """enforce_eager=False with int8: compiled (inductor times its int8 GEMM templates against the kernel) and still
    token-exact with transformers on the dequantized weights."""
    llm = LLM(tiny_models["gqa"], quantization="int8", enforce_eager=False, block_size=4)
    assert llm.engine.model_runner.compiled
    ours = llm.generate(PROMPTS, [greedy(n) for n in MAX_TOKENS], use_tqdm=False)
    expected = conftest.reference(save_dequantized(tiny_models["gqa"], str(tmp_path / "dq")), PROMPTS, MAX_TOKENS)
    assert [o.token_ids for o in ours] == expected


def test_tensor_parallel_int8_quantizes_each_shard(tiny_models, tmp_path):
    """TP=2 with int8 is token-exact with transformers on weights dequantized shard by shard: o_proj's and
    down_proj's rows split over the ranks, each half with its own scale. Catches quantizing the whole
    weight before it is split, or a rank's shard left in float."""
    path = tiny_models["gqa"]
    with LLM(path, tensor_parallel_size=2, quantization="int8", block_size=4) as llm:
        ours = llm.generate(PROMPTS, [greedy(n) for n in MAX_TOKENS], use_tqdm=False)
    expected = conftest.reference(save_dequantized(path, str(tmp_path / "dq"), row_parallel_parts=2), PROMPTS,
                                  MAX_TOKENS)
    assert [o.token_ids for o in ours] == expected


def test_bad_quantization_values_are_named(tiny_models):
    """Catches an unknown method accepted (and silently not applied), and a dtype the kernel refuses found
    only in the first step, as a RuntimeError that names no parameter."""
    for value in ("int3", "INT8", True):
        with pytest.raises(ValueError, match="quantization must be None, 'int8'"):
            Config(model=tiny_models["gqa"], quantization=value)
    linear = nn.Linear(16, 8).to(torch.float64)  # the kernel takes 16- and 32-bit floats only
    with pytest.raises(ValueError, match="quantization='int8' is not supported here.*float64"):
        check_kernel(Int8Linear(linear), linear.weight)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_linear_follows_the_rule_by_hand(dtype, group_size):
    """The layer's weight is the hand rule's, and its products are a matmul by it. Catches groups taken along
    the wrong dim, the zero point off by a step, a scale not rounded to dtype, and a bias dropped."""
    torch.manual_seed(0)
    linear = nn.Linear(128, 48).to(dtype)
    layer = Int4Linear(linear, group_size)
    # equal to float32's last bit or so (the kernel may fuse (q - 8) * scale + zero); a step here is ~5e-3
    expected = quantize_int4_by_hand(linear.weight.detach(), group_size)
    torch.testing.assert_close(layer.dequantize(), expected, rtol=0, atol=1e-7)
    for rows in (1, 7, DEQUANTIZE_ROWS + 3):
        x = torch.randn(rows, 128).to(dtype)
        expected = x.float() @ layer.dequantize().T + linear.bias.detach().float()
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(layer(x).float(), expected, atol=tolerance * expected.abs().max(), rtol=tolerance)


@pytest.mark.parametrize("model", ["gqa", "tied", "mistral", "qwen2", "qwen3"])
def test_engine_int4_matches_transformers_on_dequantized_weights(tiny_models, tmp_path, model):
    """Greedy tokens equal transformers' on weights dequantized by the int4 rule. Catches a linear left in
    float, a tied lm_head left in float, and the embedding quantized too."""
    path = tiny_models[model]
    llm = LLM(path, quantization="int4", block_size=4)
    ours = llm.generate(PROMPTS, [greedy(n) for n in MAX_TOKENS], use_tqdm=False)
    expected = conftest.reference(save_dequantized(path, str(tmp_path / "dq"), quantize=quantize_int4_by_hand),
                                  PROMPTS, MAX_TOKENS)
    assert [o.token_ids for o in ours] == expected
    net = llm.engine.model_runner.model
    assert isinstance(net.lm_head, Int4Linear) and not any(isinstance(m, nn.Linear) for m in net.modules())
    assert net.model.embed_tokens.weight.dtype == torch.float32


def test_int4_group_size_comes_from_quantization_config(tiny_models, tmp_path):
    """quantization_config={"group_size": 64} quantizes groups of 64, token-exact with the rule at 64. Catches
    the setting ignored (groups of 32 give other weights, so other logits and, here, other tokens)."""
    path = tiny_models["gqa"]
    llm = LLM(path, quantization="int4", quantization_config={"group_size": 64}, block_size=4)
    assert {m.group_size for m in llm.engine.model_runner.model.modules() if isinstance(m, Int4Linear)} == {64}
    ours = llm.generate(PROMPTS, [greedy(n) for n in MAX_TOKENS], use_tqdm=False)
    dequantized = save_dequantized(path, str(tmp_path / "dq"), quantize=partial(quantize_int4_by_hand, group_size=64))
    assert [o.token_ids for o in ours] == conftest.reference(dequantized, PROMPTS, MAX_TOKENS)


def test_bad_int4_settings_are_named(tiny_models):
    """A group size that is not 32, 64 or 128, a quantization_config without int4, and a layer whose inputs
    are not whole groups each get a ValueError naming the problem, not a kernel error mid-step."""
    path = tiny_models["gqa"]
    for settings in ({"quantization": "int4", "quantization_config": {"group_size": 16}},
                     {"quantization": "int8", "quantization_config": {"group_size": 32}},
                     {"quantization": "int4", "quantization_config": {"bits": 4}}):
        with pytest.raises(ValueError, match="quantization_config"):
            Config(model=path, **settings)
    with pytest.raises(ValueError, match=r"int4.*64 inputs must be a multiple of the group size 128"):
        LLM(path, quantization="int4", quantization_config={"group_size": 128})


def test_compiled_int8_prompt_step_does_not_recompile(tiny_models, tmp_path):
    """A compiled step of DEQUANTIZE_ROWS or more rows runs the graph traced at warm-up. Catches the row count
    tested before is_compiling(): tracing then guards on it, and the first long prompt recompiles."""
    from test_compilation import run_without_recompiles
    llm = LLM(tiny_models["gqa"], quantization="int8", enforce_eager=False, block_size=4)
    prompt = [(7 * i) % 250 + 3 for i in range(DEQUANTIZE_ROWS + 20)]
    ours = run_without_recompiles(llm, [prompt, PROMPTS[0]], [4, 4])
    dequantized = save_dequantized(tiny_models["gqa"], str(tmp_path / "dq"))
    assert ours == conftest.reference(dequantized, [prompt, PROMPTS[0]], [4, 4])
