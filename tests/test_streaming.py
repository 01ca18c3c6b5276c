"""Streaming (StepResult.deltas), stop strings and LLM.chat, on the bundled byte-level BPE model."""
import dataclasses
import json
import random
import shutil

import pytest
from tokenizers.decoders import DecodeStream
from transformers import AutoTokenizer

import nanoserve
from nanoserve import LLM, SamplingParams
from nanoserve.detokenizer import Detokenizer

PROMPT = "It is a truth universally acknowledged"
# The bundled model's greedy output for PROMPT, token by token:
# ',' ' that' ' it' ' is' ' not' ' a' ' very' ' different' ' thing' ' to' ' be' ' done' '.' ' I' ' am' ' sure' ...
GREEDY_TEXT = ", that it is not a very different thing to be done. I am sure I have not the least idea of it."
ODD_PROMPTS = ["Mr. Darcy 😀 日本語 ", "“Naïve” café — ½ ünd 한국어", PROMPT, "Elizabeth"]


@pytest.fixture(scope="module")
def llm():
    return LLM(nanoserve.DEFAULT_MODEL, device="cpu")


def stream(engine, prompts, params):
    """Serve prompts through step(); returns their ids, each one's deltas, and each one's output."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    deltas, outputs = {i: [] for i in ids}, {}
    while engine.has_unfinished_requests():
        result = engine.step()
        engine.assert_invariants()
        for delta in result.deltas:
            assert delta.request_id not in outputs, "a delta after the request's final output"
            deltas[delta.request_id].append(delta)
        outputs.update((o.request_id, o) for o in result.outputs)
    return ids, deltas, outputs


def assert_stream_matches(deltas, output):
    assert "".join(d.text for d in deltas) == output.text
    assert [t for d in deltas for t in d.token_ids] == output.token_ids
    assert [d.finish_reason for d in deltas] == [None] * (len(deltas) - 1) + [output.finish_reason]


def assert_blocks_back(llm):
    assert llm.engine.scheduler.block_manager.num_free_blocks == llm.engine.model_runner.num_blocks - 1


# Catches: deltas that drop, repeat or reorder text or tokens, or a finish_reason on the wrong delta.
@pytest.mark.parametrize("temperature", [0, 1.0])
def test_deltas_concatenate_to_the_output(llm, temperature):
    params = [SamplingParams(temperature=temperature, max_tokens=n, seed=i) for i, n in enumerate([30, 5, 40, 1])]
    ids, deltas, outputs = stream(llm.engine, ODD_PROMPTS, params)
    for request_id in ids:
        assert_stream_matches(deltas[request_id], outputs[request_id])
        decoded = llm.engine.tokenizer.decode(outputs[request_id].token_ids, skip_special_tokens=True)
        assert outputs[request_id].text == decoded
    if temperature == 0:  # LLM.generate is unchanged by streaming
        assert [o.text for o in llm.generate(ODD_PROMPTS, params, use_tqdm=False)] == [outputs[i].text for i in ids]
    assert_blocks_back(llm)


# Catches: a half character streamed as U+FFFD (or lost) when a character's bytes span tokens.
def test_no_replacement_char_before_the_final_text_has_one(llm):
    params = [SamplingParams(temperature=8.0, max_tokens=40, seed=i, ignore_eos=True) for i in range(6)]
    ids, deltas, outputs = stream(llm.engine, ODD_PROMPTS * 2, params)
    assert any("\ufffd" in outputs[i].text for i in ids), "no odd bytes sampled: the test tests nothing"
    for request_id in ids:
        text, offset = outputs[request_id].text, 0
        for delta in deltas[request_id]:
            for k, char in enumerate(delta.text):
                assert char != "\ufffd" or text[offset + k] == "\ufffd"
            offset += len(delta.text)
        assert_stream_matches(deltas[request_id], outputs[request_id])


# Catches: DecodeStream misuse: an emoji or CJK character split across byte tokens shows up broken.
def test_detokenizer_streams_whole_characters(llm):
    tokenizer = llm.engine.tokenizer
    token_ids = tokenizer.encode("😀 日本語 “quotes” naïve 한국어 ½")
    detokenizer, pieces = Detokenizer(tokenizer, ()), []
    for token in token_ids:
        detokenizer.add(token)
        pieces.append(detokenizer.take_delta(finished=False))
    assert "".join(pieces) == tokenizer.decode(token_ids, skip_special_tokens=True)
    assert not any("\ufffd" in piece for piece in pieces) and "" in pieces  # some bytes were held back


# Catches: preemption re-sending the deltas of tokens a request already streamed.
def test_preemption_does_not_repeat_deltas():
    llm = LLM(nanoserve.DEFAULT_MODEL, device="cpu", block_size=4, num_kvcache_blocks=18, max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ids, deltas, outputs = stream(llm.engine, ODD_PROMPTS, params)
    assert llm.engine.scheduler.num_preemptions > 0
    for request_id in ids:
        assert_stream_matches(deltas[request_id], outputs[request_id])
        assert outputs[request_id].finish_reason == "length"  # max_tokens or max_model_len
    assert_blocks_back(llm)


# Catches: a prefix-cache hit (prompt tokens skipped) confusing where the output text starts.
def test_prefix_cache_hits_stream_the_same(llm):
    prompts = [PROMPT * 3 + " by all the world", PROMPT * 3 + " by Mr. Darcy"]  # a full 16-token block shared
    params = SamplingParams(temperature=0, max_tokens=20)
    first = stream(llm.engine, prompts, params)
    ids, deltas, outputs = stream(llm.engine, prompts, params)
    assert all(outputs[i].num_cached_tokens > 0 for i in ids)
    for old_id, request_id in zip(first[0], ids):
        assert_stream_matches(deltas[request_id], outputs[request_id])
        assert outputs[request_id].text == first[2][old_id].text


@pytest.mark.parametrize("stop, text, num_tokens", [
    ("I am sure", ", that it is not a very different thing to be done. ", 16),  # straddles 3 tokens
    (["the least", "very diff"], ", that it is not a ", 8),   # the earlier one wins; ends mid-token
    (["ff", " different"], ", that it is not a very", 8),     # both end in ' different': the one that starts first
    ([", th"], "", 2),                                         # at the very start
    (" I am ", ", that it is not a very different thing to be done.", 16),  # ' I', ' am' end in " I am" (held)
])
# Catches: a stop string missed across tokens, leaked into a delta, or left in the text; blocks kept;
# the text cut at the first stop string in list order instead of the first in the text; an end that is
# a stop string less its last character streamed (then cut).
def test_stop_strings(llm, stop, text, num_tokens):
    assert GREEDY_TEXT.startswith(text)
    ids, deltas, outputs = stream(llm.engine, [PROMPT, "Elizabeth"],
                                  [SamplingParams(temperature=0, max_tokens=40, stop=stop),
                                   SamplingParams(temperature=0)])
    output = outputs[ids[0]]
    assert (output.text, output.finish_reason, len(output.token_ids)) == (text, "stop", num_tokens)
    assert_stream_matches(deltas[ids[0]], output)
    for k in range(len(deltas[ids[0]])):  # no stream prefix ever shows any part of the stop string
        shown = "".join(d.text for d in deltas[ids[0]][:k + 1])
        assert shown == text[:len(shown)]
    assert_blocks_back(llm)


# Catches: the length rule winning over a stop string completed by the very last allowed token.
def test_stop_string_at_max_tokens_is_a_stop(llm):
    output = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, stop="I am sure"), use_tqdm=False)[0]
    assert (output.text, output.finish_reason) == (", that it is not a very different thing to be done. ", "stop")


# Catches: a bad stop value accepted, then failing in the middle of a step.
@pytest.mark.parametrize("stop", ["", [""], [1], "ab".encode(), [None], 3])
def test_stop_validation(stop):
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=stop)
    assert SamplingParams(stop="x").stop == ("x",) and SamplingParams(stop=["a", "b"]).stop == ("a", "b")


# Catches: an abort that keeps streaming, or never reports its final output.
def test_abort_mid_stream(llm):
    engine = llm.engine
    request_id = engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=40))
    seen = [d for _ in range(5) for d in engine.step().deltas]
    aborted = engine.abort_request(request_id)
    result = engine.step()
    assert result.outputs == [aborted] and aborted.finish_reason == "abort" and not result.deltas
    assert [t for d in seen for t in d.token_ids] == aborted.token_ids
    assert GREEDY_TEXT.startswith(aborted.text) and aborted.text.startswith("".join(d.text for d in seen))
    assert not engine.has_unfinished_requests()
    later = engine.step()
    assert not later.deltas and not later.outputs  # reported once, not again in every later step
    assert_blocks_back(llm)


def ending_inside_a_character(llm) -> tuple[SamplingParams, int]:
    """A seeded request and n such that its first n output tokens end inside a character: decoded
    whole they end in U+FFFD, decoded as a stream that character's bytes are still held back."""
    tokenizer = llm.engine.tokenizer
    for seed in range(20):
        params = SamplingParams(temperature=8.0, max_tokens=40, seed=seed, ignore_eos=True)
        token_ids = llm.generate(PROMPT, params, use_tqdm=False)[0].token_ids
        decoder, streamed = DecodeStream(skip_special_tokens=True), ""
        for n, token in enumerate(token_ids, 1):
            streamed += decoder.step(tokenizer.backend_tokenizer, token) or ""
            if tokenizer.decode(token_ids[:n], skip_special_tokens=True) != streamed:
                return params, n
    pytest.fail("no seed ends inside a character: the tests that use this would test nothing")


# Catches: the last delta taken before the final re-decode, so a request that ends inside a
# character never streams the end of its text.
def test_a_request_that_ends_inside_a_character_streams_its_whole_text(llm):
    params, n = ending_inside_a_character(llm)
    ids, deltas, outputs = stream(llm.engine, [PROMPT], dataclasses.replace(params, max_tokens=n))
    output = outputs[ids[0]]
    assert output.text.endswith("\ufffd") and output.text == llm.engine.tokenizer.decode(output.token_ids)
    assert_stream_matches(deltas[ids[0]], output)


# Catches: an aborted request's text without its held-back end (the detokenizer not finished on abort).
def test_an_aborted_request_has_its_whole_text(llm):
    params, n = ending_inside_a_character(llm)
    engine = llm.engine
    request_id = engine.add_request(PROMPT, params)
    seen = []
    while len(seen) < n:
        seen += [d for d in engine.step().deltas if d.request_id == request_id]
    aborted = engine.abort_request(request_id)
    assert len(aborted.token_ids) == n
    assert aborted.text == engine.tokenizer.decode(aborted.token_ids) != "".join(d.text for d in seen)
    assert engine.step().outputs == [aborted]
    assert_blocks_back(llm)


def plain_stop_deltas(tokenizer, token_ids: list[int], stop: list[str]) -> tuple[list[str], str]:
    """The plain formulation of streaming with stop strings, the reference for Detokenizer: after
    each token, cut the text before the stop string that starts first in it (none was there before);
    otherwise hold back its longest end that is the beginning of a stop string."""
    decoder, text, num_sent, deltas = DecodeStream(skip_special_tokens=True), "", 0, []
    for token in token_ids:
        text += decoder.step(tokenizer.backend_tokenizer, token) or ""
        starts = [text.find(s) for s in stop if s in text]
        if starts:
            text = text[:min(starts)]
            return deltas + [text[num_sent:]], text
        held = max((k for s in stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        deltas.append(text[num_sent:len(text) - held])
        num_sent = len(text) - held
    return deltas, text


# Catches: any difference from the plain formulation (an automaton state not advanced over every new
# character, a wrong fallback table, matches in list order, a stop string missed across tokens), on
# random texts and stop strings taken from them: some whole, some beginnings only, some that repeat.
def test_detokenizer_stops_and_holds_back_as_the_plain_formulation(llm):
    tokenizer, rng = llm.engine.tokenizer, random.Random(0)
    short = [i for i in range(3, len(tokenizer)) if len(tokenizer.decode([i])) <= 3]  # many tokens per stop string
    num_stopped = 0
    for case in range(300):
        pool = rng.sample(short, rng.choice([2, 3, 100]))  # few tokens: texts that repeat themselves
        token_ids = [rng.choice(pool) for _ in range(40)]
        text = tokenizer.decode(token_ids)
        stop = []
        for _ in range(rng.randrange(1, 4)):
            start = rng.randrange(len(text))
            piece = text[start:start + rng.randrange(1, 12)]
            stop.append(piece + rng.choice(["", "", "\x00", piece]))  # \x00 never comes: a beginning only
        detokenizer, deltas = Detokenizer(tokenizer, tuple(stop)), []
        for token in token_ids:
            stopped = detokenizer.add(token)
            deltas.append(detokenizer.take_delta(finished=stopped))
            if stopped:
                break
        expected_deltas, expected_text = plain_stop_deltas(tokenizer, token_ids, stop)
        assert (deltas, detokenizer.text) == (expected_deltas, expected_text), (case, stop)
        num_stopped += detokenizer.stopped
    assert 100 < num_stopped < 290  # both kinds of case were tested


# Catches: a long beginning of a long stop string streamed instead of held back (the automaton's state
# capped, or reset between tokens).
def test_a_long_stop_string_holds_back_all_it_may_begin(llm):
    tokenizer = llm.engine.tokenizer
    long_stop = "a" * 20_000 + "b"
    token_ids = tokenizer.encode("a" * 3000, add_special_tokens=False)
    detokenizer = Detokenizer(tokenizer, (long_stop,))
    for token in token_ids:
        assert not detokenizer.add(token)
        assert detokenizer.take_delta(finished=False) == ""  # all of it may begin the stop string
    assert detokenizer.matched == [3000]


# Catches: a model without tokenizer crashing the stream instead of streaming token ids only.
def test_no_tokenizer_streams_tokens_only(tiny_models):
    llm = LLM(tiny_models["gqa"])
    ids, deltas, outputs = stream(llm.engine, [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4))
    assert [d.text for d in deltas[ids[0]]] == [None] * 4 and outputs[ids[0]].text is None
    assert [t for d in deltas[ids[0]] for t in d.token_ids] == outputs[ids[0]].token_ids
    with pytest.raises(ValueError, match="chat_template"):
        llm.chat([{"role": "user", "content": "hi"}])


TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


# Catches: chat prompts formatted unlike transformers' template (or with a doubled <s>).
def test_chat_formats_like_transformers(tmp_path, llm):
    path = shutil.copytree(nanoserve.DEFAULT_MODEL, tmp_path / "chat-model")
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    chat_llm = LLM(str(path), device="cpu")
    conversations = [[{"role": "user", "content": "Who is Mr. Darcy? 😀"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]]
    params = SamplingParams(temperature=0, max_tokens=8)
    outputs = chat_llm.chat(conversations, params, use_tqdm=False)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    for conversation, output in zip(conversations, outputs):
        expected = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True)["input_ids"]
        assert output.prompt_token_ids == expected and expected.count(1) == 1
        assert output.prompt == tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        assert output.token_ids == chat_llm.generate(expected, params, use_tqdm=False)[0].token_ids
    assert chat_llm.chat(conversations[0], params, use_tqdm=False)[0].token_ids == outputs[0].token_ids


# Catches: LLM.chat on a model without a chat template silently generating from a raw prompt.
def test_chat_without_template_raises(llm):
    with pytest.raises(ValueError, match="chat_template"):
        llm.chat([{"role": "user", "content": "Hello"}])
