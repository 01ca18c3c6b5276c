"""Model implementations. nanoserve runs one family, Llama (llama.py); `load_model` (loader.py) builds
it from a Hugging Face checkpoint."""
from nanoserve.models.llama import LlamaForCausalLM
from nanoserve.models.loader import load_model

__all__ = ["LlamaForCausalLM", "load_model"]
