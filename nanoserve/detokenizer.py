"""Incremental detokenization: one request's output text, grown one token at a time for streaming.

Invariant: every delta is text that will never change. So the deltas of a request concatenate to
its final `RequestOutput.text`. Two kinds of text are held back until they are settled:
- A character whose bytes are split across tokens (byte-level BPE). `DecodeStream` returns nothing
  until the character is complete. So a stream never shows a half character as U+FFFD.
- The end of the text that could be the beginning of a stop string. It may yet be cut off.
Knuth-Morris-Pratt's automaton says how long that end is. For each stop string, `matched` holds the
length of its longest beginning that ends the text. It is updated from the new characters alone.
So a token costs the same however long the text and the stop strings are.
"""

from tokenizers.decoders import DecodeStream
from transformers import PreTrainedTokenizerBase


class Detokenizer:
    """`text` is the output decoded so far; its first `num_sent` characters were streamed."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: tuple[str, ...], include_stop: bool = False,
                 min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.stream = DecodeStream(skip_special_tokens=True)  # decodes the output, never the prompt
        self.stop = stop
        self.tables = [kmp_table(s) for s in stop]
        self.matched = [0] * len(stop)  # per stop string: the length of its longest beginning that ends text
        self.text = ""
        self.num_sent = 0
        self.stopped = False  # text was cut before a stop string (after it, with include_stop): it is final
        self.include_stop = include_stop
        self.tokens_to_skip = min_tokens  # stop strings count from the min_tokens-th token's text on (as vLLM's)

    def add(self, token: int) -> bool:
        """Decode one more token; True if the text now holds a stop string. It is cut before the
        one that starts first, of those that end in this token's text."""
        old_len, new = len(self.text), self.stream.step(self.tokenizer.backend_tokenizer, token) or ""
        self.text += new
        self.tokens_to_skip -= 1
        # A stop string absent before this token must end in its new text: search only there.
        found = [(i, len(s)) for s in self.stop if (i := self.text.find(s, max(old_len - len(s) + 1, 0))) >= 0]
        if found and self.tokens_to_skip <= 0:
            start, length = min(found)
            self.text, self.stopped = self.text[:start + length * self.include_stop], True
        else:  # no stop string counts (yet): the matches follow the text
            self.matched = [advance(s, table, k, new) for s, table, k in zip(self.stop, self.tables, self.matched)]
        return self.stopped

    def finish(self, output_token_ids: list[int]) -> None:
        """At the end, without a stop string, decode the whole output at once, exactly as
        `tokenizer.decode` writes it. Incomplete characters are included, as U+FFFD."""
        if not self.stopped:
            self.text = self.tokenizer.decode(output_token_ids, skip_special_tokens=True)

    def take_delta(self, finished: bool) -> str:
        """The settled text not yet sent; while running, without an end that begins a stop string."""
        end = len(self.text) - (0 if finished else max(self.matched, default=0))
        delta, self.num_sent = self.text[self.num_sent:end], max(end, self.num_sent)
        return delta


def advance(s: str, table: list[int], k: int, new: str) -> int:
    """Given that s[:k] ends a text, the length of s's longest beginning that ends the text + new.
    Here k <= len(s). k is all of s when the stop string came before min_tokens, and did not count."""
    for char in new:
        # s[:k] cannot grow by char (or is all of s): fall back to its longest end that begins s
        while k == len(s) or k and s[k] != char:
            k = table[k - 1]
        k += s[k] == char
    return k


def kmp_table(s: str) -> list[int]:
    """Knuth-Morris-Pratt's failure function. table[j] is the length of the longest beginning of s that
    ends s[:j + 1] and is shorter than it. It is built by running the automaton over s itself."""
    table = [0] * len(s)
    for j in range(1, len(s)):
        table[j] = advance(s, table, table[j - 1], s[j])
    return table
