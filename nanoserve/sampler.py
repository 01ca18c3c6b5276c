"""Sampling: turn each request's last-token logits into its next token.

All rows are sampled together: greedy rows by argmax, the others by temperature, top-k and
top-p, then one draw per row. A request with a `seed` draws its noise from its own generator,
so its tokens do not depend on which other requests share the batch.
Every SamplingParams that can be made can be sampled with: a bad value is refused when the
params are made, never in the middle of a step where it would stall the whole batch.
"""
from __future__ import annotations

import hashlib
import math
import numbers
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from nanoserve.structured_outputs import StructuredOutputsParams

# Top logprobs per token, at most: OpenAI's limit, and vLLM's default max_logprobs.
MAX_LOGPROBS = 20
# Temperatures below this are greedy, as in vLLM: dividing logits by them overflows float32
# (1e-38 turns every row into inf/nan, and a nan row's argmax is token 0).
MIN_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled and when it stops (the names and defaults follow vLLM)."""
    temperature: float = 1.0       # 0, or anything below MIN_TEMPERATURE, means greedy
    top_k: int = 0                 # 0 or -1: off; more than the vocabulary: off too
    top_p: float = 1.0             # 1.0: off; the most likely token is always kept
    max_tokens: int = 16
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] | None = None   # a list is accepted and stored as a tuple
    seed: int | None = None        # any int
    # Stop strings: the text ends before the first one to appear (finish_reason "stop"); token_ids
    # keep the tokens up to and including the one that completed it. A str or list is stored as a tuple.
    stop: tuple[str, ...] | None = None
    # n completions of the prompt: LLM.generate and the server add n requests (`for_sample`), which
    # share the prompt's full KV blocks through the prefix cache, and its prompt logprobs (scheduler.py).
    n: int = 1
    # Logprobs, from the model's raw logits (before temperature, top-k and top-p: vLLM V1's choice).
    logprobs: int | None = None         # of each output token, with the N most likely (0 <= N <= 20)
    prompt_logprobs: int | None = None  # of each prompt token but the first, likewise (computed once per prompt)
    # What else changes the logits, as vLLM names it: logits_processors.py applies and checks these.
    repetition_penalty: float = 1.0  # > 0 (1: off), on prompt and output tokens: divides a positive logit
    frequency_penalty: float = 0.0   # in [-2, 2]: subtracted once per occurrence in the output
    presence_penalty: float = 0.0    # in [-2, 2]: subtracted once if in the output
    min_p: float = 0.0               # in [0, 1]: drop tokens less likely than min_p x the most likely one's
    logit_bias: dict[int, float] | None = field(default=None, hash=False)  # token id -> added to its logit
    min_tokens: int = 0              # no EOS, stop token or stop string before this many output tokens
    include_stop_str_in_output: bool = False  # the text keeps the stop string that ended it
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output follows: structured_outputs.py

    def __post_init__(self) -> None:
        t, p, k, m, stop, seed = (self.temperature, self.top_p, self.top_k, self.max_tokens,
                                  self.stop_token_ids, self.seed)
        require(is_finite_real(t) and t >= 0, "temperature", t, "a finite number >= 0")
        require(is_finite_real(p) and 0 < p <= 1, "top_p", p, "a number in (0, 1]")
        require(is_int(k) and k >= -1, "top_k", k, "an int >= -1 (0 and -1 mean off)")
        require(is_int(m) and m >= 1, "max_tokens", m, "an int >= 1")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            require(isinstance(getattr(self, name), bool), name, getattr(self, name), "a bool")
        require(stop is None or (isinstance(stop, (list, tuple)) and all(is_int(s) and s >= 0 for s in stop)),
                "stop_token_ids", stop, "None or a list of ints >= 0")
        require(seed is None or is_int(seed), "seed", seed, "an int or None")
        require(is_int(self.n) and self.n >= 1, "n", self.n, "an int >= 1")
        for name, value in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)):
            require(value is None or (is_int(value) and 0 <= value <= MAX_LOGPROBS), name, value,
                    f"None or an int in [0, {MAX_LOGPROBS}]")
        strings = (self.stop,) if isinstance(self.stop, str) else self.stop
        ok = strings is None or isinstance(strings, (list, tuple)) and all(isinstance(s, str) and s for s in strings)
        require(ok, "stop", self.stop, "None, a non-empty str or a list of non-empty strs")
        from nanoserve.logits_processors import check_params  # here: logits_processors imports this module
        check_params(self)
        # Store plain Python values (a numpy scalar becomes a float or an int) and a tuple, so the
        # params hash like any frozen dataclass; frozen, so through object.__setattr__.
        plain = dict(temperature=float(t), top_p=float(p), top_k=int(k), max_tokens=int(m),
                     stop_token_ids=None if stop is None else tuple(int(s) for s in stop),
                     seed=None if seed is None else int(seed), stop=None if strings is None else tuple(strings))
        for name, value in plain.items():
            object.__setattr__(self, name, value)

    def for_sample(self, index: int) -> SamplingParams:
        """The params of sample `index` of n: one sample, seeded seed + index as in vLLM (each its own
        noise; unseeded ones draw from the shared generator anyway)."""
        return replace(self, n=1, seed=None if self.seed is None else self.seed + index)


@dataclass(frozen=True)
class SamplerOutput:
    """One step's sampling: a token per request that sampled, in batch order, with its logprobs (None
    where not asked for), and the prompt logprobs of the step's prompt-logprob rows, in batch order."""
    token_ids: list[int]
    logprobs: list[dict[int, Logprob] | None]
    prompt_logprobs: list[dict[int, Logprob]]


@dataclass(frozen=True)
class Logprob:
    """A token's log-probability and its rank among all tokens (1: the most likely)."""
    logprob: float
    rank: int


class InvalidRequest(ValueError):
    """Bad input to one request, naming the parameter at fault (`param`: "temperature", "prompt", ...),
    so that a server can say which field of its body was wrong without parsing the message."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def require(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise InvalidRequest(name, f"{name} must be {rule}, got {value!r}")


def is_int(value: object) -> bool:
    """Any integer type (numpy's too), but not bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_finite_real(value: object) -> bool:
    """Any real number type (numpy's float32 too), but not bool, nan, inf or an int beyond float."""
    try:
        return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def sample(logits: torch.Tensor, params: list[SamplingParams], num_generated: list[int]) -> list[int]:
    """logits [S, vocab] float32, one row per request that samples now -> S token ids.
    `num_generated[row]` is how many tokens that request has sampled before this one."""
    greedy = logits.argmax(dim=-1)                                              # [S]
    is_greedy = [p.temperature < MIN_TEMPERATURE for p in params]
    if all(is_greedy):
        return greedy.tolist()
    # Greedy rows divide by 1: their draw is thrown away below, but must not overflow meanwhile.
    temperature = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, is_greedy)],
                               device=logits.device)                           # [S]
    probs = apply_top_k_top_p(apply_min_p(torch.softmax(logits / temperature[:, None], dim=-1), params), params)
    # Gumbel-style draw: argmax(probs / Exp(1) noise) is a sample from probs. A seeded request's
    # noise for its n-th token comes from a generator seeded by (seed, n) alone, so its tokens are
    # the same in any batch, and after a preemption; the others share the global generator.
    noise = torch.empty_like(probs).exponential_()                              # [S, vocab]
    for row, (p, n) in enumerate(zip(params, num_generated)):
        if p.seed is not None:
            generator = torch.Generator().manual_seed(noise_seed(p.seed, n))  # on the CPU, any device
            noise[row] = torch.empty(probs.shape[1]).exponential_(generator=generator)
    # A draw of exactly 0 (possible on some devices) would make 0 / 0 = nan for a zeroed token.
    sampled = (probs / noise.clamp_(min=1e-30)).argmax(dim=-1)                  # [S]
    return torch.where(torch.tensor(is_greedy, device=logits.device), greedy, sampled).tolist()


def noise_seed(seed: int, n: int) -> int:
    """A 64-bit generator seed for a request's n-th token. A cryptographic hash, not Python's hash():
    that one maps -1 and -2 (and ints 2**61 - 1 apart) to the same value, so two seeds would sample
    alike. sha256 is the same in every process and platform and takes ints of any size."""
    return int.from_bytes(hashlib.sha256(f"{seed},{n}".encode()).digest()[:8], "little")


def apply_min_p(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Zero the probabilities below min_p x their row's largest, and renormalize (vLLM applies min_p before
    top-k and top-p); probs [S, vocab]."""
    if not any(p.min_p for p in params):
        return probs
    min_p = torch.tensor([p.min_p for p in params], device=probs.device)[:, None]      # [S, 1]
    probs = probs * (probs >= min_p * probs.amax(dim=-1, keepdim=True))                # the largest always stays
    return probs / probs.sum(dim=-1, keepdim=True)


def apply_top_k_top_p(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Zero the probabilities outside each row's top-k and top-p set; probs [S, vocab]."""
    # A top_k beyond the vocabulary keeps everything (and would not fit a torch int64).
    top_k = [min(p.top_k, probs.shape[1]) if p.top_k > 0 else probs.shape[1] for p in params]
    top_p = [p.top_p for p in params]
    if min(top_k) == probs.shape[1] and min(top_p) == 1.0:  # every row off: nothing to zero
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)       # [S, vocab]
    rank = torch.arange(probs.shape[1], device=probs.device)[None, :]
    k = torch.tensor(top_k, device=probs.device)[:, None]
    p = torch.tensor(top_p, device=probs.device)[:, None]
    # Keep a token if it is among the top k and the mass before it is still below top_p of the top k's
    # mass (top-p applies to the top k renormalized, as in vLLM and transformers). The most likely token
    # is kept by name: a tiny top_p (5e-324) is 0 in float32, and "mass before < 0" would keep nothing,
    # leaving an all-zero row whose argmax is token 0.
    sorted_probs = sorted_probs * (rank < k)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    keep = (mass_before < p * sorted_probs.sum(dim=-1, keepdim=True)) | (rank == 0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs * keep)


def top_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]) -> list[dict[int, Logprob]]:
    """Each row's token and its row's `num_top` most likely tokens, {token id: Logprob}: the row's
    token first, then the others by rank. logits [R, vocab] float32 as the model gave them, token_ids [R]."""
    logprobs = torch.log_softmax(logits, dim=-1)                                  # [R, vocab]
    chosen = logprobs.gather(1, token_ids[:, None])[:, 0]                         # [R]
    ranks = (logprobs > chosen[:, None]).sum(dim=-1) + 1                          # [R]
    top = logprobs.topk(max(num_top, default=0), dim=-1)                          # [R, max N]
    rows = zip(token_ids.tolist(), chosen.tolist(), ranks.tolist(), top.indices.tolist(), top.values.tolist(), num_top)
    return [{token: Logprob(logprob, rank)} | {t: Logprob(v, r) for r, (t, v) in enumerate(zip(ids[:k], values[:k]), 1)}
            for token, logprob, rank, ids, values, k in rows]
