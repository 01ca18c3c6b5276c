"""Model implementations. nanoserve runs one family, Llama (llama.py); `load_model` (loader.py) builds
it from a Hugging Face checkpoint."""
