"""nanoserve: a small, readable LLM inference engine with continuous batching over a paged KV cache."""
from pathlib import Path

from nanoserve.batch import Batch
from nanoserve.composition import LLMEngine
from nanoserve.config import Config
from nanoserve.entrypoints.llm import LLM
from nanoserve.outputs import RequestDelta, RequestOutput, StepResult
from nanoserve.sampler import SamplingParams

# A tiny Llama trained on Jane Austen's novels, shipped as package data (scripts/train_tiny_llama.py).
DEFAULT_MODEL = str(Path(__file__).resolve().parent / "data" / "tiny-llama")

__all__ = ["DEFAULT_MODEL", "LLM", "LLMEngine", "SamplingParams", "RequestOutput", "RequestDelta", "StepResult",
           "Batch", "Config"]
