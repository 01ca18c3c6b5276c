"""The ways into the engine, as vLLM's entrypoints.

- The offline `LLM` (llm.py).
- The asyncio front end (async_llm.py), with the engine on a thread of its own (engine_loop.py, fair_queue.py).
- The OpenAI-compatible server built on it (openai/).
- The `nanoserve` command (cli.py).

The engine itself knows nothing of them."""
