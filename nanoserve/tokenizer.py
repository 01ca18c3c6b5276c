"""Text in: a model folder's tokenizer and end-of-sequence ids, and a prompt checked and turned into
token ids. (Text out, one token at a time, is detokenizer.py.)"""

import os

from transformers import AutoTokenizer, GenerationConfig, PretrainedConfig, PreTrainedTokenizerBase

from nanoserve.sampling_params import InvalidRequest, is_int

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def load_tokenizer(path: str) -> PreTrainedTokenizerBase | None:
    """The folder's tokenizer, or None if it has none (then prompts must be token ids)."""
    if not any(os.path.isfile(os.path.join(path, name)) for name in TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(path)


def read_eos_token_ids(path: str, hf_config: PretrainedConfig) -> set[int]:
    """EOS ids from config.json and, where present, generation_config.json (Llama 3 Instruct
    lists its end-of-turn token only there)."""
    ids = [hf_config.eos_token_id]
    if os.path.isfile(os.path.join(path, "generation_config.json")):
        ids.append(GenerationConfig.from_pretrained(path).eos_token_id)
    return {i for eos in ids for i in (eos if isinstance(eos, list) else [eos]) if i is not None}


def tokenize(prompt: str | list[int], tokenizer: PreTrainedTokenizerBase | None) -> list[int]:
    """A prompt (text, or token ids) as token ids. The engine checks that each is in the model's vocabulary."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidRequest("prompt", "prompt is a string but the model has no tokenizer; pass token ids")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as error:  # a lone surrogate such as "\ud800"
            raise InvalidRequest("prompt", f"prompt is not valid Unicode text: {error}") from None
        token_ids = tokenizer.encode(prompt)
    elif isinstance(prompt, (list, tuple)) and all(is_int(t) for t in prompt):
        token_ids = [int(t) for t in prompt]  # numpy ints too
    else:
        raise InvalidRequest("prompt", "prompt must be a string or a list of int token ids")
    if not token_ids:
        raise InvalidRequest("prompt", "prompt is empty")
    return token_ids
