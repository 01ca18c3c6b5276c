"""The engine: the loop that ties scheduler, model runner and block manager together.

`LLMEngine.step()` is one turn of continuous batching:
    schedule -> build_batch -> model forward + sample -> update (append tokens, finish, free blocks)
Requests can be added and aborted between any two steps. Each step streams a `RequestDelta` for
every request that sampled a token (its new text is settled: see detokenizer.py). `LLM` is the
offline front end: `generate` adds every prompt and steps until all have finished; `chat` formats
conversations with the tokenizer's chat template first. The API mirrors vLLM's.

Not thread-safe: one thread owns an engine and makes every call on it (add_request, step,
abort_request). Two threads in `step()` corrupt the bookkeeping, and an abort that lands inside a
step breaks it. A server runs the engine loop in one thread and hands it requests and aborts
through a queue.
"""
from __future__ import annotations

import itertools
import os
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from nanoserve.batch import Batch, build_batch, samples_now
from nanoserve.config import Config, cdiv
from nanoserve.detokenizer import Detokenizer
from nanoserve.model_runner import ModelRunner
from nanoserve.models.llama import read_config
from nanoserve.parallel import check_tensor_parallel
from nanoserve.sampler import InvalidRequest, SamplingParams, is_int
from nanoserve.scheduler import Scheduler
from nanoserve.sequence import Sequence

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]         # the completion
    text: str | None             # the completion decoded, when the model has a tokenizer
    finish_reason: str           # "stop" | "length" | "abort"
    num_cached_tokens: int       # prompt tokens served from the prefix cache
    ttft: float | None           # seconds from arrival to the first output token
    latency: float               # seconds from arrival to finish


@dataclass
class RequestDelta:
    """What one request produced in one step, for streaming. A request's deltas concatenate to its
    RequestOutput's token_ids and text; its last delta has the finish_reason (an abort has none)."""
    request_id: str
    token_ids: list[int]         # the token sampled this step
    text: str | None             # its new text; may be "" (held back), None without a tokenizer
    finish_reason: str | None    # None until the request's last delta


@dataclass
class StepResult:
    batch: Batch | None                  # the flat batch the model ran (None if nothing ran)
    scheduled: list[tuple[str, int]]     # (request_id, num_tokens) in batch order
    decode_ids: list[str]                # the requests that decoded (one token past the prompt);
                                         # the others ran a prefill chunk
    outputs: list[RequestOutput]         # requests that finished in this step
    deltas: list[RequestDelta]           # one per request that sampled a token, in batch order

    @property
    def num_decode_tokens(self) -> int:
        return len(self.decode_ids)

    @property
    def num_prefill_tokens(self) -> int:
        return 0 if self.batch is None else self.batch.input_ids.numel() - len(self.decode_ids)


class LLMEngine:
    """The serving loop: requests in (`add_request`), one step of continuous batching at a time
    (`step`), finished requests out (`StepResult.outputs`). Every request that was accepted comes
    out exactly once in some step's outputs, an aborted one too (in the step after the abort).
    Not thread-safe: see the module docstring."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        hf_config = read_config(config.model)
        self.max_model_len = config.max_model_len or hf_config.max_position_embeddings
        if self.max_model_len > hf_config.max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's "
                             f"max_position_embeddings={hf_config.max_position_embeddings}")
        # A block longer than the longest request wastes most of its slots; 256 (flash-attn's page) always fits.
        if config.block_size > max(self.max_model_len, 256):
            raise ValueError(f"block_size={config.block_size} is larger than max_model_len={self.max_model_len} "
                             f"and than 256, flash-attn's page size")
        check_tensor_parallel(config.tensor_parallel_size, hf_config, self.device)
        self.model_runner = ModelRunner(config, self.device, self.max_model_len)
        try:  # with tensor parallelism, a failure from here on must stop the workers just started
            self.vocab_size = self.model_runner.model.vocab_size
            num_blocks = self.model_runner.num_blocks
            if num_blocks - 1 < cdiv(self.max_model_len, config.block_size):
                raise ValueError(
                    f"the KV cache has {num_blocks - 1} usable blocks of {config.block_size} slots "
                    f"({(num_blocks - 1) * config.block_size} tokens), too few for one request of "
                    f"max_model_len={self.max_model_len} tokens: raise num_kvcache_blocks or lower max_model_len")
            self.tokenizer = load_tokenizer(config.model)
            self.scheduler = Scheduler(config, num_blocks, self.max_model_len, read_eos_token_ids(config.model, hf_config))
            self.requests: dict[str, Sequence] = {}  # unfinished requests by id
            self.aborted: list[RequestOutput] = []   # aborted since the last step, reported by the next
            self.request_counter = itertools.count()
        except BaseException:
            self.model_runner.close()
            raise

    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Validate and queue one request; returns its id. Bad input raises ValueError here,
        before anything is queued, so the other requests are never disturbed. `arrival_time`
        (time.perf_counter()) is when the request arrived, if earlier than now: TTFT and latency count
        from it (a server passes the time its HTTP request came in, so its own queue wait counts)."""
        params = sampling_params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequest("sampling_params", f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if request_id is None:  # the next number that no caller has taken as an id
            request_id = next(i for i in map(str, self.request_counter) if i not in self.requests)
        if not isinstance(request_id, str):
            raise InvalidRequest("request_id", f"request_id must be a str, got {type(request_id).__name__}")
        if request_id in self.requests:
            raise InvalidRequest("request_id", f"request_id {request_id!r} is already in use")
        token_ids = self.tokenize(prompt)
        if len(token_ids) > self.max_model_len:
            raise InvalidRequest("prompt", f"prompt has {len(token_ids)} tokens, more than max_model_len={self.max_model_len}")
        bad = [t for t in params.stop_token_ids or () if t >= self.vocab_size]
        if bad:
            raise InvalidRequest("stop_token_ids", f"stop_token_ids {bad[:5]} are outside [0, vocab_size={self.vocab_size})")
        detokenizer = Detokenizer(self.tokenizer, params.stop or ()) if self.tokenizer else None
        seq = Sequence(request_id, prompt if isinstance(prompt, str) else None, token_ids, params, detokenizer)
        if arrival_time is not None:
            seq.arrival_time = arrival_time
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequest("prompt", f"prompt is a string but {self.config.model} has no tokenizer; pass token ids")
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError as error:  # a lone surrogate such as "\ud800"
                raise InvalidRequest("prompt", f"prompt is not valid Unicode text: {error}") from None
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)) and all(is_int(t) for t in prompt):
            token_ids = [int(t) for t in prompt]  # numpy ints too
        else:
            raise InvalidRequest("prompt", "prompt must be a string or a list of int token ids")
        if not token_ids:
            raise InvalidRequest("prompt", "prompt is empty")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest("prompt", f"token ids {bad[:5]} are outside [0, vocab_size={self.vocab_size})")
        return token_ids

    def abort_request(self, request_id: str) -> RequestOutput:
        """Stop a request in any state, between steps; its blocks come back at once. Returns its
        output (finish_reason "abort"), which the next step's outputs also report."""
        seq = self.requests.pop(request_id, None) if isinstance(request_id, str) else None
        if seq is None:
            raise ValueError(f"no unfinished request with id {request_id!r}")
        self.scheduler.finish(seq, "abort")
        self.aborted.append(self.make_output(seq))
        return self.aborted[-1]

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (see parallel.py); the engine serves no more."""
        self.model_runner.close()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> dict[str, int]:
        """For monitoring: requests waiting and running and free KV blocks now; since start, the
        preemptions and the prompt tokens served from the prefix cache."""
        scheduler = self.scheduler
        return dict(num_waiting=len(scheduler.waiting), num_running=len(scheduler.running),
                    num_free_blocks=scheduler.block_manager.num_free_blocks,
                    num_preemptions=scheduler.num_preemptions, num_cached_tokens=scheduler.num_cached_tokens)

    def assert_invariants(self) -> None:
        """Every unfinished request is in exactly one of the scheduler's queues, and the
        scheduler's and block manager's invariants hold (see there). For tests."""
        queued = {seq.request_id: seq for seq in [*self.scheduler.waiting, *self.scheduler.running]}
        assert queued == self.requests, f"queued {sorted(queued)} != unfinished {sorted(self.requests)}"
        self.scheduler.assert_invariants()

    def step(self) -> StepResult:
        """One turn of continuous batching: schedule -> build_batch -> forward + sample -> update.
        Every unfinished request whose turn it is gets its next prefill chunk or decode token."""
        aborted, self.aborted = self.aborted, []
        scheduled = self.scheduler.schedule()
        if not scheduled:
            if self.has_unfinished_requests():
                raise RuntimeError("scheduler made no progress with requests waiting")  # a bug, never expected
            return StepResult(None, [], [], aborted, [])
        decode_ids = [seq.request_id for seq, n in scheduled if n == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens]
        batch = build_batch(scheduled, self.config.block_size, self.device)
        sampling = [seq for seq, n in scheduled if samples_now(seq, n)]
        sampled = self.model_runner.run(batch, sampling)
        finished = self.scheduler.update(scheduled, sampled)  # appends the tokens, stops, frees
        for seq in finished:
            del self.requests[seq.request_id]
        return StepResult(batch, [(seq.request_id, n) for seq, n in scheduled], decode_ids,
                          aborted + [self.make_output(seq) for seq in finished],
                          [self.make_delta(seq) for seq in sampling])

    def make_delta(self, seq: Sequence) -> RequestDelta:
        """seq's token of this step and the text it settled (see detokenizer.py)."""
        text = None if seq.detokenizer is None else seq.detokenizer.take_delta(seq.is_finished)
        return RequestDelta(seq.request_id, [seq.token_ids[-1]], text, seq.finish_reason)

    def make_output(self, seq: Sequence) -> RequestOutput:
        text = seq.detokenizer.text if seq.detokenizer else None
        ttft = seq.first_token_time - seq.arrival_time if seq.first_token_time is not None else None
        return RequestOutput(seq.request_id, seq.prompt, seq.token_ids[:seq.num_prompt_tokens],
                             seq.output_token_ids, text, seq.finish_reason, seq.num_cached_tokens or 0,
                             ttft, seq.finish_time - seq.arrival_time)


class LLM:
    """Offline inference: `LLM(model_path, **config).generate(prompts, sampling_params)`."""

    def __init__(self, model: str, **config: object) -> None:
        self.engine = LLMEngine(Config.from_kwargs(model, **config))

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
        string or a list of token ids) is served as a list of one. A request aborted meanwhile
        (through llm.engine, between steps) comes back with finish_reason "abort". If anything
        fails, its requests are aborted before the error propagates: the engine is left idle."""
        prompts = as_prompt_list(prompts)
        if self.engine.has_unfinished_requests():
            raise ValueError("LLM.generate needs an idle engine: requests added to llm.engine are "
                             "served by calling llm.engine.step() until they finish")
        if not isinstance(sampling_params, (list, tuple)):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"{len(sampling_params)} sampling_params for {len(prompts)} prompts")
        ids: list[str] = []
        try:
            for prompt, params in zip(prompts, sampling_params):
                ids.append(self.engine.add_request(prompt, params))
            return self.run_until_done(ids, use_tqdm)
        except BaseException:  # a bad prompt, an error in a step, Ctrl-C: leave the engine idle
            for request_id in ids:
                if request_id in self.engine.requests:
                    self.engine.abort_request(request_id)
            self.engine.aborted.clear()  # these aborts are reported by raising, not by a step
            raise

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of them: each is formatted
        by the tokenizer's chat template, ending with the assistant's turn to speak, then served as by
        `generate`. The template writes any special tokens (<s>), so encode adds none."""
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

    def run_until_done(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        """Step until every request in `ids` has an output; they are in input order."""
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
            bar.update(len(outputs) - bar.n)
        bar.close()
        return [outputs[request_id] for request_id in ids]


def as_prompt_list(prompts: object) -> list[str] | list[list[int]]:
    """generate's prompts as a list: one prompt (a string or a list of token ids) becomes a list
    of one; a list or tuple of prompts stays as it is (each is checked by add_request)."""
    if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts
                                    and all(is_int(t) for t in prompts)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError(f"prompts must be a string, a list of token ids, or a list of those; "
                         f"got {type(prompts).__name__}")
    return list(prompts)


def resolve_device(name: str | None) -> torch.device:
    """Config's device -> torch.device. None picks CUDA where there is one, else the CPU; "mps"
    (Apple GPUs) runs the torch attention backend. A device this machine lacks is a ValueError."""
    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"device {name!r} is not a device name such as 'cpu', 'cuda', 'cuda:1' or 'mps'") from None
    available = {"cpu": True, "cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}
    if not available.get(device.type, False):
        raise ValueError(f"device {name!r} is not available on this machine (supported: cpu, cuda, mps)")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def read_eos_token_ids(path: str, hf_config: PretrainedConfig) -> set[int]:
    """EOS ids from config.json and, where present, generation_config.json (Llama 3 Instruct
    lists its end-of-turn token only there)."""
    from transformers import GenerationConfig
    ids = [hf_config.eos_token_id]
    if os.path.isfile(os.path.join(path, "generation_config.json")):
        ids.append(GenerationConfig.from_pretrained(path).eos_token_id)
    return {i for eos in ids for i in (eos if isinstance(eos, list) else [eos]) if i is not None}


def load_tokenizer(path: str) -> PreTrainedTokenizerBase | None:
    """The folder's tokenizer, or None if it has none (then prompts must be token ids)."""
    if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)
