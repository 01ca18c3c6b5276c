"""Rotary position embedding (RoPE). Each pair of dims of q and k is rotated by an angle proportional
to the token's position. So q . k depends only on how far apart the two tokens are.

Hugging Face's "rotate_half" layout: dim j pairs with dim j + D/2. The angles come from the
checkpoint's `rope_parameters` (config.json): rope_type "default", or "llama3" (Llama 3.1's
long-context scaling). Angles are computed in float32 from each token's own position, every step.
"""

import torch
from torch import Tensor, nn


def compute_inv_freq(params: dict, head_dim: int) -> Tensor:
    """One rotation frequency per pair of dims, `[head_dim // 2]`, for rope_type default or llama3."""
    rope_type = params.get("rope_type", "default")
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"unsupported rope_type {rope_type!r}: nanoserve implements 'default' and 'llama3'")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor != 1.0 is not supported")
    exponents = torch.arange(0, head_dim, 2, device="cpu") / head_dim  # float32: true division of int64
    inv_freq = 1.0 / (params["rope_theta"] ** exponents)  # [head_dim // 2]
    return inv_freq if rope_type == "default" else scale_llama3(inv_freq, params)


def scale_llama3(inv_freq: Tensor, params: dict) -> Tensor:
    """Llama 3.1's long-context RoPE: slow down low frequencies by `factor`, keep high ones.

    - Wavelengths shorter than `original_max_position_embeddings / high_freq_factor` are kept.
      They carry local detail.
    - Those longer than `original / low_freq_factor` are stretched by `factor`. They carry position over
      the whole context. Stretched, the longer context maps onto angles seen in training.
    - In between, the two are blended linearly in `original / wavelength`.
    """
    factor, low, high = params["factor"], params["low_freq_factor"], params["high_freq_factor"]
    original = params["original_max_position_embeddings"]
    wavelen = 2 * torch.pi / inv_freq
    # smooth is 1 at the high-frequency edge (keep) and 0 at the low-frequency edge (scale)
    smooth = ((original / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


class RotaryEmbedding(nn.Module):
    """cos/sin of each token's rotation angles, from its position, every step. That is N x D/2 products.
    It is cheaper than a table for all max_position_embeddings positions (131k for Llama 3.1)."""

    def __init__(self, head_dim: int, rope_parameters: dict):
        super().__init__()
        # Built on CPU explicitly (the model is built on the meta device, see models/loader.py) and
        # kept float32: angles at large positions need the precision.
        self.register_buffer("inv_freq", compute_inv_freq(rope_parameters, head_dim), persistent=False)  # [D/2]

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = positions[:, None, None].float() * self.inv_freq  # [N, 1, D/2]: the 1 broadcasts over heads
        cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)  # cast like HF does: q * cos runs in the model's dtype
        # HF's "rotate_half" layout: dim j pairs with dim j + D/2, so both halves share a frequency: cos is
        # [cos, cos], sin comes signed, [-sin, sin], for `apply_rope`. [N, 1, D] each.
        return cos.repeat(1, 1, 2), torch.cat((-sin, sin), -1)


def apply_rope(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
    """Rotate each (j, j + D/2) pair of `x` `[N, heads, D]` by its token's angle (`[N, 1, D]` each).
    HF computes x * cos + cat(-x2, x1) * sin. Here roll(x, D/2) * [-sin, sin] gives the same products, bit
    for bit, since a sign flip is exact. It is one op per layer instead of chunk, neg and cat."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin
