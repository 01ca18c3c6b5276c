"""The penalties, min_p, logit_bias, min_tokens and include_stop_str_in_output (logits_processors.py, sampler.py),
against transformers where it has the same thing, else against a small reference loop."""
import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from nanoserve import DEFAULT_MODEL, LLM, SamplingParams
from nanoserve.extensions.logits_processors import process_logits
from nanoserve.sampler import apply_min_p_top_k_top_p
from nanoserve.sequence import Sequence

PROMPTS = [[1, 5, 9, 13, 200, 7], [1, 77, 78, 79], [1, 3, 3, 3, 3, 3, 3, 250]]


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["gqa"], block_size=4)


def greedy_with(llm, max_tokens=12, prompts=PROMPTS, **kwargs):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_is_token_exact_with_transformers_generate(llm, tiny_models, penalty):
    # Catches: penalizing only the output (the prompt counts too), or the same direction for negative logits
    model = AutoModelForCausalLM.from_pretrained(tiny_models["gqa"], dtype=torch.float32).eval()
    expected = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12,
                             repetition_penalty=penalty, pad_token_id=0, eos_token_id=None)
        expected.append(out[0, len(prompt):].tolist())
    got = greedy_with(llm, repetition_penalty=penalty)
    assert got == expected
    assert got != greedy_with(llm)  # the penalty changed something


@pytest.mark.parametrize("frequency, presence", [(1.5, 0.0), (0.0, 1.5), (0.8, -0.5)])
def test_frequency_and_presence_penalties_match_a_reference_loop(llm, tiny_models, frequency, presence):
    # Catches: counting prompt tokens, presence scaled by the count, frequency not scaled by it
    model = AutoModelForCausalLM.from_pretrained(tiny_models["gqa"], dtype=torch.float32).eval()
    expected = []
    for prompt in PROMPTS:
        tokens = list(prompt)
        with torch.no_grad():
            for _ in range(12):
                logits = model(torch.tensor([tokens])).logits[0, -1]
                counts = torch.bincount(torch.tensor(tokens[len(prompt):], dtype=torch.long),
                                        minlength=logits.shape[0]).float()
                tokens.append(int((logits - frequency * counts - presence * (counts > 0)).argmax()))
        expected.append(tokens[len(prompt):])
    got = greedy_with(llm, frequency_penalty=frequency, presence_penalty=presence)
    assert got == expected
    assert got != greedy_with(llm)


def test_penalties_follow_their_formulas_row_by_row():
    # On logits of both signs (a model's argmax rarely meets a negative one). Catches: a negative logit divided
    # by the repetition penalty (it would get more likely), prompt tokens counted by frequency or presence,
    # presence scaled by the count, one row's penalties on another row.
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(0)) * 2
    kinds = [dict(repetition_penalty=1.5), dict(frequency_penalty=1.0, presence_penalty=0.5), dict()]
    seqs = [Sequence(str(i), None, [3, 3, 4, 7], SamplingParams(**kind)) for i, kind in enumerate(kinds)]
    for seq in seqs:
        for token in [4, 5, 5, 8]:
            seq.append_token(token)
    processed = process_logits(logits, seqs, set())
    history = torch.tensor([seqs[0].token_ids])
    torch.testing.assert_close(processed[0:1], RepetitionPenaltyLogitsProcessor(1.5)(history, logits[0:1].clone()))
    counts = torch.bincount(torch.tensor([4, 5, 5, 8]), minlength=10).float()
    torch.testing.assert_close(processed[1], logits[1] - 1.0 * counts - 0.5 * (counts > 0))
    assert torch.equal(processed[2], logits[2])


@pytest.mark.parametrize("min_p", [0.05, 0.3, 0.9, 1.0])
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (5, 1.0), (0, 0.5), (20, 0.8)])
def test_min_p_keeps_what_transformers_min_p_warper_keeps(min_p, temperature, top_k, top_p):
    # Catches: min_p against another row's largest, or dropping the largest itself; min_p after top-k or
    # top-p (vLLM applies it first); top-p measured against the mass that min_p dropped too.
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(0)) * 3 / temperature
    params = [SamplingParams(min_p=min_p, top_k=top_k, top_p=top_p, temperature=temperature)] * 6
    probs = apply_min_p_top_k_top_p(torch.softmax(logits, dim=-1), params)
    warped = MinPLogitsWarper(min_p)(None, logits)  # then top-k and top-p on what it left, in vLLM's order
    if top_k:
        warped = TopKLogitsWarper(top_k)(None, warped)
    if top_p < 1:
        warped = TopPLogitsWarper(top_p)(None, warped)
    assert torch.equal(probs > 0, warped.isfinite())


@pytest.mark.parametrize("top_k, top_p", [(5, 1.0), (0, 0.5), (20, 0.8), (0, 0.95)])
def test_top_k_top_p_keep_what_transformers_warpers_keep(top_k, top_p):
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(1)) * 3
    probs = apply_min_p_top_k_top_p(torch.softmax(logits, dim=-1), [SamplingParams(top_k=top_k, top_p=top_p)] * 6)
    warped = logits
    if top_k:
        warped = TopKLogitsWarper(top_k)(None, warped)
    if top_p < 1:
        warped = TopPLogitsWarper(top_p)(None, warped)
    assert torch.equal(probs > 0, warped.isfinite())


def test_logit_bias_forces_and_bans_a_token(llm):
    plain = greedy_with(llm)
    forced = greedy_with(llm, logit_bias={42: 100.0})
    assert forced == [[42] * 12] * len(PROMPTS)
    favourite = plain[0][0]  # banned: it never comes, in any request
    banned = greedy_with(llm, logit_bias={favourite: -100.0})
    assert all(favourite not in tokens for tokens in banned)
    assert greedy_with(llm, logit_bias={favourite: 0.0}) == plain


def test_logit_bias_out_of_the_vocabulary_is_refused_naming_it(llm):
    with pytest.raises(ValueError, match="logit_bias") as error:
        llm.generate([[1, 2]], SamplingParams(logit_bias={256: 1.0}))
    assert error.value.param == "logit_bias"
    assert llm.generate([[1, 2]], SamplingParams(max_tokens=2))[0].outputs[0].finish_reason == "length"


def test_min_tokens_holds_back_stop_tokens(llm):
    plain = greedy_with(llm, prompts=PROMPTS[:1])[0]
    stop = plain[1]  # without min_tokens, the request stops at its second token
    params = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop])
    assert llm.generate(PROMPTS[:1], params)[0].outputs[0].token_ids == plain[:2]
    out = llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop],
                                                   min_tokens=6))[0].outputs[0]
    assert len(out.token_ids) >= 6 and stop not in out.token_ids[:6]  # banned while fewer than 6 are out


@pytest.fixture(scope="module")
def austen():
    return LLM(DEFAULT_MODEL)


def austen_text(austen, max_tokens=20, **kwargs):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)
    return austen.generate(["It is a truth"], params)[0].outputs[0].text


def test_include_stop_str_in_output_keeps_the_stop_string(austen):
    plain = austen_text(austen)
    word = plain.split()[3]
    assert austen_text(austen, stop=[word]) + word == austen_text(austen, stop=[word], include_stop_str_in_output=True)
    assert austen_text(austen, stop=[word], include_stop_str_in_output=True) in plain


def test_min_tokens_holds_back_stop_strings(austen):
    # Catches: stop strings checked before min_tokens (the text ends at the first 'good', in token 5).
    plain = austen_text(austen, max_tokens=30)  # ' to be a very good sort of thing, and a very good sort ...'
    word = plain.split()[4]
    first = plain.index(word)
    assert austen_text(austen, max_tokens=30, stop=[word]) == plain[:first]
    assert austen_text(austen, max_tokens=30, stop=[word], min_tokens=8) == plain[:plain.index(word, first + 1)]


@pytest.mark.parametrize("kwargs, field", [
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(frequency_penalty=2.5), "frequency_penalty"),
    (dict(presence_penalty=float("nan")), "presence_penalty"), (dict(min_p=1.5), "min_p"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"), (dict(logit_bias={1: float("inf")}), "logit_bias"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens"),
    (dict(include_stop_str_in_output=1), "include_stop_str_in_output"),
    (dict(structured_outputs={"json": {}}), "structured_outputs")])
def test_bad_values_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field) as error:
        SamplingParams(**kwargs)
    assert error.value.param == field


def test_nothing_is_copied_when_no_request_asks():
    logits = torch.randn(3, 50)
    seqs = [Sequence(str(i), None, [1, 2], SamplingParams(temperature=0.7, top_k=5, min_p=0.1)) for i in range(3)]
    assert process_logits(logits, seqs, {2}) is logits
    seqs[1] = Sequence("x", None, [1, 2], SamplingParams(logit_bias={3: 1.0}))
    processed = process_logits(logits, seqs, {2})
    assert processed is not logits and torch.equal(processed[[0, 2]], logits[[0, 2]])  # the raw logits stay raw
    assert processed[1, 3] == logits[1, 3] + 1
