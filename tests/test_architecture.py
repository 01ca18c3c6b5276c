"""The module graph of nanoserve: no import cycles, and the core imports no extension
(tests/test_core_alone.py runs the core with every extension unimportable).

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
    "nanoserve.models",
    "nanoserve.models.families",
    "nanoserve.models.llama",
    "nanoserve.models.loader",
}

# Features that plug into the core; the core must run with none of them importable.
EXTENSIONS = {
    "nanoserve.extensions.spec_decode",
    "nanoserve.extensions.structured_outputs",
    "nanoserve.extensions.logits_processors",
    "nanoserve.extensions.compilation",
    "nanoserve.extensions.cuda_graphs",
    "nanoserve.extensions.quantization",
    "nanoserve.extensions.parallel",
    "nanoserve.entrypoints",
}


# The core -> extension imports still there: none. A new one fails the test; extensions plug into the
# core's seams instead (nanoserve/seams.py), wired in by the composition root (nanoserve/composition.py).
ALLOWED_CORE_TO_EXTENSION: set[tuple[str, str]] = set()


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
