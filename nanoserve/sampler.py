"""Sampling: turn each request's last-token logits into its next token.

All rows are sampled together. Greedy rows take the argmax. The others go through temperature, min_p,
top-k and top-p, then one draw per row. A request with a `seed` draws its noise from its own generator.
So its tokens do not depend on which other requests share the batch.

Every SamplingParams (sampling_params.py) that can be made can be sampled with. A bad value is refused
when the params are made. It is never refused in the middle of a step, where it would stall the whole batch.
"""

import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor

# SamplingParams and its checks live in sampling_params.py; imported from here too, as before.
from nanoserve.sampling_params import MIN_TEMPERATURE, SamplingParams


@dataclass(frozen=True)
class Logprob:
    """A token's log-probability and its rank among all tokens (1: the most likely)."""
    logprob: float
    rank: int


# One position's logprobs, {token id: Logprob}: its own token first, then the most likely by rank (top_logprobs)
TokenLogprobs = dict[int, Logprob]


@dataclass(frozen=True)
class SamplerOutput:
    """One step's sampling, in batch order.
    - A token per request that sampled, with its logprobs (None where not asked for).
    - The prompt logprobs of the step's prompt-logprob rows."""
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    prompt_logprobs: list[TokenLogprobs]


def sample(logits: Tensor, params: list[SamplingParams], num_generated: list[int]) -> list[int]:
    """logits [S, vocab] float32, one row per request that samples now -> S token ids.
    `num_generated[row]` is how many tokens that request has sampled before this one."""
    greedy = logits.argmax(dim=-1)                                              # [S]
    is_greedy = [p.temperature < MIN_TEMPERATURE for p in params]
    if all(is_greedy):
        return greedy.tolist()
    # Greedy rows divide by 1: their draw is thrown away below, but must not overflow meanwhile.
    temperature = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, is_greedy)],
                               device=logits.device)                           # [S]
    probs = apply_min_p_top_k_top_p(torch.softmax(logits / temperature[:, None], dim=-1), params)
    # Gumbel-style draw: argmax(probs / Exp(1) noise) is a sample from probs. A seeded request's
    # noise for its n-th token comes from a generator seeded by (seed, n) alone. So its tokens are
    # the same in any batch, and after a preemption. The others share the global generator.
    noise = torch.empty_like(probs).exponential_()                              # [S, vocab]
    for row, (p, n) in enumerate(zip(params, num_generated)):
        if p.seed is not None:
            generator = torch.Generator().manual_seed(noise_seed(p.seed, n))  # on the CPU, any device
            noise[row] = torch.empty(probs.shape[1]).exponential_(generator=generator)
    # A draw of exactly 0 (possible on some devices) would make 0 / 0 = nan for a zeroed token.
    sampled = (probs / noise.clamp_(min=1e-30)).argmax(dim=-1)                  # [S]
    return torch.where(torch.tensor(is_greedy, device=logits.device), greedy, sampled).tolist()


def noise_seed(seed: int, n: int) -> int:
    """A 64-bit generator seed for a request's n-th token.

    It is a cryptographic hash, not Python's hash(). Python's maps -1 and -2 to the same value, and ints
    2**61 - 1 apart too. So two seeds would sample alike. sha256 is the same in every process and
    platform, and takes ints of any size."""
    return int.from_bytes(hashlib.sha256(f"{seed},{n}".encode()).digest()[:8], "little")


def apply_min_p_top_k_top_p(probs: Tensor, params: list[SamplingParams]) -> Tensor:
    """Zero the probabilities outside each row's min_p, top-k and top-p set; probs [S, vocab].
    They apply in vLLM's order: min_p, then top-k, then top-p on what is left. The kept ones are not
    renormalized: neither the top-p cut nor the draw in `sample` depends on a row's scale."""
    vocab = probs.shape[1]
    # A top_k beyond the vocabulary keeps everything (and would not fit a torch int64).
    top_k = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    if any(min_p):  # only then: it costs three passes over [S, vocab]
        min_p = torch.tensor(min_p, device=probs.device)[:, None]                      # [S, 1]
        probs = probs * (probs >= min_p * probs.amax(dim=-1, keepdim=True))            # the largest always stays
    if min(top_k) == vocab and min(top_p) == 1.0:  # no top-k or top-p in any row: nothing more to zero
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)       # [S, vocab]
    rank = torch.arange(vocab, device=probs.device)[None, :]
    k = torch.tensor(top_k, device=probs.device)[:, None]
    p = torch.tensor(top_p, device=probs.device)[:, None]
    sorted_probs = sorted_probs * (rank < k)
    # Keep a token if the mass before it is still below top_p of the mass that min_p and top-k left. (Top-p
    # applies to what they left, renormalized, as in vLLM.) The most likely token is kept by name.
    # A tiny top_p (5e-324) is 0 in float32, and "mass before < 0" would keep nothing.
    # That would leave an all-zero row, whose argmax is token 0.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep = (mass_before < p * sorted_probs.sum(dim=-1, keepdim=True)) | (rank == 0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs * keep)


def top_logprobs(logits: Tensor, token_ids: Tensor, num_top: list[int]) -> list[TokenLogprobs]:
    """Each row's token and its row's `num_top` most likely tokens, as {token id: Logprob}.
    The row's token comes first, then the others by rank. logits is [R, vocab] float32, as the model
    gave them. token_ids is [R]."""
    logprobs = torch.log_softmax(logits, dim=-1)                                  # [R, vocab]
    chosen = logprobs.gather(1, token_ids[:, None])[:, 0]                         # [R]
    ranks = (logprobs > chosen[:, None]).sum(dim=-1) + 1                          # [R]
    top = logprobs.topk(max(num_top, default=0), dim=-1)                          # [R, max N]
    rows = zip(token_ids.tolist(), chosen.tolist(), ranks.tolist(), top.indices.tolist(), top.values.tolist(), num_top)
    return [{token: Logprob(logprob, rank)} | {t: Logprob(v, r) for r, (t, v) in enumerate(zip(ids[:k], values[:k]), 1)}
            for token, logprob, rank, ids, values, k in rows]
