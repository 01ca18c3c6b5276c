"""Sliding-window attention: a layer with a window of `w` tokens lets the query at position p see only the
keys at positions p - w + 1, ..., p (its own included), as transformers' sliding-window mask does. A layer
without a window (`None`) sees the whole context. The attention backends call these helpers per layer: the
step's plan is shared by every layer, and a model may mix windowed and global layers.
"""

import torch
from torch import Tensor
from transformers import PretrainedConfig


def window_bias(bias: Tensor, window: int) -> Tensor:
    """A decode group's bias `[R, 1, 1, L]` (0 for a key, -inf for the padding after it), with -inf also
    for the keys the window has passed. Row r's keys are its bias's finite entries, a prefix of
    seqlen_k entries; its one query, at position seqlen_k - 1, sees keys from seqlen_k - window on."""
    seqlens_k = bias.isfinite().sum(-1, keepdim=True)  # [R, 1, 1, 1]
    key_pos = torch.arange(bias.shape[-1], device=bias.device)
    return bias.masked_fill(key_pos < seqlens_k - window, float("-inf"))


def window_mask(seqlen_q: int, seqlen_k: int, window: int, device: torch.device) -> Tensor:
    """`[seqlen_q, seqlen_k]` bool, bottom-right causal and windowed: query i sits at position
    i + seqlen_k - seqlen_q and sees key j iff that position - window < j <= that position."""
    key_pos = torch.arange(seqlen_k, device=device)
    query_pos = torch.arange(seqlen_q, device=device)[:, None] + seqlen_k - seqlen_q
    return (key_pos <= query_pos) & (key_pos > query_pos - window)


def flash_window_size(window: int | None) -> tuple[int, int]:
    """flash-attn's `window_size=(left, right)`: a query sees the `left` keys before its own and `right` after
    it, -1 for all. A window of w keys, the query's own included, is (w - 1, 0); causal attention has right 0."""
    return (-1, -1) if window is None else (window - 1, 0)


def blocks_window(config: PretrainedConfig) -> int | None:
    """The window after which a block may be returned while its request runs (block_manager.py): the
    checkpoint's sliding window where every layer has it, else None. A layer of full attention (in
    config.json's `layer_types`) reads every key, so a model with one keeps every block."""
    if all(kind == "sliding_attention" for kind in getattr(config, "layer_types", None) or []):
        return getattr(config, "sliding_window", None)
    return None
