"""Model implementations. nanoserve runs one family, Llama; `load_model` builds it from a checkpoint."""
from nanoserve.models.llama import LlamaForCausalLM, load_model

__all__ = ["LlamaForCausalLM", "load_model"]
