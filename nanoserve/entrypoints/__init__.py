"""The ways into the engine, as vLLM's entrypoints: the offline `LLM` (llm.py), the asyncio front end
(async_llm.py: the engine on a thread of its own, engine_loop.py and fair_queue.py), the OpenAI-compatible server
built on it (openai/), and the `nanoserve` command (cli.py). The engine itself knows nothing of them."""
