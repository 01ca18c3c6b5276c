"""What a user starts from the shell: the `nanoserve` command (cli.py) and the OpenAI-compatible
server (openai/), as vLLM's entrypoints. The engine itself knows nothing of them."""
