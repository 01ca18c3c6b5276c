"""What the engine hands back:
- a finished request's `RequestOutput`;
- a step's `RequestDelta`s, for streaming;
- the `StepResult` that carries both, plus the step's `Batch`, for tracing.

Invariants:
- A request's deltas concatenate to its RequestOutput's token_ids and text.
- Its last delta carries the finish_reason. An aborted request's output has none before it.
  A failed one's (finish_reason "error") has no delta for its last, void, token.
"""

from dataclasses import dataclass

from nanoserve.batch import Batch
from nanoserve.sampler import TokenLogprobs
from nanoserve.sequence import Sequence


@dataclass
class CompletionOutput:
    """One completion of a prompt (`SamplingParams.n` of them make a RequestOutput's `outputs`)."""
    index: int                   # which of the n completions
    text: str | None             # the completion decoded, when the model has a tokenizer
    token_ids: list[int]
    finish_reason: str           # "stop" | "length" | "abort" | "error" (the request failed alone: RequestOutput.error)
    logprobs: list[TokenLogprobs] | None = None  # per token, with SamplingParams.logprobs


@dataclass
class RequestOutput:
    """A finished (or aborted) request, as vLLM's: its prompt and its completions (`outputs`)."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int       # prompt tokens served from the prefix cache
    ttft: float | None           # seconds from arrival to the first output token; None if none came
    latency: float               # seconds from arrival to finish
    # With SamplingParams.prompt_logprobs: per prompt token, None for the first (nothing predicts it).
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # finish_reason "error": why it failed alone (an InvalidRequest naming the field, when its input caused it,
    # such as a grammar with no valid output); its tokens are void. LLM.generate raises it; a server answers it.
    error: Exception | None = None

    # The first (with n=1, the only) completion's text, token ids and finish reason.
    text = property(lambda self: self.outputs[0].text)
    token_ids = property(lambda self: self.outputs[0].token_ids)
    finish_reason = property(lambda self: self.outputs[0].finish_reason)


@dataclass
class RequestDelta:
    """What one request produced in one step, for streaming."""
    request_id: str
    token_ids: list[int]         # the tokens sampled this step: one, or more with speculative decoding
    text: str | None             # its new text; may be "" (held back), None without a tokenizer
    finish_reason: str | None    # None until the request's last delta
    logprobs: list[TokenLogprobs] | None = None  # per token, with SamplingParams.logprobs
    # With SamplingParams.prompt_logprobs, on the request's first delta (as vLLM streams them): a server echoing
    # the prompt with its logprobs sends them before the first token.
    prompt_logprobs: list[TokenLogprobs | None] | None = None


@dataclass
class StepResult:
    batch: Batch | None                  # the flat batch the model ran (None if nothing ran)
    scheduled: list[tuple[str, int]]     # (request_id, num_tokens) in batch order
    decode_ids: list[str]                # the requests that decoded (one token past the prompt, and drafts);
                                         # the others ran a prefill chunk
    outputs: list[RequestOutput]         # requests that finished in this step, or were aborted since the last
    deltas: list[RequestDelta]           # one per request that sampled a token, in batch order

    @property
    def num_decode_tokens(self) -> int:
        """Decode tokens, draft tokens (spec_decode.py) included."""
        decode_ids = set(self.decode_ids)
        return sum(n for request_id, n in self.scheduled if request_id in decode_ids)

    @property
    def num_prefill_tokens(self) -> int:
        return 0 if self.batch is None else self.batch.input_ids.numel() - self.num_decode_tokens


def request_output(seq: Sequence) -> RequestOutput:
    """A finished (or aborted) request's output."""
    text = seq.detokenizer.text if seq.detokenizer else None
    ttft = seq.first_token_time - seq.arrival_time if seq.first_token_time is not None else None
    logprobs = seq.logprobs if seq.params.logprobs is not None else None
    # A copy: requests with the same prompt share one list, which grows while any of them runs (scheduler.py)
    prompt_logprobs = list(seq.prompt_logprobs) if seq.params.prompt_logprobs is not None else None
    completion = CompletionOutput(0, text, seq.output_token_ids, seq.finish_reason, logprobs)
    return RequestOutput(seq.request_id, seq.prompt, seq.token_ids[:seq.num_prompt_tokens], [completion],
                         seq.num_cached_tokens or 0, ttft, seq.finish_time - seq.arrival_time, prompt_logprobs,
                         seq.error)


def request_delta(seq: Sequence, num_tokens_before: int) -> RequestDelta:
    """seq's tokens of this step, and the text they settled (see detokenizer.py).
    They are those after its first `num_tokens_before`: one, or more with speculative decoding."""
    text = None if seq.detokenizer is None else seq.detokenizer.take_delta(seq.is_finished)
    num_output_before = num_tokens_before - seq.num_prompt_tokens
    logprobs = seq.logprobs[num_output_before:] if seq.params.logprobs is not None else None
    prompt_logprobs = (list(seq.prompt_logprobs) if num_output_before == 0 and seq.params.prompt_logprobs is not None
                       else None)
    return RequestDelta(seq.request_id, seq.token_ids[num_tokens_before:], text, seq.finish_reason, logprobs,
                        prompt_logprobs)
