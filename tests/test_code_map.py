"""docs/design/code-map.md stays true: it names every package folder, and what it names exists.

The map is the first page a new reader opens; a folder added without a line there,
or a file or function renamed under it, fails here rather than misleading them.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CODE_MAP = ROOT / "docs" / "design" / "code-map.md"
PACKAGES = ("engine", "server", "kvstore", "kernels")

# A backticked path: something with a slash, or a file with a known suffix.
PATH = re.compile(r"`([\w.-]+(?:/[\w.-]*)+|[\w.-]+\.(?:py|md|toml|sh|json))`")
# A hop of "the path of one request": a file, then the function or Class.method in it.
HOP = re.compile(r"`([\w/.-]+\.py)`\s+`(\w+(?:\.\w+)?)`")


def _text() -> str:
    return CODE_MAP.read_text()


def _named_paths(text: str) -> set[str]:
    return {m.group(1).rstrip("/") for m in PATH.finditer(text)}


def _named_with_folder(text: str) -> list[tuple[str, str]]:
    """(path, the folder of its table row): a bare file name in a row is that folder's."""
    named = []
    folder = ""
    for line in text.splitlines():
        row = re.match(r"\| `([\w./-]+)/` \|", line)
        folder = row.group(1) if row else ""
        named += [(m.group(1).rstrip("/"), folder) for m in PATH.finditer(line)]
    return named


def _exists(path: str, folder: str) -> bool:
    """From the repository root, from the row's folder, or beside the map (doc links)."""
    return any((base / path).exists() for base in (ROOT, ROOT / folder, CODE_MAP.parent))


def test_every_package_folder_is_named() -> None:
    named = _named_paths(_text())
    folders = {
        init.parent.relative_to(ROOT).as_posix()
        for package in PACKAGES
        for init in (ROOT / package).rglob("__init__.py")
    }
    assert folders, "no package folders found"
    assert sorted(folders - named) == []


def test_every_named_path_exists() -> None:
    named = _named_with_folder(_text())
    assert len(named) > 50, "the map names almost nothing"
    missing = sorted({f"{p} (in {f or 'text'})" for p, f in named if not _exists(p, f)})
    assert missing == []


def test_every_hop_names_a_function_of_its_file() -> None:
    hops = HOP.findall(_text())
    assert len(hops) >= 12, "the path of one request lost its hops"
    wrong = []
    for path, name in hops:
        source = (ROOT / path).read_text()
        *owner, func = name.split(".")
        defined = re.search(rf"^\s*(?:async\s+)?(?:def|class)\s+{func}\b", source, re.M)
        owned = all(re.search(rf"^class\s+{o}\b", source, re.M) for o in owner)
        if not (defined and owned):
            wrong.append(f"{path} {name}")
    assert wrong == []
