"""Structured outputs: a grammar the output must follow (a JSON schema, a regex, a choice of strings, an
EBNF grammar), enforced one token at a time by a mask over the vocabulary, with xgrammar.

A request's grammar goes through three stages (docs/structured-outputs.md):
1. add_request parses the spec into an xgrammar Grammar (`GrammarCompiler.compile`): fast, and a spec
   the library rejects is a ValueError naming structured_outputs there, before anything is queued;
2. a background thread compiles it against the tokenizer's vocabulary (for each grammar state, which
   tokens may follow: the costly part). Compiled grammars are cached by spec. The scheduler admits the
   request only once its grammar is compiled; other requests run meanwhile;
3. each step, `apply_grammar_masks` fills one bitmask row per constrained request from its matcher (the
   grammar's state after the output so far) and sets the logits of the tokens outside it to -inf; the
   sampled token then advances the matcher (`RequestGrammar.accept`, from Sequence.append_token).
Invariant: a request's matcher has accepted exactly its output tokens. A preempted request keeps its
tokens and its matcher; recomputing the prompt samples nothing, so the matcher is not advanced twice.
The grammar ends with the stop token (EOS): once accepted, the matcher is terminated and the request
finishes with "stop".
"""
from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from nanoserve.sampler import InvalidRequest, require

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from nanoserve.sequence import Sequence

CACHE_SIZE = 256  # compiled grammars kept, the least recently asked for dropped first


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one of: `json`, a JSON schema (a dict, or its text); `json_object=True`, any JSON object;
    `regex`; `choice`, one of these strings; `grammar`, an EBNF grammar (xgrammar's, GBNF-like). vLLM's names."""
    json: dict | str | None = field(default=None, hash=False)
    regex: str | None = None
    choice: tuple[str, ...] | None = None  # a list is stored as a tuple
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        # given: anything but None (json={} is the schema of any JSON), and json_object only when True
        given = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) not in (None, False)]
        require(len(given) == 1, "structured_outputs", given, "one of json, regex, choice, grammar, json_object")
        require(self.json is None or isinstance(self.json, dict) or is_json(self.json), "structured_outputs",
                self.json, "a json schema as a dict or a str of JSON")
        for name in ("regex", "grammar"):
            require(getattr(self, name) is None or isinstance(getattr(self, name), str), "structured_outputs",
                    getattr(self, name), f"a str {name}")
        if self.choice is not None:
            require(isinstance(self.choice, (list, tuple)) and all(isinstance(c, str) for c in self.choice),
                    "structured_outputs", self.choice, "a choice given as a list of strs")
            object.__setattr__(self, "choice", tuple(self.choice))

    @property
    def key(self) -> str:
        """The spec as one string: the cache's key."""
        spec = json.loads(self.json) if isinstance(self.json, str) else self.json
        return json.dumps([spec, self.regex, self.choice, self.grammar, self.json_object], sort_keys=True)


def is_json(text: object) -> bool:
    try:
        return isinstance(text, str) and isinstance(json.loads(text), (dict, bool))
    except ValueError:
        return False


def parse_grammar(spec: StructuredOutputsParams) -> Any:
    """The spec as an xgrammar Grammar; a spec xgrammar rejects is an InvalidRequest naming structured_outputs.
    JSON has no free whitespace: a model that never saw JSON would pad it with spaces forever."""
    try:  # imported here: it takes seconds, and only structured outputs need it
        import xgrammar as xgr
    except ImportError:
        raise InvalidRequest("structured_outputs", "structured_outputs needs xgrammar: "
                                                   "pip install 'nanoserve[structured]'") from None
    try:
        if spec.json is not None:
            return xgr.Grammar.from_json_schema(spec.json, any_whitespace=False)
        if spec.json_object:  # an object, as OpenAI's json_object promises (xgrammar's builtin JSON allows arrays)
            return xgr.Grammar.from_json_schema({"type": "object"}, any_whitespace=False)
        if spec.regex is not None:
            return xgr.Grammar.from_regex(spec.regex)
        if spec.choice is not None:  # a JSON string literal is an EBNF string literal too
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c) for c in spec.choice))
        return xgr.Grammar.from_ebnf(spec.grammar)
    except (RuntimeError, ValueError, TypeError) as error:  # xgrammar raises RuntimeError for a bad spec
        raise InvalidRequest("structured_outputs", f"structured_outputs is not a valid grammar: {error}") from None


class RequestGrammar:
    """One request's grammar: compiled in the background (`ready` once done), then a matcher that has
    accepted exactly the request's output tokens."""

    def __init__(self, compiled: Future) -> None:
        self.compiled = compiled
        self.matcher: Any = None  # made at the first token: the compiled grammar is ready by then

    @property
    def ready(self) -> bool:
        return self.compiled.done()

    def start(self) -> Any:
        if self.matcher is None:
            import xgrammar as xgr
            self.matcher = xgr.GrammarMatcher(self.compiled.result())
        return self.matcher

    def accept(self, token: int) -> None:
        accepted = self.start().accept_token(token)
        assert accepted, f"token {token} is outside the grammar: the mask allowed it"

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token accepted."""
        return self.matcher is not None and self.matcher.is_terminated()


class GrammarCompiler:
    """An engine's grammars: parsed in add_request, compiled in a background thread, cached by spec."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, vocab_size: int, eos_token_ids: set[int]) -> None:
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, sorted(eos_token_ids)
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self.compiler: Any = None  # xgrammar's, made by the pool's first task (reading the vocabulary takes ~0.5 s)
        self.cache: OrderedDict[str, Future] = OrderedDict()

    def compile(self, spec: StructuredOutputsParams) -> RequestGrammar:
        """A grammar for one request (its own matcher), compiling in the background unless cached."""
        if self.tokenizer is None:
            raise InvalidRequest("structured_outputs", "structured_outputs needs the model's tokenizer")
        key = spec.key
        if key not in self.cache or self.cache[key].done() and self.cache[key].exception():  # failed: try again
            self.cache[key] = self.pool.submit(self.compile_now, parse_grammar(spec))
            while len(self.cache) > CACHE_SIZE:
                self.cache.popitem(last=False)
        self.cache.move_to_end(key)
        return RequestGrammar(self.cache[key])

    def compile_now(self, grammar: Any) -> Any:
        """In the pool's thread: the grammar's token masks over this vocabulary."""
        import xgrammar as xgr
        if self.compiler is None:
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.eos_token_ids)
            self.compiler = xgr.GrammarCompiler(info, max_threads=1)  # one core: the engine has the rest
        return self.compiler.compile_grammar(grammar)


def abort_failed_grammars(waiting: Iterable[Sequence], abort: Callable[[str], object]) -> None:
    """Abort, each alone and logged, the waiting requests whose grammar failed to compile: admitted, their
    matcher would fail mid-step, and the step with every request in it."""
    for seq in [seq for seq in waiting if seq.grammar is not None and seq.grammar.ready]:
        if error := seq.grammar.compiled.exception():
            logging.getLogger(__name__).error(f"grammar of request {seq.request_id!r} failed: {error!r}")
            abort(seq.request_id)


def wait_for_grammars(waiting: list[Sequence]) -> bool:
    """When nothing runs and every waiting request's grammar is compiling, the step has nothing else to do: wait
    until the first compile ends, but at most 0.1 s, so that a long one never keeps the engine's loop from new
    requests and aborts. True where they all still compile (the step then schedules nothing)."""
    compiling = [seq.grammar.compiled for seq in waiting if seq.grammar is not None and not seq.grammar.ready]
    return bool(waiting) and len(compiling) == len(waiting) and not wait(compiling, 0.1, FIRST_COMPLETED).done


def apply_grammar_masks(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """logits [S, vocab], in place: -inf on each constrained row's tokens that its grammar forbids now.
    One bitmask for the whole step, [S, ceil(vocab / 32)] int32 (bit t of a row: token t allowed)."""
    rows = [row for row, seq in enumerate(seqs) if seq.grammar is not None]
    if not rows:
        return
    import xgrammar as xgr
    bitmask = xgr.allocate_token_bitmask(len(seqs), logits.shape[1])
    for row in rows:
        seqs[row].grammar.start().fill_next_token_bitmask(bitmask, row)
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device), indices=rows)
