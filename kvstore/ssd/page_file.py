"""On-disk format of one persisted page (docs/design/architecture.md §2.3).

    header (80 B) | payload (layout.page_bytes) | xxh3-128 of header + payload (16 B)

Header, little-endian: magic ``FSKVPAGE``, format version (u16), header size
(u16), flags (u32, 0: payload stored raw), layout fingerprint (16 B),
page_tokens (u32), entries in the page over all sources (u32), payload bytes
(u64), the page hash the file is named by (32 B). The page hash inside the
file ties the bytes to their name, so a file copied or renamed to the wrong
name is rejected rather than served for another prefix.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
import uuid
from dataclasses import dataclass

import xxhash

MAGIC = b"FSKVPAGE"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8sHHI16sIIQ32s")
HEADER_BYTES = _HEADER.size  # 80
CHECKSUM_BYTES = 16
FILE_SUFFIX = ".kvp"
TEMP_SUFFIX = ".tmp"


@dataclass(frozen=True, slots=True)
class PageHeader:
    fingerprint: bytes
    page_tokens: int
    n_entries: int
    payload_bytes: int
    page_hash: bytes
    flags: int = 0
    version: int = FORMAT_VERSION

    def encode(self) -> bytes:
        return _HEADER.pack(
            MAGIC,
            self.version,
            HEADER_BYTES,
            self.flags,
            self.fingerprint,
            self.page_tokens,
            self.n_entries,
            self.payload_bytes,
            self.page_hash,
        )

    @property
    def file_bytes(self) -> int:
        return HEADER_BYTES + self.payload_bytes + CHECKSUM_BYTES


def decode_header(raw: bytes) -> PageHeader | None:
    """The header, or None when the bytes are not a page file of this format."""
    if len(raw) < HEADER_BYTES:
        return None
    magic, version, header_bytes, flags, fp, pt, n, payload, page_hash = _HEADER.unpack_from(raw)
    if magic != MAGIC or version != FORMAT_VERSION or header_bytes != HEADER_BYTES:
        return None
    return PageHeader(fp, pt, n, payload, page_hash, flags, version)


def checksum(header: bytes | memoryview, payload: bytes | memoryview) -> bytes:
    h = xxhash.xxh3_128()
    h.update(header)
    h.update(payload)
    return h.digest()


def file_name(page_hash: bytes) -> str:
    return page_hash.hex() + FILE_SUFFIX


def temp_name(page_hash: bytes) -> str:
    """A temp file name no other writer can pick: ``.<hash>.<uuid4>.tmp``.

    Not pid-based: in containers every server is pid 1, and pids on other hosts
    sharing the directory mean nothing here (docs/design/kvstore.md, "Sharing a directory").
    """
    return f".{page_hash.hex()}.{uuid.uuid4().hex}{TEMP_SUFFIX}"


class NotRegularFile(OSError):
    """A page path that is a FIFO, directory, device or socket: never read."""


def open_regular(path: str | os.PathLike[str]) -> int:
    """Open a page file for reading: a regular file only, never followed, never blocking.

    ``O_NOFOLLOW`` refuses a symlink (ELOOP); ``O_NONBLOCK`` makes opening a FIFO
    return at once instead of waiting for a writer (it changes nothing for a
    regular file); ``fstat`` on the open descriptor, not the path, decides, so a
    file swapped after a check cannot slip through.
    """
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise NotRegularFile(errno.EINVAL, f"not a regular file (mode {mode:o})", str(path))
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_into(fd: int, buf: bytearray) -> int:
    """Read from the start of ``fd`` until ``buf`` is full or the file ends; bytes read."""
    view = memoryview(buf)
    n = 0
    while n < len(buf):
        got = os.preadv(fd, [view[n:]], n)
        if got == 0:
            break
        n += got
    return n


def shard_parts(page_hash: bytes) -> tuple[str, str]:
    """Two levels of hash prefix (256 x 256 directories): no directory grows huge."""
    hx = page_hash.hex()
    return hx[0:2], hx[2:4]
