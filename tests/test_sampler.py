"""The sampler on its own, no model: SamplingParams checks, the exact kept sets of top-k and top-p,
the sampled distribution, greedy rows in a mixed batch, and seeded draws. Each test names the bug it
catches. Randomness is fixed (torch.manual_seed), and every bound is loose, so nothing can flake."""
from fractions import Fraction

import numpy as np
import pytest
import torch

from nanoserve.sampler import SamplingParams, sample


@pytest.fixture(autouse=True)
def fixed_torch_seed():
    torch.manual_seed(0)


def draw(logits: torch.Tensor, params: list[SamplingParams], num_generated: list[int] | None = None) -> list[int]:
    return sample(logits, params, num_generated or [0] * len(params))


# --- SamplingParams: refused when made, or servable ---------------------------------------------

@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=float("nan")), "temperature"), (dict(temperature=float("inf")), "temperature"),
    (dict(temperature=-1), "temperature"), (dict(temperature=10**400), "temperature"),
    (dict(temperature="1"), "temperature"), (dict(temperature=True), "temperature"),
    (dict(temperature=np.float32("nan")), "temperature"),
    (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_p=float("nan")), "top_p"),
    (dict(top_p=True), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(top_k=1.5), "top_k"), (dict(top_k=True), "top_k"),
    (dict(top_k=np.float64(3)), "top_k"),
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=2.5), "max_tokens"), (dict(max_tokens=True), "max_tokens"),
    (dict(ignore_eos="no"), "ignore_eos"), (dict(ignore_eos=1), "ignore_eos"), (dict(ignore_eos=None), "ignore_eos"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(stop_token_ids=[1.5]), "stop_token_ids"),
    (dict(stop_token_ids=[True]), "stop_token_ids"), (dict(stop_token_ids="12"), "stop_token_ids"),
    (dict(stop_token_ids=3), "stop_token_ids"),
    (dict(seed="1"), "seed"), (dict(seed=1.5), "seed"), (dict(seed=True), "seed"),
])
def test_bad_values_are_refused_naming_the_field_and_value(kwargs, field):
    # Catches: a field left unchecked (ignore_eos="no", negative stop ids, inf), or a vague message.
    with pytest.raises(ValueError, match=field) as error:
        SamplingParams(**kwargs)
    assert repr(kwargs[field]) in str(error.value)


@pytest.mark.parametrize("field, given, stored", [
    ("temperature", np.float32(0.5), 0.5), ("temperature", np.float64(0.5), 0.5),
    ("temperature", Fraction(1, 2), 0.5), ("temperature", 2, 2.0), ("temperature", 2**63, float(2**63)),
    ("top_p", np.float32(0.5), 0.5), ("top_k", np.int64(3), 3), ("top_k", 2**63, 2**63),
    ("max_tokens", np.int32(4), 4), ("seed", np.int64(-5), -5), ("seed", 2**200, 2**200),
    ("stop_token_ids", [2, np.int64(3)], (2, 3)), ("stop_token_ids", (2,), (2,)),
])
def test_any_real_or_integral_type_is_accepted_and_stored_as_plain_python(field, given, stored):
    # Catches: np.float32 refused while np.float64 passes; numpy scalars or lists kept as given.
    params = SamplingParams(**{field: given})
    assert getattr(params, field) == stored and type(getattr(params, field)) is type(stored)


def test_params_hash_and_compare_like_a_frozen_dataclass():
    # Catches: stop_token_ids kept as a list, so hash() of a frozen SamplingParams raises.
    assert hash(SamplingParams(stop_token_ids=[2])) == hash(SamplingParams(stop_token_ids=(2,)))
    assert SamplingParams(stop_token_ids=[2]) == SamplingParams(stop_token_ids=(2,))


@pytest.mark.parametrize("kwargs", [
    dict(top_k=2**63), dict(temperature=2**63), dict(temperature=1e300), dict(temperature=1e-38),
    dict(temperature=5e-324), dict(top_p=5e-324), dict(seed=-2**200), dict(seed=2**200),
])
def test_every_accepted_value_can_be_sampled_with(kwargs):
    # Catches: values that pass the checks but overflow every step (top_k=2**63: "Overflow when
    # unpacking long long"), stalling every request in the batch.
    logits = torch.randn(4, 50)
    params = SamplingParams(**kwargs)
    for batch in ([params] * 4, [params, SamplingParams(), SamplingParams(temperature=0), SamplingParams(seed=3)]):
        assert all(0 <= t < 50 for t in draw(logits, batch))
