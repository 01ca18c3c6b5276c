"""The docs point into the code; these tests keep the pointers from going stale without a sound.

1. A link to code names the function or class it points at, never a line number (a line number goes
   stale with every edit above it):
       [`Scheduler.schedule`](../nanoserve/scheduler.py)
   `Scheduler.schedule` must be defined in that file (`def schedule` inside `class Scheduler`). When the
   code is renamed or moved, the failure says which link is off and the names defined there now.
2. Every relative link in docs/*.md and README.md leads to a file that exists (and, for a link to
   a heading of a markdown page, to a heading that exists).
"""
from __future__ import annotations

import ast
import difflib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]

LINK = re.compile(r"\[((?:[^\[\]]|\[[^\]]*\])*)\]\(([^()\s]+)\)")  # [text](target)
SYMBOL_LINK = re.compile(r"\[`(?P<symbol>[\w.]+)`\]\((?P<target>[\w./-]+\.py)\)")  # [`Symbol`](path.py)
LINE_NUMBER = re.compile(r"\.py#L\d+")                                       # a link to a line of code
URL_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # http:, https:, mailto:, ...


def prose_lines(page: Path) -> list[tuple[int, str]]:
    """(line number, text) of the page's lines outside fenced code blocks, where links live."""
    lines, in_fence = [], False
    for number, line in enumerate(page.read_text().splitlines(), start=1):
        if line.lstrip().startswith("```"):
            in_fence = not in_fence
        elif not in_fence:
            lines.append((number, line))
    return lines


def definitions(source: str) -> dict[str, int]:
    """Every class and function of a module by qualified name ("Scheduler.schedule") -> its line."""
    found: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.setdefault(prefix + child.name, child.lineno)  # lineno: the `def`, not a decorator
                visit(child, f"{prefix}{child.name}.")
    visit(ast.parse(source), "")
    return found


def check_symbol_link(page: Path, number: int, match: re.Match) -> str | None:
    """None if the link's symbol is defined in the file it links to, else which link is off and why."""
    where = f"{page.relative_to(ROOT)}:{number}: {match.group(0)}"
    target = (page.parent / match["target"]).resolve()
    if not target.is_file():
        return f"{where}: {match['target']} does not exist"
    defined = definitions(target.read_text())
    if match["symbol"] in defined:
        return None
    close = difflib.get_close_matches(match["symbol"], defined, n=3)
    return (f"{where}: `{match['symbol']}` is not defined in {target.relative_to(ROOT).as_posix()}"
            + (f"; did you mean {close}?" if close else ""))


def test_code_links_name_symbols_defined_there() -> None:
    problems = [check_symbol_link(page, number, match)
                for page in PAGES for number, line in prose_lines(page) for match in SYMBOL_LINK.finditer(line)]
    problems = [p for p in problems if p is not None]
    assert not problems, "stale links to code:\n" + "\n".join(problems)


def test_no_link_to_a_line_number() -> None:
    """Catches a link that goes stale with every edit above its line: name the function instead."""
    found = [f"{page.relative_to(ROOT)}:{number}: {line.strip()}" for page in PAGES
             for number, line in prose_lines(page) if LINE_NUMBER.search(line)]
    assert not found, "link to the function by name, not to a line:\n" + "\n".join(found)


def heading_anchors(page: Path) -> set[str]:
    """GitHub's anchors for the page's headings: lower case, punctuation dropped, spaces to '-'."""
    anchors = set()
    for _, line in prose_lines(page):
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def check_relative_link(page: Path, number: int, target: str) -> str | None:
    where = f"{page.relative_to(ROOT)}:{number}: ({target})"
    if URL_SCHEME.match(target):
        return None
    path, _, anchor = target.partition("#")
    resolved = (page.parent / path).resolve() if path else page
    if not resolved.exists():
        return f"{where}: {path} does not exist (relative to {page.parent.relative_to(ROOT).as_posix() or '.'}/)"
    if anchor and resolved.suffix == ".md" and anchor not in heading_anchors(resolved):
        return f"{where}: {resolved.relative_to(ROOT)} has no heading #{anchor}"
    if anchor.startswith("L") and anchor[1:].isdigit() and resolved.suffix == ".py":
        if int(anchor[1:]) > len(resolved.read_text().splitlines()):
            return f"{where}: {resolved.relative_to(ROOT)} has fewer than {anchor[1:]} lines"
    return None


def test_relative_links_resolve() -> None:
    problems = [check_relative_link(page, number, match[2])
                for page in PAGES for number, line in prose_lines(page) for match in LINK.finditer(line)]
    problems = [p for p in problems if p is not None]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_the_docs_exist_and_link_into_the_code() -> None:
    names = {page.name for page in PAGES}
    assert {"walkthrough.md", "batching.md", "life-of-a-request.md"} <= names
    life = (ROOT / "docs" / "life-of-a-request.md").read_text()
    assert len(SYMBOL_LINK.findall(life)) >= 10


def test_a_renamed_symbol_is_reported_with_the_names_close_to_it() -> None:
    page = ROOT / "docs" / "walkthrough.md"
    good = "[`Scheduler.schedule`](../nanoserve/scheduler.py)"
    assert check_symbol_link(page, 1, SYMBOL_LINK.search(good)) is None
    missing = good.replace("Scheduler.schedule", "Scheduler.shedule")
    assert "did you mean ['Scheduler.schedule'" in check_symbol_link(page, 1, SYMBOL_LINK.search(missing))
    moved = good.replace("scheduler.py", "engine.py")
    assert "is not defined in nanoserve/engine.py" in check_symbol_link(page, 1, SYMBOL_LINK.search(moved))
