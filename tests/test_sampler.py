"""The sampler on its own, no model: SamplingParams checks, the exact kept sets of top-k and top-p,
the sampled distribution, greedy rows in a mixed batch, and seeded draws. Each test names the bug it
catches. Randomness is fixed (torch.manual_seed), and every bound is loose, so nothing can flake."""
import os
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest
import torch

from nanoserve.sampler import MIN_TEMPERATURE, SamplingParams, apply_min_p_top_k_top_p, sample


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


# --- top-k and top-p: exactly which tokens can be drawn ---------------------------------------------

PROBS = [0.125, 0.5, 0.03125, 0.25, 0.0625, 0.03125]  # by mass: ids 1, 3, 0, 4, then 2 and 5
ALL = set(range(len(PROBS)))
# (top_k, top_p, the ids that may be drawn). The mass before ids 1, 3, 0, 4 is 0, 0.5, 0.75, 0.875.
KEPT = [
    (0, 1.0, ALL), (-1, 1.0, ALL), (6, 1.0, ALL), (100, 1.0, ALL), (2**63, 1.0, ALL),
    (1, 1.0, {1}), (2, 1.0, {1, 3}), (4, 1.0, {0, 1, 3, 4}),
    (0, 5e-324, {1}), (0, 0.3, {1}), (0, 0.6, {1, 3}), (0, 0.8, {0, 1, 3}), (0, 0.9, {0, 1, 3, 4}),
    (2, 0.9, {1, 3}), (4, 0.6, {1, 3}), (1, 0.9, {1}), (3, 0.95, {0, 1, 3}),
]
# On the boundary, exact in binary: a token is kept only while the mass before it is < top_p.
BOUNDARY = [(0, 0.5, {1}), (0, 0.75, {1, 3}), (0, 0.875, {0, 1, 3}), (0, 0.5000001, {1, 3})]


@pytest.mark.parametrize("top_k, top_p, kept", KEPT + BOUNDARY)
def test_apply_min_p_top_k_top_p_keeps_exactly_the_set(top_k, top_p, kept):
    # Catches: sorting ascending (keeps the least likely), top_p never applied, <= instead of <,
    # a tiny top_p keeping nothing (then every draw is token 0), top_k beyond the vocabulary overflowing.
    probs = torch.tensor([PROBS])
    out = apply_min_p_top_k_top_p(probs, [SamplingParams(top_k=top_k, top_p=top_p)])[0]
    assert set(out.nonzero().flatten().tolist()) == kept
    assert torch.equal(out[sorted(kept)], probs[0, sorted(kept)])  # the kept ones untouched


@pytest.mark.parametrize("off, on, kept", [
    (SamplingParams(top_p=1.0), SamplingParams(top_p=0.6), {1, 3}),
    (SamplingParams(top_k=0), SamplingParams(top_k=2), {1, 3}),
    (SamplingParams(top_p=1.0, top_k=-1), SamplingParams(top_p=0.3), {1}),
])
def test_a_row_without_top_k_or_top_p_leaves_the_others_theirs(off, on, kept):
    # Catches: the top-k / top-p path skipped for the whole batch when any row has it off (top_p=1.0),
    # in apply_min_p_top_k_top_p and in sample() (2000 draws of each row).
    probs = torch.tensor([PROBS] * 2)
    out = apply_min_p_top_k_top_p(probs, [off, on])
    assert set(out[0].nonzero().flatten().tolist()) == ALL and set(out[1].nonzero().flatten().tolist()) == kept
    tokens = draw(torch.tensor(PROBS).log().repeat(4000, 1), [off, on] * 2000)
    assert set(tokens[1::2]) == kept and set(tokens[0::2]) == ALL


def test_apply_min_p_top_k_top_p_uses_each_rows_own_values():
    # Catches: one row's top_k or top_p applied to the whole batch (min/max instead of per row).
    probs = torch.tensor([PROBS] * len(KEPT))
    out = apply_min_p_top_k_top_p(probs, [SamplingParams(top_k=k, top_p=p) for k, p, _ in KEPT])
    assert [set(row.nonzero().flatten().tolist()) for row in out] == [kept for _, _, kept in KEPT]


def test_sampled_tokens_never_leave_the_kept_set():
    # Catches the same bugs through sample(): 2000 draws per case, all in one batch, hit exactly the
    # kept set (the least likely kept token has p >= 0.03, so it shows up in 2000 draws).
    rows = 2000
    logits = torch.tensor(PROBS).log().repeat(rows * len(KEPT), 1)             # [rows * cases, 6]
    params = [SamplingParams(top_k=k, top_p=p) for k, p, _ in KEPT for _ in range(rows)]
    tokens = torch.tensor(draw(logits, params)).view(len(KEPT), rows)
    assert [set(case.tolist()) for case in tokens] == [kept for _, _, kept in KEPT]


# --- the distribution ---------------------------------------------------------------------------

LOGITS = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, -1.0, -0.5, 0.3])


@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize("temperature, top_k", [(0.5, 0), (1.0, 0), (2.0, 0), (2.0, 3)])
def test_draws_follow_softmax_of_logits_over_temperature(temperature, top_k, seeded):
    # Catches: multiplying by the temperature instead of dividing, a biased draw, badly seeded noise.
    # 20k draws: a frequency's standard deviation is at most 0.0036, so 0.02 is > 5 of them.
    rows = 20_000
    params = [SamplingParams(temperature=temperature, top_k=top_k, seed=i if seeded else None) for i in range(rows)]
    tokens = torch.tensor(draw(LOGITS.repeat(rows, 1), params))
    scaled = LOGITS / temperature
    if top_k:
        scaled[scaled < scaled.topk(top_k).values[-1]] = -float("inf")
    expected = torch.softmax(scaled, dim=-1)
    observed = torch.bincount(tokens, minlength=len(LOGITS)) / rows
    assert (observed - expected).abs().max() < 0.02, (observed, expected)


# --- greedy rows --------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [0, 0.0, 1e-38, 5e-324, MIN_TEMPERATURE / 2])
def test_greedy_rows_give_the_argmax_even_beside_sampled_rows(temperature):
    # Catches: greedy rows sampled when the batch also has sampled rows, and a tiny temperature
    # overflowing float32 into a nan row whose "sample" is token 0.
    rows, vocab = 100, 1000
    logits = torch.randn(rows, vocab)
    logits[:, 0] = -10  # token 0 is never the argmax, so an overflowed row cannot pass by luck
    params = [SamplingParams(temperature=temperature) if i % 2 == 0 else SamplingParams(seed=i if i % 4 else None)
              for i in range(rows)]
    tokens = draw(logits, params)
    argmax = logits.argmax(dim=-1).tolist()
    assert tokens[0::2] == argmax[0::2]
    assert tokens[1::2] != argmax[1::2]  # the sampled rows really are sampled
    assert draw(logits[0::2], params[0::2]) == argmax[0::2]  # and an all-greedy batch


# --- seeded requests ----------------------------------------------------------------------------

FLAT = torch.zeros(1, 1000)  # every token equally likely: a token says a lot about the noise


def seeded_tokens(seed: int, count: int = 20) -> list[int]:
    return [draw(FLAT, [SamplingParams(seed=seed)], [n])[0] for n in range(count)]


def test_a_seeded_token_depends_only_on_seed_and_n():
    # Catches: noise taken from the batch's shared generator or tied to the row, so a seeded request
    # changes with its neighbours (and after a preemption puts it elsewhere in the batch).
    alone = seeded_tokens(7)
    for n in range(20):
        params = [SamplingParams(), SamplingParams(seed=9), SamplingParams(seed=7), SamplingParams(temperature=0)]
        in_batch = draw(FLAT.repeat(4, 1), params, [5, n, n, 0])
        assert in_batch[2] == alone[n]
    assert seeded_tokens(7) == alone


def test_a_seeded_request_draws_fresh_noise_for_each_token():
    # Catches: one noise draw reused for every token of a seeded request (on a flat distribution
    # that repeats one token forever).
    tokens = seeded_tokens(7, count=50)
    assert len(set(tokens)) > 25  # 50 draws from 1000 tokens: about 49 distinct


def test_seed_and_token_number_are_not_run_together():
    # Catches: the noise seed built from the digits of seed and n side by side (f"{seed}{n}"), so that
    # seed 1's token 23 draws the noise of seed 12's token 3.
    for (seed, n), (other, m) in [((1, 23), (12, 3)), ((12, 34), (123, 4)), ((2, 11), (21, 1)), ((1, 11), (11, 1))]:
        assert draw(FLAT, [SamplingParams(seed=seed)], [n]) != draw(FLAT, [SamplingParams(seed=other)], [m])


def test_a_seeded_request_leaves_the_shared_generator_alone():
    # Catches: a seeded row's noise drawn by reseeding torch's global generator instead of its own: the
    # unseeded requests sampled after it would repeat the same draws, step after step.
    unseeded = [draw(FLAT.repeat(2, 1), [SamplingParams(seed=7), SamplingParams()], [0, 0])[1] for _ in range(20)]
    assert len(set(unseeded)) > 10  # 20 draws from 1000 equally likely tokens: about 20 distinct
    torch.manual_seed(0)
    draw(FLAT.repeat(2, 1), [SamplingParams(seed=7), SamplingParams()], [0, 0])
    after_seeded = torch.rand(4)
    torch.manual_seed(0)
    draw(FLAT.repeat(2, 1), [SamplingParams(), SamplingParams()], [0, 0])
    assert torch.equal(after_seeded, torch.rand(4))  # the global generator moved as if no row were seeded


@pytest.mark.parametrize("seed, other", [(-1, -2), (5, 5 + 2**61 - 1), (0, 2**64), (1, -1), (2**200, -2**200)])
def test_different_seeds_give_different_tokens(seed, other):
    # Catches: seeding from Python's hash(), where hash(-1) == hash(-2) and ints 2**61 - 1 apart collide.
    assert seeded_tokens(seed) != seeded_tokens(other)


def test_seeded_tokens_are_the_same_in_another_process():
    # Catches: seeding from something that changes between processes (hash() of a str, id(), time).
    code = ("import torch; from nanoserve.sampler import SamplingParams, sample; "
            "print([sample(torch.zeros(1, 1000), [SamplingParams(seed=7)], [n])[0] for n in range(20)])")
    hash_seed = "2" if os.environ.get("PYTHONHASHSEED") == "1" else "1"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": root}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(seeded_tokens(7))
