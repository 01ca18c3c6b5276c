"""Grammars parsed and compiled in child processes. structured_outputs.py's GrammarCompiler sends every parse
and compile here. A spec may crash xgrammar (its converters recurse without bound: SIGSEGV), or run past its
time limit or its memory limit. Then it fails its own request, never the process that serves everyone.

One `GrammarWorker` is one child process, a new Python interpreter. It is started at its owner's first
grammar, so a process that serves no grammar never starts one. Why a new interpreter:
- It is never a fork of a process that holds torch's threads.
- Unlike multiprocessing's spawn, it never re-runs the caller's script. A script without
  `if __name__ == "__main__"` would not survive that.

Parent and child talk over a socket pair (multiprocessing's Pipe), one message at a time, each a class:
    parent: Start(tokenizer_info_json, memory_bytes)  ->  child: Ready
    parent: spec (a StructuredOutputsParams)  ->  child: Compiled(grammar_json) | Refused(message)
The compiled grammar comes as xgrammar's own JSON (`CompiledGrammar.serialize_json`). It is read back
against the parent's TokenizerInfo. A child may die (its pipe ends) or answer past `seconds`. Then it is
killed, and replaced at the next job. The job's request gets an InvalidRequest naming structured_outputs.
"""

import json
import os
import resource
import subprocess
import sys
from multiprocessing.connection import Connection, Pipe
from pathlib import Path
from typing import Any, NamedTuple

from nanoserve.extensions.grammar_bounds import refuse
from nanoserve.sampling_params import InvalidRequest

COMPILE_SECONDS = 30.0     # one parse and compile in a child; past it, the child is killed
START_SECONDS = 120.0      # a new child's start (it imports xgrammar, and with it torch): not counted above
MEMORY_BYTES = 4 * 2**30   # what a child may allocate past its start (address space, where the OS bounds it)
PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # where the child imports nanoserve from


class Start(NamedTuple):
    """The child's setup: the vocabulary (xgrammar's TokenizerInfo as JSON) and its memory limit."""
    tokenizer_info_json: str
    memory_bytes: int


class Ready(NamedTuple):
    """The child has started and reads jobs: specs, each a StructuredOutputsParams to parse and compile."""


class Compiled(NamedTuple):
    """The compiled grammar as xgrammar's JSON."""
    grammar_json: str


class Refused(NamedTuple):
    """The spec is not a grammar this server can follow: the message names why."""
    message: str


def serve(fd: int) -> None:
    """The child's loop (`python -c`, the socket's fd given). It reads a Start. Then, until the parent closes
    the socket, it takes one spec in and sends one Compiled or Refused out.

    A grammar that allows no output at all is refused, before any request runs. (`root ::= root` is one: its
    language is empty.) Its first mask, over the whole vocabulary, allows no token."""
    import xgrammar as xgr

    conn = Connection(fd)
    start = conn.recv()
    info = xgr.TokenizerInfo.deserialize_json(start.tokenizer_info_json)
    # one core (the engine has the rest); no cache of xgrammar's own: the parent's GrammarCompiler caches
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    limit_memory(start.memory_bytes)
    conn.send(Ready())
    while True:
        try:
            spec = conn.recv()
        except EOFError:  # the parent closed the pipe, or died
            return
        try:
            compiled = compiler.compile_grammar(parse_grammar(spec))
            bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
            xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
            if not bitmask.any():
                refuse("allows no output: its language is empty")
            conn.send(Compiled(compiled.serialize_json()))
        except InvalidRequest as error:
            conn.send(Refused(str(error)))
        except (RuntimeError, ValueError, TypeError, MemoryError) as error:  # xgrammar's, or out of memory
            conn.send(Refused(f"structured_outputs cannot be compiled: {str(error)[:300]}"))


def parse_grammar(spec: Any) -> Any:
    """The spec (a StructuredOutputsParams) as an xgrammar Grammar. It runs in a grammar worker's process,
    never the server's. A spec xgrammar rejects is an InvalidRequest naming structured_outputs.
    JSON has no free whitespace. A model that never saw JSON would pad it with spaces forever."""
    import xgrammar as xgr  # here: it takes seconds, and only structured outputs need it (`serve` imported it)

    try:
        if spec.json is not None or spec.json_object:  # json_object: an object, as OpenAI's json_object promises
            # (xgrammar's builtin JSON allows arrays)
            schema = {"type": "object"} if spec.json_object else spec.json
            return xgr.Grammar.from_json_schema(schema, any_whitespace=False)
        if spec.regex is not None:
            return xgr.Grammar.from_regex(spec.regex)
        if spec.choice is not None:  # a JSON string literal is an EBNF string literal too; not ASCII-escaped,
            # which writes an emoji as a surrogate pair that xgrammar reads as two lone surrogates
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                                  for c in spec.choice))
        return xgr.Grammar.from_ebnf(spec.grammar)
    except (RuntimeError, ValueError, TypeError) as error:  # xgrammar raises RuntimeError for a bad spec
        refuse(f"is not a valid grammar: {error}")


def limit_memory(num_bytes: int) -> None:
    """Bound the child's address space to what it has now plus num_bytes, where the OS can.
    Linux can; macOS ignores RLIMIT_AS. Past it, xgrammar's allocation fails (MemoryError), or the child
    dies, alone."""
    try:
        in_use = int(Path("/proc/self/statm").read_text().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (in_use + num_bytes, resource.getrlimit(resource.RLIMIT_AS)[1]))
    except (OSError, ValueError):
        pass


class GrammarWorker:
    """One child process that parses and compiles grammars, one at a time (its owner is one thread)."""

    def __init__(self, tokenizer_info_json: str, memory_bytes: int) -> None:
        self.setup = Start(tokenizer_info_json, memory_bytes)  # the child's first message
        self.seconds = COMPILE_SECONDS
        self.process = None  # a subprocess.Popen once started
        self.conn = None  # our end of its socket, a Connection
        self.job = None  # the spec the child works on now

    def start(self) -> None:
        """Start the child, unless it runs, and wait until it reads jobs."""
        if self.process is not None and self.process.poll() is None:
            return
        self.stop()
        ours, child_end = Pipe()
        path = os.pathsep.join(filter(None, [PACKAGE_ROOT, os.environ.get("PYTHONPATH")]))
        code = f"from nanoserve.extensions.grammar_workers import serve; serve({child_end.fileno()})"
        self.process = subprocess.Popen([sys.executable, "-c", code], pass_fds=[child_end.fileno()],
                                        stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": path})
        child_end.close()  # the parent's copy: the child's death then ends the socket (EOFError)
        self.conn = ours
        self.conn.send(self.setup)
        if not self.conn.poll(START_SECONDS) or not isinstance(self.receive(), Ready):
            self.stop()
            raise RuntimeError("the grammar worker process did not start")

    def run(self, spec: Any) -> str:
        """spec's compiled grammar JSON. It raises an InvalidRequest in three cases:
        - the child refused the spec;
        - the child died on it (then it is replaced at the next job);
        - the child ran past `seconds` (then it is killed)."""
        self.start()
        self.conn.send(spec)
        self.job = spec
        answered = self.conn.poll(self.seconds)
        self.job = None
        if not answered:
            self.stop()
            refuse(f"took over {self.seconds} s to compile, this server's limit")
        reply = self.receive()
        if reply is None:
            exit_code = self.process.wait()
            self.stop()
            refuse(f"crashed the grammar compiler (its process ended with exit code {exit_code})")
        if isinstance(reply, Refused):
            raise InvalidRequest("structured_outputs", reply.message)
        return reply.grammar_json

    def receive(self) -> Ready | Compiled | Refused | None:
        """The child's next message; None if it died."""
        try:
            return self.conn.recv()
        except (EOFError, OSError):
            return None

    def stop(self) -> None:
        if self.process is not None:
            self.process.kill()  # nothing if it has ended
            self.process.wait()
            self.conn.close()
        self.process, self.conn = None, None
