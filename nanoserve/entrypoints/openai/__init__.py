"""The OpenAI-compatible server, one job per file (as vLLM's vllm/entrypoints/openai/):

- api_server.py: the app (API key, error handlers), uvicorn, ServerThread and the command line;
- routes.py: which URL runs which handler, and the small handlers (/tokenize, /health, ...);
- protocol.py: request bodies, how they are read and checked, APIError, Limits;
- serving_engine.py: what both APIs share: Serving (the tokenizer thread, slots, fit_to_context), Formatter;
- sampling_body.py: a request body's sampling fields as SamplingParams, checked;
- serving_completion.py, serving_chat.py: /v1/completions and /v1/chat/completions;
- streaming.py: a request's Generation, its response whole or streamed, and clients that leave;
- metrics.py: Prometheus metrics with vLLM's names.

The engine thread and its queues are entrypoints/async_llm.py's (AsyncLLM), which knows nothing of HTTP.
"""
