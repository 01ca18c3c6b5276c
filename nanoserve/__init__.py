"""nanoserve: a small, readable LLM inference engine with continuous batching over a paged KV cache."""
from nanoserve.config import Config
from nanoserve.engine import LLM, LLMEngine, RequestOutput, StepResult
from nanoserve.batch import Batch
from nanoserve.sampler import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "StepResult", "Batch", "Config"]
