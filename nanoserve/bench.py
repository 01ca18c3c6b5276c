"""`python -m nanoserve.bench`: the benchmarks' command line, under its first name. The benchmarks
themselves live in nanoserve/benchmarks/, one job per file (its __init__.py says which)."""
from nanoserve.benchmarks.main import main

__all__ = ["main"]

if __name__ == "__main__":
    main()
