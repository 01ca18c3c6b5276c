"""Sampling: turn each request's last-token logits into its next token.

All rows are sampled together: greedy rows by argmax, the others by temperature, top-k and
top-p, then one draw per row. A request with a `seed` draws its noise from its own generator,
so its tokens do not depend on which other requests share the batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled and when it stops (the names and defaults follow vLLM)."""
    temperature: float = 1.0       # 0 means greedy
    top_k: int = 0                 # 0 or -1: off
    top_p: float = 1.0             # 1.0: off
    max_tokens: int = 16
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if not is_number(self.temperature) or not self.temperature >= 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= -1 (0 and -1 mean off), got {self.top_k!r}")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.seed is not None and not is_int(self.seed):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if self.stop_token_ids is not None and not (isinstance(self.stop_token_ids, (list, tuple))
                                                     and all(is_int(t) for t in self.stop_token_ids)):
            raise ValueError(f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r}")


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def sample(logits: torch.Tensor, params: list[SamplingParams], num_generated: list[int]) -> list[int]:
    """logits [S, vocab] float32, one row per request that samples now -> S token ids.
    `num_generated[row]` is how many tokens that request has sampled before this one."""
    greedy = logits.argmax(dim=-1)
    if all(p.temperature == 0 for p in params):
        return greedy.tolist()
    temperature = torch.tensor([p.temperature or 1.0 for p in params], device=logits.device)
    probs = apply_top_k_top_p(torch.softmax(logits / temperature[:, None], dim=-1), params)
    # Gumbel-style draw: argmax(probs / Exp(1) noise) is a sample from probs. A seeded request's
    # noise for its n-th token comes from a generator seeded by (seed, n) alone, so its tokens are
    # the same in any batch, and after a preemption; the others share the global generator.
    noise = torch.empty_like(probs).exponential_()
    for row, (p, n) in enumerate(zip(params, num_generated)):
        if p.seed is not None:
            generator = torch.Generator().manual_seed(hash((p.seed, n)) % 2**63)  # on the CPU, any device
            noise[row] = torch.empty(probs.shape[1]).exponential_(generator=generator)
    sampled = (probs / noise).argmax(dim=-1)
    is_greedy = torch.tensor([p.temperature == 0 for p in params], device=logits.device)
    return torch.where(is_greedy, greedy, sampled).tolist()


def apply_top_k_top_p(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Zero the probabilities outside each row's top-k and top-p set; probs [S, vocab]."""
    top_k = [p.top_k if p.top_k > 0 else probs.shape[1] for p in params]
    top_p = [p.top_p for p in params]
    if max(top_k) == probs.shape[1] and min(top_k) == probs.shape[1] and min(top_p) == 1.0:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)       # [S, vocab]
    rank = torch.arange(probs.shape[1], device=probs.device)[None, :]
    k = torch.tensor(top_k, device=probs.device)[:, None]
    p = torch.tensor(top_p, device=probs.device)[:, None]
    # Keep a token if it is among the top k and the mass before it is still below top_p,
    # so the most likely token is always kept.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep = (rank < k) & (mass_before < p)
    sorted_probs = sorted_probs * keep
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
