"""What each model family differs in from Llama, as data. There is one frozen `Family` per checkpoint.
`describe` reads it from config.json once, and it is passed to the model as one object.

`MODELS` names the architectures nanoserve runs (config.json's `architectures`). It says what each one
always differs in. `describe` adds what the checkpoint's config.json says: head_dim, tied head, RoPE,
sliding window.

A family that differs from Llama only in these fields is one row in `MODELS`. A new kind of difference is
a new field here, read where llama.py builds the layer it changes (docs/models.md, "Adding a family").
"""

from dataclasses import dataclass, field, replace
from functools import partial

from torch.nn.functional import gelu, silu
from transformers import PretrainedConfig

from nanoserve.layers.layernorm import GemmaRMSNorm, RMSNorm
from nanoserve.models import get_head_dim

# The MLP's activation (`LlamaMLP`) of each `hidden_act` a MODELS row names, computed as transformers computes it
ACTIVATIONS = {"silu": silu, "gelu_pytorch_tanh": partial(gelu, approximate="tanh")}


@dataclass(frozen=True)
class Family:
    """A MODELS row sets the fields that are the same for every checkpoint of the architecture.
    They are architecture, qkv_bias, qk_norm, scale_embeddings, norm, hidden_act and sandwich_norms. `describe`
    fills in the rest from one checkpoint's config.json."""
    architecture: str  # config.json's `architectures` entry, e.g. "Qwen3ForCausalLM"
    qkv_bias: bool = False  # q, k and v projections have a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and of k, before RoPE (Qwen3)
    head_dim: int = 0  # each attention head's size (`get_head_dim`)
    tie_word_embeddings: bool = False  # lm_head is the embedding matrix (not stored in the checkpoint)
    # rope_type ("default" or "llama3"), rope_theta and llama3's scaling (layers/rotary_embedding.py).
    # Gemma 3's config.json holds one per layer type: this is its full-attention layers' (llama.py reads each).
    rope_parameters: dict = field(default_factory=dict, hash=False)
    sliding_window: int | None = None  # attention sees only the last this-many tokens; None: the whole context
    # Gemma's differences
    scale_embeddings: bool = False  # the embeddings are multiplied by sqrt(hidden_size)
    norm: type[RMSNorm] = RMSNorm  # every norm's class, q/k norm included: Gemma's scales by 1 + weight
    hidden_act: str = "silu"  # the MLP's activation (in ACTIVATIONS), which config.json must name
    sandwich_norms: bool = False  # a norm after attention and after the MLP too, and one before the MLP (Gemma 2, 3)
    layer_types: tuple[str, ...] = ()  # "sliding_attention" or "full_attention" per layer; () where config has none
    query_pre_attn_scalar: float | None = None  # the attention scale is its -1/2 power (else head_dim's)
    attn_logit_softcapping: float | None = None  # attention scores become tanh(scores / cap) * cap
    final_logit_softcapping: float | None = None  # the logits likewise

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer`, or None where it sees the whole context (a "full_attention"
        layer). Without layer_types, every layer has the model's sliding_window."""
        if self.layer_types and self.layer_types[layer] != "sliding_attention":
            return None
        return self.sliding_window


# What every Gemma differs in. RMSNorm scales by (1 + weight), in float32 (layers/layernorm.py), q/k norm
# included. The MLP is GeGLU: gelu with the tanh approximation where Llama has silu. The embeddings are
# multiplied by sqrt(hidden_size). Gemma 2 and 3 add sandwich norms, and scale attention by
# query_pre_attn_scalar ** -0.5. Gemma 2 soft-caps its scores and its logits: x becomes tanh(x / cap) * cap
# (layers/softcap.py). Gemma 2's and 3's layer_types mix sliding-window layers with full ones. Gemma 3 has
# q/k norm, and its own RoPE per layer type.
GEMMA = dict(scale_embeddings=True, norm=GemmaRMSNorm, hidden_act="gelu_pytorch_tanh")
# The architectures nanoserve runs, as in vLLM's registry: all are Llama's layers, with these differences.
MODELS: dict[str, Family] = {
    "LlamaForCausalLM": Family("LlamaForCausalLM"),
    "MistralForCausalLM": Family("MistralForCausalLM"),  # a sliding window, if any, is `describe`'s
    "Qwen2ForCausalLM": Family("Qwen2ForCausalLM", qkv_bias=True),
    "Qwen3ForCausalLM": Family("Qwen3ForCausalLM", qk_norm=True),
    "GemmaForCausalLM": Family("GemmaForCausalLM", **GEMMA),
    "Gemma2ForCausalLM": Family("Gemma2ForCausalLM", sandwich_norms=True, **GEMMA),
    "Gemma3ForCausalLM": Family("Gemma3ForCausalLM", qk_norm=True, sandwich_norms=True, **GEMMA),
}


def describe(config: PretrainedConfig) -> Family:
    """The Family of a checkpoint: its architecture's row in MODELS, completed from its config.json.
    A ValueError names the supported architectures if its own is not one of them."""
    architectures = config.architectures or []  # PretrainedConfig always has it (None by default)
    known = [name for name in architectures if name in MODELS]
    if not known:
        raise ValueError(f"unsupported architectures {architectures} (model_type {config.model_type!r}): "
                         f"nanoserve runs {', '.join(MODELS)}")
    family = MODELS[known[0]]
    hidden_act = getattr(config, "hidden_activation", None) or config.hidden_act  # Gemma 2 and 3 name it so
    if hidden_act != family.hidden_act:
        raise ValueError(f"unsupported hidden_act {hidden_act!r}: nanoserve's {family.architecture} runs "
                         f"{family.hidden_act!r}")
    # Gemma 2's and 3's soft-capping may be None
    gemma = {name: getattr(config, name, None)
             for name in ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping")}
    if family.architecture == "Gemma3ForCausalLM":  # transformers' Gemma 3 never caps attention scores
        gemma["attn_logit_softcapping"] = None
    rope = config.rope_parameters  # Gemma 3's map a layer type to its own
    # Qwen2's and Qwen3's configs set sliding_window to None where use_sliding_window is false
    return replace(family, head_dim=get_head_dim(config),
                   tie_word_embeddings=config.tie_word_embeddings,
                   rope_parameters=dict(rope.get("full_attention", rope)),
                   sliding_window=getattr(config, "sliding_window", None),
                   layer_types=tuple(getattr(config, "layer_types", None) or ()), **gemma)


def check_max_model_len(config: PretrainedConfig, max_model_len: int) -> None:
    """Refuse a context longer than the checkpoint's positions. A sliding window shorter than the context
    is fine. Attention then sees only the window's keys (sliding_window.py)."""
    if max_model_len > config.max_position_embeddings:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                         f"max_position_embeddings={config.max_position_embeddings}")
