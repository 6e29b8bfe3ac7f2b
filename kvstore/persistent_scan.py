"""Start-up scan of the persistent tier: rebuild the index, remove what cannot be served.

Only each file's 80-byte header is read; checksums are verified when a page
is read (reading every payload at start would read the whole directory).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.page_file import (
    FILE_SUFFIX,
    HEADER_BYTES,
    TEMP_SUFFIX,
    PageHeader,
    decode_header,
    shard_parts,
)

log = logging.getLogger("kvstore.persistent")

_HEX = set("0123456789abcdef")


@dataclass(slots=True)
class ScanResult:
    # (page hash, file size), least recently used first (by mtime).
    pages: list[tuple[bytes, int]] = field(default_factory=list)
    skipped_files: int = 0
    stray_temp_files: int = 0


def scan(root: Path, file_bytes: int, expected: Callable[[bytes], PageHeader]) -> ScanResult:
    """Index every servable ``<hash>.kvp`` under ``root/ab/cd``; delete the rest of ours.

    ``expected(page_hash)`` is the header a file of that name must carry. Files
    that are neither page files nor our temp files are left alone.
    """
    result = ScanResult()
    found: list[tuple[float, bytes, int]] = []
    for shard in _shard_dirs(root):
        try:
            entries = list(os.scandir(shard))
        except OSError:
            continue
        for entry in entries:
            if entry.name.endswith(TEMP_SUFFIX):
                if _stray_temp(entry) and unlink_quietly(Path(entry.path)):
                    result.stray_temp_files += 1
            elif entry.name.endswith(FILE_SUFFIX):
                item = _check_page(entry, shard, file_bytes, expected)
                if item is not None:
                    found.append(item)
                else:
                    log.info("kv persistent tier: skipping unusable file %s", entry.path)
                    result.skipped_files += 1
                    unlink_quietly(Path(entry.path))
    found.sort()
    result.pages = [(page_hash, size) for _mtime, page_hash, size in found]
    return result


def _check_page(
    entry: os.DirEntry[str], shard: Path, file_bytes: int, expected: Callable[[bytes], PageHeader]
) -> tuple[float, bytes, int] | None:
    stem = entry.name[: -len(FILE_SUFFIX)]
    if len(stem) != 64 or not set(stem) <= _HEX:
        return None
    page_hash = bytes.fromhex(stem)
    if shard_parts(page_hash) != (shard.parent.name, shard.name):
        return None
    try:
        st = entry.stat()
        if st.st_size != file_bytes:
            return None
        with open(entry.path, "rb", buffering=0) as f:
            header = decode_header(f.read(HEADER_BYTES))
    except OSError:
        return None
    if header != expected(page_hash):
        return None
    return st.st_mtime, page_hash, st.st_size


def _stray_temp(entry: os.DirEntry[str]) -> bool:
    """A temp file whose writer is gone: ``.<hash>.<pid>.<seq>.tmp`` with a dead pid."""
    parts = entry.name.split(".")
    try:
        pid = int(parts[2])
    except (IndexError, ValueError):
        return True
    return not pid_alive(pid)


def pid_alive(pid: int) -> bool:
    if pid <= 0 or pid == os.getpid():
        # Our own pid on a file we did not write: a previous process that had it.
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _shard_dirs(root: Path) -> list[Path]:
    out: list[Path] = []
    try:
        level1 = sorted(p for p in root.iterdir() if p.is_dir() and len(p.name) == 2)
    except OSError:
        return out
    for a in level1:
        try:
            out.extend(sorted(p for p in a.iterdir() if p.is_dir() and len(p.name) == 2))
        except OSError:
            continue
    return out


def unlink_quietly(path: Path) -> bool:
    try:
        path.unlink()
        return True
    except OSError:
        return False
