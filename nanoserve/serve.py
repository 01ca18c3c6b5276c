"""`python -m nanoserve.serve MODEL [options]`, as before the server became a package.
The server is nanoserve/entrypoints/openai/ (start with api_server.py). `nanoserve serve` also starts it."""
from nanoserve.entrypoints.openai.api_server import ServerThread, build_app, main
from nanoserve.entrypoints.openai.protocol import Limits

__all__ = ["Limits", "ServerThread", "build_app", "main"]

if __name__ == "__main__":
    main()
