"""nanoserve: a small, readable LLM inference engine with continuous batching over a paged KV cache."""
import os
from pathlib import Path

# Before torch loads OpenMP, which reads this once. PASSIVE: a thread that waits at the end of one of a
# step's ~1000 parallel regions sleeps rather than spins, so it leaves its core to other work; with
# spinning, any busy neighbour turned each region into a wait for a descheduled thread (docs/performance.md,
# "Beside a busy neighbour"). A value already set wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from nanoserve.batch import Batch
from nanoserve.config import Config
from nanoserve.engine import LLMEngine
from nanoserve.entrypoints.llm import LLM
from nanoserve.outputs import RequestDelta, RequestOutput, StepResult
from nanoserve.sampler import SamplingParams

# A tiny Llama trained on Jane Austen's novels, shipped as package data (scripts/train_tiny_llama.py).
DEFAULT_MODEL = str(Path(__file__).resolve().parent / "data" / "tiny-llama")

__all__ = ["DEFAULT_MODEL", "LLM", "LLMEngine", "SamplingParams", "RequestOutput", "RequestDelta", "StepResult",
           "Batch", "Config"]
