"""What a Markdown page says in code and links, each piece with its line number.

tests/test_docs.py checks these pieces against the code; this module only reads
the page. It is a small reader, not a Markdown parser: fenced blocks (``` or
~~~, indented or not), inline code spans (which may wrap onto the next line of
a paragraph, as they do in the README), and ``[text](target)`` links.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_FENCE = re.compile(r"^\s*(```+|~~~+)")
_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
# [text](target) or ![alt](target); the target stops at a space (an optional title follows).
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


@dataclass(frozen=True, slots=True)
class Code:
    """A code span or one logical line of a fenced block (continuations joined)."""

    text: str
    line: int  # 1-based line of the page where it starts
    block: bool  # from a fenced block (shell lines), not an inline span


@dataclass(frozen=True, slots=True)
class Page:
    path: Path
    lines: list[str]

    @property
    def name(self) -> str:
        return self.path.relative_to(ROOT).as_posix()

    def where(self, line: int) -> str:
        return f"{self.name}:{line}"


def doc_pages() -> list[Page]:
    """README.md, CONTRIBUTING.md and every page under docs/, in path order."""
    paths = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [Page(p, p.read_text(encoding="utf-8").splitlines()) for p in paths]


def _split(page: Page) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(prose lines, fenced lines), each as (1-based line number, text)."""
    prose: list[tuple[int, str]] = []
    fenced: list[tuple[int, str]] = []
    fence: str | None = None
    for number, line in enumerate(page.lines, 1):
        m = _FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)[0] * 3
        elif fence is not None and m and m.group(1).startswith(fence):
            fence = None
        elif fence is not None:
            fenced.append((number, line))
        else:
            prose.append((number, line))
    return prose, fenced


def _paragraphs(lines: list[tuple[int, str]]) -> Iterator[tuple[int, str]]:
    """Runs of consecutive non-blank prose lines, joined with newlines, with their first line."""
    run: list[tuple[int, str]] = []
    for number, line in [*lines, (0, "")]:
        consecutive = run and number == run[-1][0] + 1
        if line.strip() and (not run or consecutive):
            run.append((number, line))
            continue
        if run:
            yield run[0][0], "\n".join(text for _, text in run)
        run = [(number, line)] if line.strip() else []


def paragraphs(page: Page) -> Iterator[tuple[int, str]]:
    """Each prose paragraph (lines joined with newlines) with its first line number."""
    yield from _paragraphs(_split(page)[0])


def code_spans(page: Page) -> Iterator[Code]:
    """Inline code spans of the prose; a span wrapped over lines reads as one line."""
    for first, text in paragraphs(page):
        for m in _SPAN.finditer(text):
            line = first + text.count("\n", 0, m.start())
            yield Code(" ".join(m.group(2).split()), line, block=False)


def block_lines(page: Page) -> Iterator[Code]:
    """Lines of fenced blocks, a line ending in a backslash joined to the next."""
    _, fenced = _split(page)
    pending: tuple[int, str] | None = None
    for number, line in fenced:
        start, text = pending if pending else (number, "")
        text = f"{text} {line.strip()}" if text else line.strip()
        if text.endswith("\\"):
            pending = (start, text[:-1].rstrip())
            continue
        pending = None
        yield Code(text, start, block=True)
    if pending:
        yield Code(pending[1], pending[0], block=True)


def links(page: Page) -> Iterator[tuple[int, str]]:
    """Targets of Markdown links in the prose (outside code spans), with their line."""
    prose, _ = _split(page)
    for number, line in prose:
        bare = _SPAN.sub(lambda m: " " * len(m.group(0)), line)
        for m in _LINK.finditer(bare):
            yield number, m.group(1)


def anchors(page: Page) -> set[str]:
    """GitHub's heading anchors of the page: lower case, punctuation dropped, spaces to dashes,
    a repeated heading suffixed -1, -2, ..."""
    prose, _ = _split(page)
    seen: dict[str, int] = {}
    out: set[str] = set()
    for _, line in prose:
        m = _HEADING.match(line)
        if not m:
            continue
        text = re.sub(r"`([^`]*)`", r"\1", m.group(2))
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
        slug = re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out
