"""Start-up scan of the persistent tier: rebuild the index, remove what cannot be served.

Only each file's 80-byte header is read; checksums are verified when a page
is read (reading every payload at start would read the whole directory).

The directory may be shared with live writers on other hosts or in other
containers, so a temp file is judged by its age alone: one not modified for
``stale_temp_s`` belongs to a writer that died (a live write takes seconds).
Writer pids say nothing across pid namespaces and hosts: a pid check once deleted a
live writer's temp file (docs/design/kvstore.md, "Persistent tier").
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.ssd.page_file import (
    FILE_SUFFIX,
    HEADER_BYTES,
    TEMP_SUFFIX,
    PageHeader,
    decode_header,
    open_regular,
    read_into,
    shard_parts,
)

log = logging.getLogger("kvstore.ssd.persistent")

_HEX = set("0123456789abcdef")


@dataclass(slots=True)
class ScanResult:
    # (page hash, file size, mtime), least recently used first (by mtime).
    pages: list[tuple[bytes, int, float]] = field(default_factory=list)
    skipped_files: int = 0
    stray_temp_files: int = 0


def scan(
    root: Path,
    file_bytes: int,
    expected: Callable[[bytes], PageHeader],
    stale_temp_s: float,
) -> ScanResult:
    """Index every servable ``<hash>.kvp`` under ``root/ab/cd``; delete the rest of ours.

    ``expected(page_hash)`` is the header a file of that name must carry. Files
    that are neither page files nor temp files are left alone; temp files
    younger than ``stale_temp_s`` too (a live writer's, perhaps on another host).
    """
    result = ScanResult()
    stale_before = time.time() - stale_temp_s
    found: list[tuple[float, bytes, int]] = []
    for shard in _shard_dirs(root):
        try:
            entries = list(os.scandir(shard))
        except OSError:
            continue
        for entry in entries:
            if entry.name.endswith(TEMP_SUFFIX):
                if _stale_temp(entry, stale_before) and unlink_quietly(Path(entry.path)):
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
    result.pages = [(page_hash, size, mtime) for mtime, page_hash, size in found]
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
        st = entry.stat(follow_symlinks=False)
        if not stat.S_ISREG(st.st_mode) or st.st_size != file_bytes:
            return None  # symlinks, FIFOs, directories: never indexed
        fd = open_regular(entry.path)
        try:
            raw = bytearray(HEADER_BYTES)
            read_into(fd, raw)
        finally:
            os.close(fd)
        header = decode_header(bytes(raw))
    except OSError:
        return None
    if header != expected(page_hash):
        return None
    return st.st_mtime, page_hash, st.st_size


def _stale_temp(entry: os.DirEntry[str], stale_before: float) -> bool:
    """A temp file nobody has written to since ``stale_before`` (wall clock)."""
    try:
        st = entry.stat(follow_symlinks=False)
    except OSError:
        return False
    return not stat.S_ISDIR(st.st_mode) and st.st_mtime < stale_before


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
