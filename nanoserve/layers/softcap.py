"""Soft-capping (Gemma 2): x becomes tanh(x / cap) * cap, which keeps x between -cap and cap and leaves small x
almost as they are. Gemma 2 caps its attention scores before the mask and softmax, and its final logits.
SDPA has no such step, so `attend_softcapped` writes attention out in plain PyTorch for the torch backend."""

import torch
from torch import Tensor


def softcap(x: Tensor, cap: float | None) -> Tensor:
    """x, capped where `cap` is not None."""
    return x if cap is None else torch.tanh(x / cap) * cap


def attend_softcapped(q: Tensor, k: Tensor, v: Tensor, scale: float, cap: float, mask: Tensor | None,
                      is_causal: bool) -> Tensor:
    """attention.attend with capped scores: q `[B, Sq, H, D]`, k, v `[B, L, Hkv, D]` -> `[B, Sq, H, D]`. `mask`
    is SDPA's: bool (True: the key is seen) or added to the scores; is_causal: query i sees keys 0..i."""
    k, v = (x.repeat_interleave(q.shape[2] // k.shape[2], dim=2) for x in (k, v))  # [B, L, H, D]: kv head per q head
    scores = softcap(torch.einsum("bqhd,bkhd->bhqk", q, k) * scale, cap)  # [B, H, Sq, L]
    if is_causal:
        mask = torch.ones_like(scores[0, 0], dtype=torch.bool).tril()  # [Sq, L]
    if mask is not None:  # bool: True where a key is seen; else added to the scores
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
