"""Incremental detokenization: one request's output text, grown one token at a time for streaming.

Invariant: every delta is text that will never change, so the deltas of a request concatenate to
its final `RequestOutput.text`. Two kinds of text are held back until they are settled:
- a character whose bytes are split across tokens (byte-level BPE): `DecodeStream` returns
  nothing until the character is complete, so a stream never shows a half character as U+FFFD;
- the end of the text that could be the beginning of a stop string: it may yet be cut off.
"""
from __future__ import annotations

from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase


class Detokenizer:
    """`text` is the output decoded so far; its first `num_sent` characters were streamed."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: tuple[str, ...]) -> None:
        self.tokenizer = tokenizer
        self.stream = DecodeStream(skip_special_tokens=True)  # decodes the output, never the prompt
        self.stop = stop
        self.text = ""
        self.num_sent = 0
        self.stopped = False  # text was cut before a stop string: it is final

    def add(self, token: int) -> bool:
        """Decode one more token; True if the text now holds a stop string (it is cut before it)."""
        old_len = len(self.text)
        self.text += self.stream.step(self.tokenizer.backend_tokenizer, token) or ""
        # A stop string absent before this token must end in its new text: search only there.
        found = [i for s in self.stop if (i := self.text.find(s, max(old_len - len(s) + 1, 0))) >= 0]
        if found:
            self.text, self.stopped = self.text[:min(found)], True
        return self.stopped

    def finish(self, output_token_ids: list[int]) -> None:
        """At the end, without a stop string: the whole output decoded at once, incomplete
        characters included (as U+FFFD), exactly as `tokenizer.decode` writes it."""
        if not self.stopped:
            self.text = self.tokenizer.decode(output_token_ids, skip_special_tokens=True)

    def take_delta(self, finished: bool) -> str:
        """The settled text not yet sent; while running, without an end that begins a stop string."""
        end = len(self.text) if finished else len(self.text) - stop_prefix_len(self.text, self.stop)
        delta, self.num_sent = self.text[self.num_sent:end], max(end, self.num_sent)
        return delta


def stop_prefix_len(text: str, stop: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is the beginning of a stop string ("Mr" for "Mrs.")."""
    return max((k for s in stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
