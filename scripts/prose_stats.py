"""Prose statistics: words per sentence in the docs, the README and the docstrings.

    python scripts/prose_stats.py            # the three tables' numbers
    python scripts/prose_stats.py --worst 20 # also the 20 longest sentences, with where they are

A sentence ends at '.', '!' or '?' followed by a space, at a blank line, and at the end of a list
item or heading. Fenced code, tables and headings are not prose, so they are skipped. A word is a
whitespace-separated piece with a letter or digit in it, so `a.b(c)` is one word.
The targets (docs: at most 18 words a sentence, 10% over 30; docstrings: 16 and 5%) are a guide,
not a CI gate.
"""
from __future__ import annotations

import argparse
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]]*\s+(?=[A-Z0-9`(\"*\[_])")
LIST_ITEM = re.compile(r"^\s*([-*+]|\d+[.)])\s+")
WORD = re.compile(r"\w")


def paragraphs(text: str, markdown: bool) -> list[str]:
    """Runs of prose lines: a blank line, a list item or a heading starts a new one."""
    runs, current, in_fence = [], [], False
    for line in text.splitlines():
        stripped = line.strip()
        if markdown and stripped.startswith("```"):
            in_fence = not in_fence
            continue
        skip = in_fence or (markdown and (stripped.startswith(("|", "#", "<")) or line.startswith("    ")))
        if not markdown and (stripped.startswith(">>>") or line.startswith("    ")):
            skip = True  # an example or an indented block in a docstring
        if skip or not stripped or LIST_ITEM.match(line):
            if current:
                runs.append(" ".join(current))
            current = []
            if skip or not stripped:
                continue
            stripped = LIST_ITEM.sub("", line).strip()
        current.append(stripped)
    if current:
        runs.append(" ".join(current))
    return runs


def sentences(text: str, markdown: bool) -> list[str]:
    found = []
    for run in paragraphs(text, markdown):
        found += [s for s in SENTENCE_END.split(run) if any(WORD.search(w) for w in s.split())]
    return found


def count_words(sentence: str) -> int:
    return sum(1 for word in sentence.split() if WORD.search(word))


def docstrings(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))]
    return [doc for node in nodes if (doc := ast.get_docstring(node))]


def report(name: str, found: list[tuple[str, str]], worst: int) -> None:
    lengths = [count_words(s) for _, s in found]
    total = max(len(lengths), 1)
    colons = sum(s.count(":") + s.count(";") for _, s in found)
    long = sum(1 for n in lengths if n > 30)
    print(f"{name}: {len(lengths)} sentences, {sum(lengths) / total:.1f} words per sentence, "
          f"{100 * long / total:.0f}% over 30 words, {colons / total:.2f} colons or semicolons per sentence")
    for where, sentence in sorted(found, key=lambda f: -count_words(f[1]))[:worst]:
        print(f"  {count_words(sentence):3d} {where}: {sentence}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worst", type=int, default=0, help="also print this many of the longest sentences")
    parser.add_argument("paths", nargs="*", help="only these files (markdown or Python)")
    args = parser.parse_args()
    pages = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
    modules = sorted((ROOT / "nanoserve").rglob("*.py"))
    if args.paths:
        chosen = {Path(p).resolve() for p in args.paths}
        pages = [p for p in pages if p.resolve() in chosen]
        modules = [m for m in modules if m.resolve() in chosen]
    docs = [(str(p.relative_to(ROOT)), s) for p in pages for s in sentences(p.read_text(), markdown=True)]
    strings = [(str(m.relative_to(ROOT)), s) for m in modules for d in docstrings(m) for s in sentences(d, False)]
    report("docs and README", docs, args.worst)
    report("docstrings", strings, args.worst)


if __name__ == "__main__":
    main()
