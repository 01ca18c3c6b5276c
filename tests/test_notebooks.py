"""The notebooks' source is notebooks/*.py (jupytext percent format); each is paired with a .ipynb
committed with its outputs, so that it reads well on the web without being run.

Every notebook runs top to bottom on a fresh kernel here: their asserts (the numbers of docs/walkthrough.md,
outputs equal with and without prefix caching or preemption, ...) are tests too."""
import pytest

# Test extras (pyproject.toml's [test]) this module needs: without one it is skipped, not an error
pytest.importorskip("jupytext")
pytest.importorskip("nbformat")
pytest.importorskip("nbclient")
import os
from pathlib import Path

import jupytext
import nbformat
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
SOURCES = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.py"))  # block_map.py is a module they import


def test_every_notebook_has_its_source():
    # Catches a .py renamed or deleted while its old .ipynb stays behind (or the reverse), so that
    # the web shows a notebook nothing tests any more.
    assert SOURCES, "no notebooks/*.py found"
    assert sorted(path.stem for path in NOTEBOOKS.glob("*.ipynb")) == [path.stem for path in SOURCES]


@pytest.mark.parametrize("source", SOURCES, ids=lambda path: path.stem)
def test_ipynb_matches_its_source(source):
    # Catches an edit to the .py committed without re-pairing (or an edit made in Jupyter to the
    # .ipynb only): the notebook people read on the web would show other code than the one tested.
    stored = nbformat.read(source.with_suffix(".ipynb"), as_version=4)
    expected = jupytext.read(source)
    assert [(c.cell_type, c.source) for c in stored.cells] == [(c.cell_type, c.source) for c in expected.cells], \
        f"{source.with_suffix('.ipynb').name} differs from {source.name}: re-pair and re-execute (see README)"
    # Catches a .ipynb re-paired but not re-executed: a changed cell would show no output, or the
    # output of older code.
    counts = [c.execution_count for c in stored.cells if c.cell_type == "code"]
    assert counts == list(range(1, len(counts) + 1)), f"{source.with_suffix('.ipynb').name}: re-execute it (see README)"


@pytest.mark.parametrize("source", SOURCES, ids=lambda path: path.stem)
def test_notebook_runs(source, monkeypatch):
    # Catches an engine change that breaks a notebook or changes the numbers it asserts. The kernel
    # must import this checkout's nanoserve, whatever else is installed.
    root = str(NOTEBOOKS.parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    notebook = jupytext.read(source)
    # A kernel that cannot start, any cell that raises or any cell slower than the timeout fails
    # the test: nothing is skipped.
    NotebookClient(notebook, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
