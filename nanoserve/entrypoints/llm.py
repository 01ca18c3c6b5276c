"""The offline front end: `LLM(model_path, **config).generate(prompts, sampling_params)`.

`generate` adds every prompt to an `LLMEngine` (engine.py), and steps it until all have finished.
`chat` formats conversations with the tokenizer's chat template first. As vLLM's `LLM`.
"""
from __future__ import annotations

import time
from dataclasses import replace

from tqdm import tqdm

from nanoserve.composition import build_engine
from nanoserve.config import Config
from nanoserve.outputs import RequestOutput
from nanoserve.sampling_params import SamplingParams, is_int


class LLM:
    """Offline inference: `LLM(model_path, **config).generate(prompts, sampling_params)`."""

    def __init__(self, model: str, **config: object) -> None:
        self.engine = build_engine(Config.from_kwargs(model, **config))

    def close(self) -> None:
        """Stop the workers of `tensor_parallel_size` > 1 and free their port; a no-op otherwise."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def generate(self, prompts: str | list[int] | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Serve all prompts together; returns their outputs in input order. A single prompt (a
        string or a list of token ids) is served as a list of one. A prompt with n > 1 becomes n
        requests (SamplingParams.for_sample), whose completions come back in one output's `outputs`.
        A request aborted meanwhile (through llm.engine, between steps) comes back with finish_reason
        "abort". If anything fails, its requests are aborted before the error propagates: the engine
        is left idle. A request may fail alone (finish_reason "error": a grammar with no valid output).
        It raises its error: a ValueError naming the field, where its input caused it."""
        prompts = as_prompt_list(prompts)
        if self.engine.has_unfinished_requests():
            raise ValueError("LLM.generate needs an idle engine: requests added to llm.engine are "
                             "served by calling llm.engine.step() until they finish")
        if not isinstance(sampling_params, (list, tuple)):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling_params for {len(prompts)} prompts")
        ids: list[list[str]] = []  # per prompt, its n requests
        try:
            for prompt, params in zip(prompts, sampling_params):
                params = params or SamplingParams()
                ids.append([])  # before adding: a bad params' n > 1 fans out here, and fails on the first
                ids[-1] += [self.engine.add_request(prompt, params.for_sample(i)) for i in range(params.n)]
            outputs = self.run_until_done([request_id for group in ids for request_id in group], use_tqdm)
        except BaseException:  # a bad prompt, an error in a step, Ctrl-C: leave the engine idle
            self.engine.discard([request_id for group in ids for request_id in group])  # reported by raising
            raise
        for group in ids:  # one output per prompt: its first request's, with the others' completions in order
            first, *others = [outputs[request_id] for request_id in group]
            first.outputs += [replace(other.outputs[0], index=i) for i, other in enumerate(others, start=1)]
        return [outputs[group[0]] for group in ids]

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts), or a list of them.

        Each is formatted by the tokenizer's chat template, ending with the assistant's turn to speak.
        Then it is served as by `generate`. The template writes any special tokens (<s>), so encode adds
        none."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None or not tokenizer.chat_template:
            raise ValueError(f"{self.engine.config.model} has no tokenizer with a chat_template; "
                             "format the prompts yourself and call generate")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in conversations]
        outputs = self.generate([tokenizer.encode(p, add_special_tokens=False) for p in prompts],
                                sampling_params, use_tqdm)
        for output, prompt in zip(outputs, prompts):
            output.prompt = prompt
        return outputs

    def run_until_done(self, ids: list[str], use_tqdm: bool) -> dict[str, RequestOutput]:
        """Step until every request in `ids` has an output; returns them by request id."""
        outputs: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm, dynamic_ncols=True)
        start, num_prefill, num_decode = time.perf_counter(), 0, 0
        while len(outputs) < len(ids):
            result = self.engine.step()
            num_prefill += result.num_prefill_tokens
            num_decode += result.num_decode_tokens
            seconds = time.perf_counter() - start
            bar.set_postfix(prefill=f"{num_prefill / seconds:.0f} tok/s",
                            decode=f"{num_decode / seconds:.0f} tok/s", refresh=False)
            outputs.update((o.request_id, o) for o in result.outputs)
            if failed := next((o for o in result.outputs if o.error is not None), None):
                raise failed.error
            bar.update(len(outputs) - bar.n)
        bar.close()
        return outputs


def as_prompt_list(prompts: object) -> list[str] | list[list[int]]:
    """generate's prompts as a list.

    One prompt (a string or a list of token ids) becomes a list of one. A list or tuple of prompts stays as
    it is. add_request checks each prompt."""
    if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                    and all(is_int(t) for t in prompts)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a string, a list of token ids, or a list of those; "
                         f"got {type(prompts).__name__}")
    return list(prompts)
