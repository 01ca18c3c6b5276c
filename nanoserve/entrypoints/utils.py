"""What the command lines share (`nanoserve serve`, `nanoserve generate`, `python -m nanoserve.serve`).

They share a parser whose mistakes are one line. They share the engine's options too: Config's fields
under their vLLM names.
"""
from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from typing import NoReturn

from nanoserve.config import Config


class OneLineParser(argparse.ArgumentParser):
    """A mistake in the options is one line ("error: ..."), not the usage text."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def positive(kind: type) -> Callable[[str], int | float]:
    def convert(text: str) -> int | float:
        value = kind(text)
        if not value > 0:  # nan too
            raise ValueError
        return value
    convert.__name__ = f"positive {kind.__name__}"  # argparse's "invalid positive int value: '0'"
    return convert


def JSON(text: str) -> object:  # named for argparse's "invalid JSON value: '...'"
    return json.loads(text)


ENGINE_OPTIONS = {"block_size": int, "num_kvcache_blocks": int, "max_num_seqs": int, "max_num_batched_tokens": int,
                  "max_model_len": int, "dtype": str, "device": str, "attention_backend": str,
                  "gpu_memory_utilization": float, "tensor_parallel_size": int, "quantization": str,
                  "quantization_config": JSON,  # int4's '{"group_size": 64}'
                  "speculative_config": JSON}  # as vLLM: '{"method": "ngram", "num_speculative_tokens": 4, ...}'


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """--block-size, --dtype, ... (ENGINE_OPTIONS), each default None: Config's own default."""
    for name, kind in ENGINE_OPTIONS.items():
        parser.add_argument("--" + name.replace("_", "-"), type=kind, default=None)
    parser.add_argument("--no-prefix-caching", action="store_true")
    parser.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
                        help="op by op (the default), or compiled with --no-enforce-eager (docs/performance.md)")


def engine_config(args: argparse.Namespace) -> Config:
    """The Config that args.model and the engine options ask for; a ValueError names what is wrong,
    before the model loads."""
    options = {name: getattr(args, name) for name in ENGINE_OPTIONS if getattr(args, name) is not None}
    if args.enforce_eager is not None:
        options["enforce_eager"] = args.enforce_eager
    config = Config.from_kwargs(args.model, enable_prefix_caching=not args.no_prefix_caching, **options)
    if not os.path.isdir(args.model):
        raise ValueError(f"model {args.model!r} is not a folder")
    return config
