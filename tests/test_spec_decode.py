"""Speculative decoding by n-gram prompt lookup (spec_decode.py): the proposer on its own; greedy output token-exact
with transformers and with speculation off under every setup that changes how tokens are batched (drafts really
accepted); stop rules, max_tokens, logprobs and streaming deltas seeing accepted tokens only; seeded sampling the same
with and without drafts; the output distribution unchanged at temperature 1; drafts shrinking rather than anyone
being preempted; the counters, the trace and the config checks."""
import json
import math

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import conftest
from conftest import build_tiny_llama, greedy
from nanoserve import DEFAULT_MODEL, LLM, SamplingParams
from nanoserve.config import cdiv
from nanoserve.entrypoints.trace import format_step
from nanoserve.extensions.spec_decode import propose_ngram

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
        "disable_by_batch_size": 64}
# Prompts that repeat themselves (the tiny random models also fall into loops, which drafts then predict)
PROMPTS = [[1] + [5, 6, 7, 8, 9, 10, 11] * 4, [1, 20, 21, 22, 23, 20, 21], [1, 30, 31, 32, 33, 34] * 3,
           [1] + list(range(40, 70)) + list(range(40, 50)), [1, 3, 3]]
MAX_TOKENS = [40, 23, 31, 17, 26]
SETUPS = {
    "mixed_batch": dict(block_size=4),
    "chunked_prefill": dict(block_size=4, max_num_batched_tokens=8),   # drafts compete with prefill chunks
    "preemption": dict(block_size=4, num_kvcache_blocks=22, max_model_len=80),
    "block_size_1": dict(block_size=1),
}


def run(llm: LLM, prompts: list, params: list[SamplingParams]) -> tuple[list, list]:
    """Every request queued at once and stepped to the end, the invariants checked after every step.
    Returns the outputs in request order and each step's StepResult."""
    engine = llm.engine
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    outputs, steps = {}, []
    while engine.has_unfinished_requests():
        steps.append(engine.step())
        engine.assert_invariants()
        # no block held for a rejected draft: just those of the tokens so far (the last one is written next step)
        assert all(len(s.block_table) <= cdiv(s.num_tokens, engine.block_size) for s in engine.scheduler.running)
        outputs |= {o.request_id: o for o in steps[-1].outputs}
    assert engine.scheduler.block_manager.num_free_blocks == engine.model_runner.num_blocks - 1
    return [outputs[i] for i in ids], steps


def test_propose_ngram_takes_the_longest_most_recent_match():
    """Catches the first occurrence taken instead of the most recent, a shorter n preferred, the context's own last
    n-gram matched, and a draft cut short where the match overlaps the end."""
    t = np.array([1, 2, 3, 9, 1, 2, 3, 8, 7, 5, 2, 3])
    assert propose_ngram(t, 2, 1, 3) == [8, 7]                 # "2 3": its most recent earlier occurrence
    assert propose_ngram(t, 2, 1, 1) == [8, 7]                 # "3", likewise
    assert propose_ngram(np.array([4, 5, 6, 0, 5, 6, 1, 4, 5, 6]), 1, 1, 3) == [0]  # "4 5 6" beats the later "5 6"
    assert propose_ngram(np.array([1, 2, 3, 4]), 3, 1, 3) == []  # no earlier occurrence of anything
    assert propose_ngram(np.array([7, 7]), 3, 1, 3) == [7, 7, 7]
    assert propose_ngram(np.array([5, 1, 2, 1, 2]), 5, 2, 2) == [1, 2, 1, 2, 1]  # a period-2 tail, in full
    assert propose_ngram(np.array([3, 4, 9, 3, 4]), 4, 3, 5) == []  # only n >= 3 counts


@pytest.mark.parametrize("setup", SETUPS)
def test_greedy_is_token_exact_with_transformers_and_without_speculation(tiny_models, setup):
    """Catches a draft kept that differs from the argmax (or one dropped that equals it), a rejected draft's KV
    read as context, a sampled row taken from the wrong position, blocks lost or cached with rejected tokens."""
    path = tiny_models["gqa"]
    params = [greedy(n) for n in MAX_TOKENS]
    llm = LLM(path, speculative_config=SPEC, **SETUPS[setup])
    outputs, steps = run(llm, PROMPTS, params)
    expected = conftest.reference(path, PROMPTS, MAX_TOKENS)
    assert [o.token_ids for o in outputs] == expected
    assert [o.token_ids for o in run(LLM(path, **SETUPS[setup]), PROMPTS, params)[0]] == expected
    stats = llm.engine.stats()
    assert stats["num_accepted_tokens"] > 0 and stats["num_draft_tokens"] > stats["num_accepted_tokens"]
    assert sum(stats["num_accepted_tokens_per_pos"]) == stats["num_accepted_tokens"]
    assert max(len(d.token_ids) for s in steps for d in s.deltas) > 1
    if setup == "preemption":
        assert stats["num_preemptions"] > 0


def test_prefix_cache_hits_on_blocks_written_with_drafts(tiny_models):
    """Catches a block cached while it held a rejected draft: a later request sharing it would read wrong KV."""
    path = tiny_models["gqa"]
    llm = LLM(path, block_size=4, speculative_config=SPEC)
    first = run(llm, [PROMPTS[0]], [greedy(40)])[0][0]
    again = PROMPTS[0] + first.token_ids[:30]  # its prompt and output, now in the prefix cache
    second = run(llm, [again], [greedy(10)])[0][0]
    assert second.num_cached_tokens >= 56
    assert second.token_ids == conftest.reference(path, [again], [10])[0]


def test_max_tokens_inside_an_accepted_run(tiny_models):
    """Catches drafts running past max_tokens (KV computed for tokens that can never be output), and tokens
    appended past max_tokens when a step accepts several at once. (Stop rules are checked after each accepted
    token: the stop-string test below.)"""
    path = tiny_models["gqa"]
    expected = conftest.reference(path, [PROMPTS[0]], [40])[0]
    llm = LLM(path, block_size=4, speculative_config=SPEC)
    _, steps = run(llm, [PROMPTS[0]], [greedy(40)])
    runs = [d.token_ids for s in steps for d in s.deltas]
    ends = np.cumsum([len(r) for r in runs]) - 1  # index in the output of each step's last token
    start = next(end - len(r) + 1 for r, end in zip(runs, ends) if len(r) >= 3)  # a run of 3 or more
    # max_tokens ends the request at the run's middle token, and no draft runs past it
    out, steps = run(llm, [PROMPTS[0]], [greedy(start + 2)])
    assert (out[0].token_ids, out[0].finish_reason) == (expected[:start + 2], "length")
    assert max(s.batch.positions.max().item() for s in steps if s.batch is not None) == len(PROMPTS[0]) + start


def test_stop_string_inside_an_accepted_run():
    """Catches the stop-string check made once per step, not after each accepted token: token_ids would run past
    the token that completed the stop string."""
    prompt = ("Repeat: It is a truth universally acknowledged, that a single man in possession of a good fortune, "
              "must be in want of a wife. Again: It is a truth universally acknowledged, that")
    llm = LLM(DEFAULT_MODEL, block_size=16, speculative_config=SPEC)
    outputs, steps = run(llm, [prompt], [greedy(30)])
    tokens, tokenizer = outputs[0].token_ids, AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    ends = np.cumsum([len(d.token_ids) for s in steps for d in s.deltas]) - 1  # each step's last token
    for i in (i for i in range(len(tokens)) if i not in ends):  # a token inside an accepted run
        text = tokenizer.decode(tokens[:i + 1])
        stop = text[-12:]
        if stop.strip() and text.find(stop) == len(text) - len(stop):  # first completed by token i
            break
    else:
        pytest.fail("no stop string is completed by a token inside an accepted run")
    params = SamplingParams(temperature=0, max_tokens=30, stop=[stop])
    with_spec = run(llm, [prompt], [params])[0][0]
    without = run(LLM(DEFAULT_MODEL, block_size=16), [prompt], [params])[0][0]
    assert with_spec.finish_reason == "stop" and with_spec.token_ids == tokens[:i + 1]
    assert (with_spec.token_ids, with_spec.text) == (without.token_ids, without.text)


def test_logprobs_and_deltas_see_accepted_tokens_only(tiny_models):
    """Catches logprobs of a rejected draft's row reported, a step's deltas split or missing a token."""
    path = tiny_models["gqa"]
    params = [SamplingParams(temperature=0, max_tokens=n, logprobs=2) for n in MAX_TOKENS]
    outputs, steps = run(LLM(path, block_size=4, speculative_config=SPEC), PROMPTS, params)
    plain, _ = run(LLM(path, block_size=4), PROMPTS, params)
    for out, ref in zip(outputs, plain):
        deltas = [d for s in steps for d in s.deltas if d.request_id == out.request_id]
        assert [t for d in deltas for t in d.token_ids] == out.token_ids == ref.token_ids
        assert [lp for d in deltas for lp in d.logprobs] == out.outputs[0].logprobs
        for got, want in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs):
            assert list(got) == list(want)
            assert all(math.isclose(got[t].logprob, want[t].logprob, abs_tol=1e-4) for t in got)
        assert all(sum(d.request_id == out.request_id for d in s.deltas) <= 1 for s in steps)  # one delta a step


def test_seeded_sampling_is_the_same_with_and_without_drafts(tiny_models):
    """Catches a draft position sampled with another token's noise (its row's count of tokens before it wrong):
    a seeded request's tokens would change with speculation, and with what the batch lets it draft."""
    path = tiny_models["gqa"]
    params = [SamplingParams(temperature=0.8, top_k=20, seed=s, max_tokens=n) for s, n in enumerate(MAX_TOKENS)]
    llm = LLM(path, block_size=4, speculative_config=SPEC)
    spec = [o.token_ids for o in run(llm, PROMPTS, params)[0]]
    assert llm.engine.stats()["num_accepted_tokens"] > 0
    assert spec == [o.token_ids for o in run(LLM(path, block_size=4), PROMPTS, params)[0]]
    assert spec == [o.token_ids for o in run(llm, PROMPTS[::-1], params[::-1])[0]][::-1]


def test_sampling_distribution_is_unchanged_by_drafts(tmp_path):
    """On a vocabulary of 8, the third token of many unseeded samples at temperature 1, made in steps that verify
    drafts, follows the model's own distribution (computed with transformers over every 2-token start): a chi-square
    test. Catches drafts accepted by the greedy rule (draft == argmax) or always, which skews it."""
    vocab, prompt, num_samples = 8, [1, 3, 4, 5, 6, 7, 3, 4, 5], 3000
    path = build_tiny_llama(str(tmp_path / "m"), vocab_size=vocab, bos_token_id=1, eos_token_id=0, seed=3)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    starts = torch.tensor([prompt + [a, b] for a in range(vocab) for b in range(vocab)])
    with torch.no_grad():
        logp = torch.log_softmax(model(starts).logits, dim=-1)  # [64, len(prompt) + 2, vocab]
    p_ab = (logp[:, -3, :].gather(1, starts[:, -2:-1])[:, 0] + logp[:, -2, :].gather(1, starts[:, -1:])[:, 0]).exp()
    expected = (p_ab[:, None] * logp[:, -1, :].exp()).sum(0) * num_samples  # [vocab]: the third token's counts
    llm = LLM(path, block_size=4, max_num_seqs=512, speculative_config=SPEC | {"disable_by_batch_size": 1000})
    torch.manual_seed(0)  # unseeded samples draw from torch's generator: the same draws every run
    outputs, _ = run(llm, [prompt] * num_samples, [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)]
                     * num_samples)
    assert llm.engine.stats()["num_accepted_tokens"] > num_samples / 20  # many third tokens came from drafts
    observed = np.bincount([o.token_ids[2] for o in outputs], minlength=vocab)
    chi2 = float(((torch.tensor(observed) - expected) ** 2 / expected).sum())
    assert chi2 < 24.3, (observed, expected)  # 7 degrees of freedom: p = 0.001


def test_drafts_cost_no_preemption(tiny_models):
    """Few free blocks: drafts get KV slots only after every running request has its next token's, and blocks that
    only rejected drafts used come back at once, so speculation preempts no more than plain decoding does. Catches
    those blocks kept (run() checks it after every step, and the next request short of a block is preempted)."""
    path = tiny_models["gqa"]
    setup = dict(block_size=4, num_kvcache_blocks=26, max_model_len=80)
    prompts, max_tokens = [PROMPTS[0], PROMPTS[2], PROMPTS[3]], [40, 40, 39]  # 41 + 39: max_model_len
    plain = LLM(path, **setup)
    run(plain, prompts, [greedy(n) for n in max_tokens])
    llm = LLM(path, speculative_config=SPEC, **setup)
    outputs, _ = run(llm, prompts, [greedy(n) for n in max_tokens])
    assert [o.token_ids for o in outputs] == conftest.reference(path, prompts, max_tokens)
    assert llm.engine.stats()["num_accepted_tokens"] > 0
    assert llm.engine.stats()["num_preemptions"] <= plain.engine.stats()["num_preemptions"]


def test_no_drafts_from_the_batch_size_on_and_the_trace_shows_them(tiny_models):
    """Catches disable_by_batch_size ignored, and drafts missing from the trace."""
    path = tiny_models["gqa"]
    llm = LLM(path, block_size=4, speculative_config=SPEC | {"disable_by_batch_size": 2})
    run(llm, PROMPTS[:2], [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)] * 2)  # 2 all along
    assert llm.engine.stats()["num_drafts"] == 0
    llm = LLM(path, block_size=4, speculative_config=SPEC)
    _, steps = run(llm, PROMPTS[:1], [greedy(20)])
    trace = "\n".join(format_step(s) for s in steps)
    assert "drafts" in trace and "accepted" in trace


@pytest.mark.parametrize("config, message", [
    ({"method": "eagle", "num_speculative_tokens": 3}, "method 'ngram'"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 3, "lookahead": 2}, "lookahead"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ("ngram", "method 'ngram'"),
])
def test_bad_speculative_config_is_refused(tiny_models, config, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_models["gqa"], speculative_config=config)


def test_server_takes_speculative_config_and_reports_acceptance():
    """`--speculative-config` JSON as vLLM's; a stream's chunks add up to the offline output, and /metrics counts
    drafts. Catches the option not reaching Config, and the counters missing from /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    from nanoserve import LLMEngine
    from nanoserve.entrypoints.openai.api_server import ServerThread, build_app, build_parser
    from nanoserve.entrypoints.utils import engine_config
    args = build_parser("serve").parse_args([DEFAULT_MODEL, "--block-size", "16", "--device", "cpu",
                                             "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4,'
                                             ' "prompt_lookup_max": 3, "prompt_lookup_min": 1}'])
    config = engine_config(args)
    assert config.speculative_config["num_speculative_tokens"] == 4
    prompt = "My dear Jane, my dear Jane, my dear Jane, my dear"
    expected = LLM(DEFAULT_MODEL, block_size=16).generate([prompt], greedy(40), use_tqdm=False)[0].text
    server = ServerThread(build_app(LLMEngine(config), "m")).start()
    try:
        body = dict(model="m", prompt=prompt, max_tokens=40, temperature=0, stream=True)
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert "".join(c["choices"][0]["text"] for c in chunks) == expected
        text = httpx.get(server.url + "/metrics").text
    finally:
        server.stop()
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert values["vllm:spec_decode_num_accepted_tokens_total"] > 0
    assert values["vllm:spec_decode_num_draft_tokens_total"] >= values["vllm:spec_decode_num_accepted_tokens_total"]


def test_requests_whose_logits_are_processed_get_no_drafts(tiny_models):
    """Catches drafts for a request with a penalty (or a grammar, min_tokens): a draft's row would be penalised as
    if the drafts before it were not in the output yet, so the tokens would differ from speculation off (they do,
    here, for frequency_penalty 0.1). A neighbour without one still gets drafts."""
    path = tiny_models["gqa"]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, frequency_penalty=0.1)
              for n in MAX_TOKENS] + [greedy(MAX_TOKENS[0])]
    llm = LLM(path, speculative_config=SPEC, block_size=4)
    outputs, steps = run(llm, PROMPTS + PROMPTS[:1], params)
    alone = run(LLM(path, block_size=4), PROMPTS + PROMPTS[:1], params)[0]
    assert [o.token_ids for o in outputs] == [o.token_ids for o in alone]
    penalised = {o.request_id for o in outputs[:-1]}
    assert all(len(d.token_ids) == 1 for s in steps for d in s.deltas if d.request_id in penalised)
    assert llm.engine.stats()["num_accepted_tokens"] > 0
