"""A request body's sampling fields as the engine's SamplingParams, checked (a 400 names the field).

Both APIs read their bodies through `sampling_params`. OpenAI's logit_bias and response_format, and
vLLM's structured_outputs, are turned into SamplingParams' terms here.
"""
from __future__ import annotations

import math

from nanoserve import SamplingParams
from nanoserve.entrypoints.openai.protocol import APIError, Limits, SamplingBody, given, shorten
from nanoserve.entrypoints.openai.serving_engine import API
from nanoserve.extensions.structured_outputs import StructuredOutputsParams
from nanoserve.sampling_params import InvalidRequest


def sampling_params(body: SamplingBody, api: API, max_tokens: int | None, limits: Limits) -> SamplingParams:
    """The body's SamplingParams, checked by SamplingParams itself (a 400 names the field).

    max_tokens None means up to the end of the context (chat). It is settled once the prompt is tokenized
    (`fit_to_context`)."""
    n = given(body.n, 1)
    if not 1 <= n <= limits.max_n:  # SamplingParams takes any n >= 1: this server bounds one request's work
        raise APIError(f"n must be from 1 to {limits.max_n}, this server's limit; got {n}", param="n")
    logprobs, prompt_logprobs = api.logprobs(body)
    stop = [body.stop] if isinstance(body.stop, str) else body.stop or []
    for name, values in ("stop", stop), ("stop_token_ids", body.stop_token_ids or []):
        if len(values) > limits.max_stop:
            raise APIError(f"{name} has {len(values)} entries; this server takes at most {limits.max_stop}", param=name)
    if any(len(s) > limits.max_stop_chars for s in stop):
        raise APIError(f"a stop string is longer than {limits.max_stop_chars} characters, this server's limit",
                       param="stop")
    min_tokens = given(body.min_tokens, 0)
    try:  # max_tokens None is settled later: until then at least min_tokens
        return SamplingParams(temperature=given(body.temperature, 1.0), top_p=given(body.top_p, 1.0),
                              top_k=given(body.top_k, 0), max_tokens=given(max_tokens, max(1, min_tokens)),
                              stop=stop or None, stop_token_ids=body.stop_token_ids or None, seed=body.seed,
                              ignore_eos=bool(body.ignore_eos), n=n, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                              frequency_penalty=given(body.frequency_penalty, 0.0),
                              presence_penalty=given(body.presence_penalty, 0.0),
                              repetition_penalty=given(body.repetition_penalty, 1.0), min_p=given(body.min_p, 0.0),
                              logit_bias=logit_bias(body.logit_bias), min_tokens=min_tokens,
                              include_stop_str_in_output=bool(body.include_stop_str_in_output),
                              structured_outputs=structured_outputs(body, limits))
    except InvalidRequest as error:
        raise APIError(str(error), param=grammar_field(body) if error.param == "structured_outputs" else error.param) \
            from None


def logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias, {"token id": bias}, as SamplingParams takes it.

    Ids are in ASCII decimal: "²" and "٣" are digits to str.isdigit, not to OpenAI. Ids have at most 10
    digits, since int() of 5,000 digits raises. Biases are finite, and clamped to [-100, 100] as vLLM does.
    Ids past the vocabulary are refused by add_request."""
    if not bias:
        return None
    if bad := [key for key in bias if not (key.isascii() and key.isdigit() and len(key) <= 10)]:
        raise APIError(f"logit_bias keys must be token ids in decimal, got {shorten(repr(bad[:5]))}",
                       param="logit_bias")
    if bad := [value for value in bias.values() if not math.isfinite(value)]:
        raise APIError(f"logit_bias values must be finite numbers, got {bad[:5]}", param="logit_bias")
    return {int(key): min(100.0, max(-100.0, value)) for key, value in bias.items()}


def grammar_field(body: SamplingBody) -> str:
    """The field that asked for structured outputs: an error about the grammar names it."""
    return "structured_outputs" if body.structured_outputs is not None else "response_format"


def structured_outputs(body: SamplingBody, limits: Limits) -> StructuredOutputsParams | None:
    """vLLM's structured_outputs extra, or OpenAI's response_format (json_object or json_schema), or None.

    Both is a 400: one kind of structured output per request, as vLLM. A spec past the limits is a 400
    before anything parses it (`Serving.compile_grammar`, in the tokenizer thread)."""
    response_format = body.response_format
    if response_format is not None and response_format.type == "text":
        response_format = None
    if body.structured_outputs is not None and response_format is not None:
        raise APIError("give one of response_format and structured_outputs, not both", param="structured_outputs")
    if body.structured_outputs is not None:
        spec = body.structured_outputs.model_dump(by_alias=True, exclude_none=True)
    elif response_format is None:
        return None
    elif response_format.type == "json_object":
        spec = dict(json_object=True)
    elif response_format.json_schema is None or response_format.json_schema.schema_ is None:
        raise APIError("response_format of type json_schema needs json_schema.schema", param="response_format")
    else:
        spec = dict(json=response_format.json_schema.schema_)
    return StructuredOutputsParams(**spec)
