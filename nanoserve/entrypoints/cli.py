"""The `nanoserve` command (pyproject.toml's [project.scripts]), as vLLM's `vllm`:

    nanoserve serve MODEL [options]            the OpenAI-compatible server (openai/api_server.py)
    nanoserve bench [options]                  the benchmarks, as python -m nanoserve.bench
    nanoserve generate MODEL PROMPT [options]  one completion of PROMPT, printed as the engine makes it

Each command parses its own options (`nanoserve serve --help`). A mistake in them is one line on
stderr, and exit status 2. The server's and the benchmarks' modules are imported only when their
command runs, since the server needs the [serve] extra.
"""
from __future__ import annotations

import argparse
import sys

from nanoserve.composition import build_engine
from nanoserve.entrypoints.utils import OneLineParser, add_engine_arguments, engine_config, positive
from nanoserve.sampler import SamplingParams

COMMANDS = {
    "serve": "MODEL [options]: the OpenAI-compatible server",
    "bench": "[options]: the benchmarks (python -m nanoserve.bench)",
    "generate": "MODEL PROMPT [options]: one completion, printed as it comes",
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    listing = "\n".join(f"  nanoserve {name} {what}" for name, what in COMMANDS.items())
    parser = OneLineParser(prog="nanoserve", formatter_class=argparse.RawDescriptionHelpFormatter,
                           description="nanoserve: a small, readable LLM inference engine",
                           epilog=f"commands:\n{listing}\n\n`nanoserve COMMAND --help` lists a command's options")
    parser.add_argument("command", choices=COMMANDS)
    command = parser.parse_args(argv[:1]).command  # the rest is the command's to parse
    if command == "serve":
        serve(argv[1:])
    elif command == "bench":
        from nanoserve.bench import main as bench  # transformers' peers load only for a benchmark
        bench(argv[1:], prog="nanoserve bench")
    else:
        generate(argv[1:])


def serve(argv: list[str]) -> None:
    """The server's own command line (api_server.main), under the name `nanoserve serve`."""
    try:
        from nanoserve.entrypoints.openai.api_server import main as serve_main
    except ModuleNotFoundError as error:  # fastapi, uvicorn or prometheus_client
        sys.exit(f"nanoserve serve: error: {error}: pip install 'nanoserve[serve]' installs the server's packages")
    serve_main(argv, prog="nanoserve serve")


def generate(argv: list[str]) -> None:
    """Load MODEL, complete PROMPT once and print the text as each step settles it (see detokenizer.py)."""
    parser = OneLineParser(prog="nanoserve generate", description="One completion of PROMPT, printed as it comes")
    parser.add_argument("model")
    parser.add_argument("prompt")
    parser.add_argument("--max-tokens", type=positive(int), default=SamplingParams.max_tokens)
    parser.add_argument("--temperature", type=float, default=SamplingParams.temperature, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=SamplingParams.top_p)
    parser.add_argument("--top-k", type=int, default=SamplingParams.top_k)
    parser.add_argument("--seed", type=int, default=None)
    add_engine_arguments(parser)
    args = parser.parse_args(argv)
    try:  # a bad value is one line, before the model loads
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_tokens=args.max_tokens, seed=args.seed)
        engine = build_engine(engine_config(args))
    except (ValueError, OSError) as error:
        parser.error(str(error))
    try:
        engine.add_request(args.prompt, params)
    except ValueError as error:  # the prompt: longer than max_model_len, or text for a model without a tokenizer
        engine.close()
        parser.error(str(error))
    try:
        while engine.has_unfinished_requests():
            for delta in engine.step().deltas:
                print(delta.text, end="", flush=True)
        print()
    finally:
        engine.close()


if __name__ == "__main__":
    main()
