"""The docs point into the code; these tests keep the pointers from going stale without a sound.

1. A line link names a symbol right after it:
       [`nanoserve/scheduler.py:51`](../nanoserve/scheduler.py#L51) `Scheduler.schedule`
   Line 51 of that file must be where `Scheduler.schedule` is defined (`def schedule` inside
   `class Scheduler`). When the code moves, the failure says which link is off and the line the
   symbol is defined on now, so the fix is to change two numbers.
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
LINE_LINK = re.compile(                                           # [`path.py:N`](path.py#LN) `Symbol`
    r"\[`?(?P<label>[\w./-]+\.py):(?P<label_line>\d+)`?\]\((?P<target>[\w./-]+\.py)#L(?P<line>\d+)\)"
    r"(?:\s*`(?P<symbol>[\w.]+)`)?")
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


def check_line_link(page: Path, number: int, match: re.Match) -> str | None:
    """None if the link is right, else which link is off and the line to write instead."""
    where = f"{page.relative_to(ROOT)}:{number}: {match.group(0)}"
    target = (page.parent / match["target"]).resolve()
    if not target.is_file():
        return f"{where}: {match['target']} does not exist"
    path = target.relative_to(ROOT).as_posix()
    if match["label"] != path:
        return f"{where}: the text names {match['label']} but the link goes to {path}"
    symbol = match["symbol"]
    if symbol is None:
        return f"{where}: name the symbol defined there right after the link, e.g. `Class.method`"
    source = target.read_text()
    defined = definitions(source)
    if symbol not in defined:
        close = difflib.get_close_matches(symbol, defined, n=3)
        return f"{where}: `{symbol}` is not defined in {path} any more" + (f"; did you mean {close}?" if close else "")
    now, label_line, line = defined[symbol], int(match["label_line"]), int(match["line"])
    if label_line == line == now:
        return None
    lines = source.splitlines()
    said = f"line {line} is `{lines[line - 1].strip()}`" if line <= len(lines) else f"line {line} is past the end"
    if label_line != line:
        said = f"the text says line {label_line}, the link line {line}"
    return (f"{where}: {said}, but `{symbol}` is defined at line {now} now: "
            f"write [`{path}:{now}`]({match['target']}#L{now})")


def test_line_links_point_at_their_symbols() -> None:
    problems = [check_line_link(page, number, match)
                for page in PAGES for number, line in prose_lines(page) for match in LINE_LINK.finditer(line)]
    problems = [p for p in problems if p is not None]
    assert not problems, "stale links to code lines:\n" + "\n".join(problems)


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
    assert len(LINE_LINK.findall(life)) >= 10


def test_a_stale_line_link_is_reported_with_the_line_it_moved_to() -> None:
    page = ROOT / "docs" / "walkthrough.md"
    line = definitions((ROOT / "nanoserve" / "scheduler.py").read_text())["Scheduler.schedule"]
    stale = f"[`nanoserve/scheduler.py:{line + 1}`](../nanoserve/scheduler.py#L{line + 1}) `Scheduler.schedule`"
    problem = check_line_link(page, 1, LINE_LINK.search(stale))
    assert problem is not None and f"defined at line {line} now" in problem
    assert f"#L{line})" in problem
    good = stale.replace(str(line + 1), str(line))
    assert check_line_link(page, 1, LINE_LINK.search(good)) is None
    missing = good.replace("Scheduler.schedule", "Scheduler.shedule")
    assert "did you mean ['Scheduler.schedule'" in check_line_link(page, 1, LINE_LINK.search(missing))
