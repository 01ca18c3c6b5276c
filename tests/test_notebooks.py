"""Every notebook in notebooks/ runs top to bottom on a fresh kernel: their asserts (the numbers of
the walkthrough, docs/walkthrough.md; outputs equal with and without prefix caching or preemption,
...) are tests too."""
import os
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
sys.path.insert(0, str(ROOT / "notebooks"))
import make_notebooks  # noqa: E402


def test_there_are_notebooks():
    assert [path.name for path in NOTEBOOKS] == sorted(make_notebooks.NOTEBOOKS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_matches_its_generator(path):
    stored = nbformat.read(path, as_version=4)
    generated = make_notebooks.NOTEBOOKS[path.name]
    assert [(c.cell_type, c.source) for c in stored.cells] == [(c.cell_type, c.source) for c in generated.cells], \
        f"{path.name} differs from notebooks/make_notebooks.py: edit the generator and run it"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_runs(path, monkeypatch):
    # The kernel must import this checkout's nanoserve, whatever else is installed.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    notebook = nbformat.read(path, as_version=4)
    # A kernel that cannot start, or any cell that raises, fails the test: nothing is skipped.
    NotebookClient(notebook, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
