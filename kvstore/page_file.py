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

import struct
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


def shard_parts(page_hash: bytes) -> tuple[str, str]:
    """Two levels of hash prefix (256 x 256 directories): no directory grows huge."""
    hx = page_hash.hex()
    return hx[0:2], hx[2:4]
