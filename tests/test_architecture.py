"""The module graph of nanoserve: no import cycles, and the core imports no extension (but the ones
listed in ALLOWED_CORE_TO_EXTENSION, on their way out).

Imports are read with `ast`, so every import counts: at the top of a module, inside a
function and under `if TYPE_CHECKING:`. An import inside a function still ties two modules
together for a reader, so it counts as an edge like any other.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "nanoserve"

# The walkthrough core: what a reader opens first.
CORE = {
    "nanoserve.sequence",
    "nanoserve.block_manager",
    "nanoserve.scheduler",
    "nanoserve.batch",
    "nanoserve.model_runner",
    "nanoserve.attention",
    "nanoserve.sampler",
    "nanoserve.engine",
    "nanoserve.models.llama",
}

# Features that plug into the core; the core must run with none of them importable.
EXTENSIONS = {
    "nanoserve.extensions.spec_decode",
    "nanoserve.extensions.structured_outputs",
    "nanoserve.extensions.logits_processors",
    "nanoserve.extensions.compilation",
    "nanoserve.extensions.cuda_graphs",
    "nanoserve.extensions.quantization",
    "nanoserve.entrypoints",
}


# The core -> extension imports still there, each with what it is for. A seam that replaces one
# removes it here; this list only shrinks, and a new core -> extension import fails the test.
ALLOWED_CORE_TO_EXTENSION = {
    # LLMEngine builds the n-gram drafter that the scheduler's Drafter seam takes.
    ("nanoserve.engine", "nanoserve.extensions.spec_decode"),
    # add_request compiles a request's grammar; step waits for pending grammars and fails broken ones.
    ("nanoserve.engine", "nanoserve.extensions.structured_outputs"),
    # The runner compiles the decoder layers (compile_model): no step-executor seam yet.
    ("nanoserve.model_runner", "nanoserve.extensions.compilation"),
    # The runner captures and replays decode CUDA graphs (capture_graphs).
    ("nanoserve.model_runner", "nanoserve.extensions.cuda_graphs"),
    # The runner applies penalties, min_p, logit_bias, min_tokens and grammar masks (process_logits).
    ("nanoserve.model_runner", "nanoserve.extensions.logits_processors"),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def imported_names(path: Path) -> set[str]:
    """Every module `path` imports, wherever the import statement sits in the file."""
    name = module_name(path)
    is_package = path.name == "__init__.py"
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level > 0:
                # `from . import x` in a.b.c resolves against a.b (or a.b.c for a package).
                parent = name.split(".") if is_package else name.split(".")[:-1]
                parent = parent[: len(parent) - (node.level - 1)]
                base = ".".join(parent + ([base] if base else []))
            names.add(base)
            # `from pkg import mod` imports the module pkg.mod when there is one.
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    """module -> the nanoserve modules it imports (a package's `__init__` stands for the package)."""
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(path) for path in paths}
    graph = {}
    for path in paths:
        name = module_name(path)
        graph[name] = {other for other in imported_names(path) if other in modules and other != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None; a depth-first search that keeps its path."""
    done = set()
    for start in sorted(graph):
        if start in done:
            continue
        path = [start]
        on_path = {start}
        stack = [iter(sorted(graph[start]))]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                stack.pop()
                finished = path.pop()
                on_path.discard(finished)
                done.add(finished)
                continue
            if nxt in on_path:
                return path[path.index(nxt):] + [nxt]
            if nxt in done:
                continue
            path.append(nxt)
            on_path.add(nxt)
            stack.append(iter(sorted(graph[nxt])))
    return None


def is_extension(name: str) -> bool:
    return any(name == ext or name.startswith(ext + ".") for ext in EXTENSIONS)


def test_no_import_cycles():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_core_imports_no_extension_but_the_listed_ones():
    graph = import_graph()
    edges = {(core, other) for core in CORE for other in graph[core] if is_extension(other)}
    new = sorted(edges - ALLOWED_CORE_TO_EXTENSION)
    assert not new, "core imports an extension: " + ", ".join(f"{a} -> {b}" for a, b in new)
    gone = sorted(ALLOWED_CORE_TO_EXTENSION - edges)
    assert not gone, "no longer imported, remove from ALLOWED_CORE_TO_EXTENSION: " + ", ".join(
        f"{a} -> {b}" for a, b in gone)
