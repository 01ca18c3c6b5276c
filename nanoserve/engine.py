"""The engine: the loop that ties scheduler, model runner and block manager together.

`LLMEngine.step()` is one turn of continuous batching:
    schedule -> build_batch -> model forward + sample -> update (append tokens, stop, free blocks)
Requests can be added and aborted between any two steps. Each step streams a `RequestDelta` for
every request that sampled a token. Its new text is settled (see detokenizer.py). The step also reports
the requests that finished (outputs.py). As in vLLM, it has two front ends:
- `LLM` (entrypoints/llm.py), offline;
- `AsyncLLM` (entrypoints/async_llm.py), for asyncio. The HTTP server (entrypoints/openai/) is built on it.

Not thread-safe: one thread owns an engine and makes every call on it (add_request, step,
abort_request). Two threads in `step()` corrupt the bookkeeping, and an abort that lands inside a
step breaks it. AsyncLLM runs the engine loop in one thread and hands it requests and aborts
through a queue.
"""

import itertools

from nanoserve.batch import build_batch, samples_now
from nanoserve.config import Config, cdiv
from nanoserve.detokenizer import Detokenizer
from nanoserve.device import resolve_device
from nanoserve.distributed import check_tensor_parallel
from nanoserve.model_runner import ModelRunner
from nanoserve.models.families import check_max_model_len
from nanoserve.models.loader import read_checkpoint
from nanoserve.outputs import RequestOutput, StepResult, request_delta, request_output
from nanoserve.sampling_params import InvalidRequest, SamplingParams, require, uses_processors
from nanoserve.scheduler import Scheduler
from nanoserve.seams import Seams
from nanoserve.sequence import Sequence
from nanoserve.sliding_window import blocks_window
from nanoserve.tokenizer import load_tokenizer, tokenize


class LLMEngine:
    """The serving loop. Requests go in (`add_request`). It runs one step of continuous batching at a time
    (`step`). Finished requests come out (`StepResult.outputs`).

    Every request that was accepted comes out exactly once in some step's outputs. An aborted one does too,
    in the step after the abort. It is not thread-safe (see the module docstring). This is the core alone,
    unless `seams` (seams.py) plug extensions in. `nanoserve.LLMEngine` (composition.py) is this engine
    with the extensions its config asks for."""

    def __init__(self, config: Config, seams: Seams = Seams()) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        checkpoint = read_checkpoint(config.model)  # config.json, read once: the runner gets it too
        hf_config = checkpoint.config
        self.max_model_len = config.max_model_len or hf_config.max_position_embeddings
        check_max_model_len(hf_config, self.max_model_len)
        # A block longer than the longest request wastes most of its slots; 256 (flash-attn's page) always fits.
        if config.block_size != "auto" and config.block_size > max(self.max_model_len, 256):
            raise ValueError(f"block_size={config.block_size} is larger than max_model_len={self.max_model_len} "
                             f"and than 256, flash-attn's page size")
        check_tensor_parallel(config.tensor_parallel_size, hf_config, self.device)
        runner = ModelRunner if config.tensor_parallel_size == 1 else seams.tensor_parallel  # parallel.py's
        self.model_runner = runner(config, self.device, self.max_model_len, checkpoint, seams=seams)
        try:  # with tensor parallelism, a failure from here on must stop the workers just started
            self.vocab_size = hf_config.vocab_size
            num_blocks, self.block_size = self.model_runner.num_blocks, self.model_runner.block_size
            if num_blocks - 1 < cdiv(self.max_model_len, self.block_size):
                raise ValueError(
                    f"the KV cache has {num_blocks - 1} usable blocks of {self.block_size} slots "
                    f"({(num_blocks - 1) * self.block_size} tokens), too few for one request of "
                    f"max_model_len={self.max_model_len} tokens: raise num_kvcache_blocks or lower max_model_len")
            self.tokenizer = load_tokenizer(config.model)
            eos_token_ids = self.model_runner.eos_token_ids  # read once, by the runner (min_tokens bans them)
            self.scheduler = Scheduler(config, num_blocks, self.block_size, self.max_model_len, eos_token_ids,
                                       seams.drafter, blocks_window(hf_config))
            self.grammars = seams.grammars and seams.grammars(self.tokenizer, self.vocab_size, eos_token_ids)
            self.requests: dict[str, Sequence] = {}  # unfinished requests by id
            self.aborted: list[RequestOutput] = []   # aborted or failed since the last step: the next reports them
            self.request_counter = itertools.count()
        except BaseException:
            self.model_runner.close()
            raise

    def add_request(self, prompt: str | list[int], sampling_params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Validate and queue one request; returns its id.

        Bad input raises ValueError (InvalidRequest, naming the parameter) here, before anything is queued.
        So the other requests are never disturbed. `arrival_time` (time.perf_counter()) is when the request
        arrived, if earlier than now. TTFT and latency count from it. A server passes the time its HTTP
        request came in, so its own queue wait counts."""
        params = sampling_params or SamplingParams()
        require(isinstance(params, SamplingParams), "sampling_params", type(params).__name__, "a SamplingParams")
        if request_id is None:  # the next number that no caller has taken as an id
            request_id = next(i for i in map(str, self.request_counter) if i not in self.requests)
        require(isinstance(request_id, str), "request_id", type(request_id).__name__, "a str")
        if request_id in self.requests:
            raise InvalidRequest("request_id", f"request_id {request_id!r} is already in use")
        if params.n != 1:
            raise InvalidRequest("n", f"n={params.n}: LLMEngine.add_request serves one completion; LLM.generate and "
                                      "the server add n requests, one per SamplingParams.for_sample(i)")
        token_ids = tokenize(prompt, self.tokenizer)
        # Every token id the request names must be a row of the model's embedding and of its logits
        for name, ids in (("prompt", token_ids), ("stop_token_ids", params.stop_token_ids or ()),
                          ("logit_bias", params.logit_bias or ())):
            if bad := [t for t in ids if not 0 <= t < self.vocab_size]:
                raise InvalidRequest(name, f"{name} {bad[:5]} are outside [0, vocab_size={self.vocab_size})")
        if len(token_ids) > self.max_model_len:
            raise InvalidRequest("prompt", f"prompt has {len(token_ids)} tokens, more than "
                                           f"max_model_len={self.max_model_len}")
        if uses_processors(params) and self.grammars is None:
            raise InvalidRequest("sampling_params", "penalties, logit_bias, min_tokens and structured_outputs need "
                                                    "the logits processors, which this engine was built without")
        detokenizer = Detokenizer(self.tokenizer, params.stop or (), params.include_stop_str_in_output,
                                  params.min_tokens) if self.tokenizer else None
        grammar = self.grammars.compile(params.structured_outputs) if params.structured_outputs else None
        seq = Sequence(request_id, prompt if isinstance(prompt, str) else None, token_ids, params, detokenizer, grammar,
                       arrival_time)
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput:
        """Stop a request in any state, between steps. Its blocks come back at once. Returns its output
        (finish_reason "abort"), which the next step's outputs also report."""
        seq = self.requests.pop(request_id, None) if isinstance(request_id, str) else None
        if seq is None:
            raise ValueError(f"no unfinished request with id {request_id!r}")
        self.scheduler.finish(seq, "abort")
        self.aborted.append(request_output(seq))
        return self.aborted[-1]

    def fail_request(self, seq: Sequence, error: Exception) -> None:
        """End a waiting request that failed alone, because its grammar did not compile.
        Its output has finish_reason "error" and `error`. This step reports it (step takes `aborted`
        after the poll)."""
        seq.error = error
        del self.requests[seq.request_id]
        self.scheduler.finish(seq, "error")
        self.aborted.append(request_output(seq))

    def discard(self, request_ids: list[str]) -> None:
        """Abort these requests, if unfinished, without reporting them in a later step.
        It is for a caller that reports the failure itself (LLM.generate raising). No output is left behind."""
        for request_id in request_ids:
            if request_id in self.requests:
                self.scheduler.finish(self.requests.pop(request_id), "abort")

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (see parallel.py). The engine serves no more."""
        self.model_runner.close()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def stats(self) -> dict[str, int | list[int]]:
        """Counters for monitoring.
        - Now: requests waiting and running, and free KV blocks.
        - Since start: the preemptions and the prompt tokens served from the prefix cache.
        - With speculative decoding, its counters too (spec_decode.py)."""
        scheduler = self.scheduler
        spec = scheduler.spec.stats() if scheduler.spec else {}
        return dict(num_waiting=len(scheduler.waiting), num_running=len(scheduler.running),
                    num_free_blocks=scheduler.block_manager.num_free_blocks,
                    num_preemptions=scheduler.num_preemptions, num_cached_tokens=scheduler.num_cached_tokens, **spec)

    def assert_invariants(self) -> None:
        """Every unfinished request is in exactly one of the scheduler's queues, and the
        scheduler's and block manager's invariants hold (see there). For tests."""
        queued = {seq.request_id: seq for seq in [*self.scheduler.waiting, *self.scheduler.running]}
        assert queued == self.requests, f"queued {sorted(queued)} != unfinished {sorted(self.requests)}"
        self.scheduler.assert_invariants()

    def step(self) -> StepResult:
        """One turn of continuous batching: schedule -> build_batch -> forward + sample -> update.
        Every unfinished request whose turn it is gets its next prefill chunk or decode token."""
        scheduled = self.scheduler.schedule()
        # Nothing to run is no bug with only requests whose grammar compiles (WAITING_FOR_GRAMMAR) left
        if not scheduled and (self.scheduler.running or self.scheduler.next_ready() is not None):
            raise RuntimeError("scheduler made no progress with requests waiting")  # a bug, never expected
        if self.grammars is not None:  # end requests whose grammar failed; idle, wait a little for a compile
            self.grammars.poll(self.scheduler.waiting, not scheduled, self.fail_request)
        aborted, self.aborted = self.aborted, []  # after poll: a request it failed is reported in this step
        if not scheduled:
            return StepResult(None, [], [], aborted, [])
        decode_ids = [s.request_id for s, n in scheduled
                      if n == 1 + len(s.spec_token_ids) and s.num_computed_tokens >= s.num_prompt_tokens]
        batch = build_batch(scheduled, self.block_size, self.device)
        sampling = [(seq, seq.num_tokens) for seq, n in scheduled if samples_now(seq, n)]  # tokens before this step
        finished = self.scheduler.update(scheduled, self.model_runner.run(batch, scheduled))  # appends, stops, frees
        for seq in finished:
            del self.requests[seq.request_id]
        return StepResult(batch, [(seq.request_id, n) for seq, n in scheduled], decode_ids,
                          aborted + [request_output(seq) for seq in finished],
                          [request_delta(seq, num_tokens) for seq, num_tokens in sampling if seq.error is None])
