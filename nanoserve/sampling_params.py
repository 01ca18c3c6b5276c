"""What a request asks of sampling and when it stops: SamplingParams, checked when made.

Every SamplingParams that can be made can be sampled with. A bad value is refused when the params are
made, with an InvalidRequest naming the field. It is never refused in the middle of a step, where it would
stall the whole batch. sampler.py samples with them. logits_processors.py applies the fields that change
the logits.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, replace


class GrammarSpec:
    """A grammar that a request's output follows. structured_outputs.py's StructuredOutputsParams is the one
    kind. It lives there, with the library that parses it. SamplingParams only checks its type."""


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
    structured_outputs: GrammarSpec | None = None  # a grammar the output follows: structured_outputs.py

    def __post_init__(self) -> None:
        t, p, k, m, stop, seed = (self.temperature, self.top_p, self.top_k, self.max_tokens,
                                  self.stop_token_ids, self.seed)
        require(is_finite_real(t) and t >= 0, "temperature", t, "a finite number >= 0")
        require(is_finite_real(p) and 0 < p <= 1, "top_p", p, "a number in (0, 1]")
        require(is_int(k) and k >= -1, "top_k", k, "an int >= -1 (0 and -1 mean off)")
        check_positive_int("max_tokens", m)
        check_bool("ignore_eos", self.ignore_eos)
        check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        require(stop is None or (isinstance(stop, (list, tuple)) and all(is_int(s) and s >= 0 for s in stop)),
                "stop_token_ids", stop, "None or a list of ints >= 0")
        require(seed is None or is_int(seed), "seed", seed, "an int or None")
        check_positive_int("n", self.n)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            require(value is None or (is_int(value) and 0 <= value <= MAX_LOGPROBS), name, value,
                    f"None or an int in [0, {MAX_LOGPROBS}]")
        strings = (self.stop,) if isinstance(self.stop, str) else self.stop
        ok = strings is None or isinstance(strings, (list, tuple)) and all(isinstance(s, str) and s for s in strings)
        require(ok, "stop", self.stop, "None, a non-empty str or a list of non-empty strs")
        check_processor_params(self)
        # Store plain Python values (a numpy scalar becomes a float or an int) and a tuple, so the
        # params hash like any frozen dataclass; frozen, so through object.__setattr__.
        plain = dict(temperature=float(t), top_p=float(p), top_k=int(k), max_tokens=int(m),
                     stop_token_ids=None if stop is None else tuple(int(s) for s in stop),
                     seed=None if seed is None else int(seed), stop=None if strings is None else tuple(strings))
        for name, value in plain.items():
            object.__setattr__(self, name, value)

    def for_sample(self, index: int) -> SamplingParams:
        """The params of sample `index` of n: one sample, seeded seed + index as in vLLM.
        So each has its own noise. Unseeded ones draw from the shared generator anyway."""
        return replace(self, n=1, seed=None if self.seed is None else self.seed + index)


class InvalidRequest(ValueError):
    """Bad input to one request, naming the parameter at fault (`param`: "temperature", "prompt", ...).
    So a server can say which field of its body was wrong without parsing the message."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def require(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise InvalidRequest(name, f"{name} must be {rule}, got {value!r}")


def check_positive_int(name: str, value: object) -> None:
    require(is_int(value) and value >= 1, name, value, "a positive int")


def check_bool(name: str, value: object) -> None:
    require(isinstance(value, bool), name, value, "True or False")


def is_int(value: object) -> bool:
    """Any integer type (numpy's too), but not bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_finite_real(value: object) -> bool:
    """Any real number type (numpy's float32 too), but not bool, nan, inf or an int beyond float."""
    try:
        return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def has_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1 or p.frequency_penalty != 0 or p.presence_penalty != 0


def uses_processors(p: SamplingParams) -> bool:
    """Does a request need the logits processors (extensions/logits_processors.py) to sample as it asks?"""
    return p.structured_outputs is not None or p.min_tokens > 0 or bool(p.logit_bias) or has_penalties(p)


def check_processor_params(p: SamplingParams) -> None:
    """SamplingParams' checks for the fields logits_processors.py applies (vLLM's bounds): ValueError naming
    the field."""
    require(is_finite_real(p.repetition_penalty) and p.repetition_penalty > 0, "repetition_penalty",
            p.repetition_penalty, "a number > 0 (1: off)")
    for name, low, high in (("frequency_penalty", -2, 2), ("presence_penalty", -2, 2), ("min_p", 0, 1)):
        value = getattr(p, name)
        require(is_finite_real(value) and low <= value <= high, name, value, f"a number in [{low}, {high}]")
    bias = p.logit_bias
    ok = bias is None or isinstance(bias, dict) and all(is_int(t) and t >= 0 and is_finite_real(b)
                                                        for t, b in bias.items())
    require(ok, "logit_bias", bias, "None or a dict of token id (an int >= 0) -> a finite number")
    require(is_int(p.min_tokens) and 0 <= p.min_tokens <= p.max_tokens, "min_tokens", p.min_tokens,
            f"an int in [0, max_tokens={p.max_tokens}]")
    require(p.structured_outputs is None or isinstance(p.structured_outputs, GrammarSpec),
            "structured_outputs", p.structured_outputs, "None or a StructuredOutputsParams")
