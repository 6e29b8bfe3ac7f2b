"""Prefix-cache page hashes (docs/design/architecture.md §2.3).

hash(page i) = BLAKE3(seed, hash(page i - 1), salt, the page's token ids
[, the spans over the page]). The seed is a fixed string, never Python's
randomised ``hash``, so the same tokens and salt give the same 32 bytes in
every process and after a restart; the persistent tier names its files by
this hash. The salt is length-prefixed and the tokens are fixed-width
little-endian int64, so no two different (salt, tokens) inputs encode to the
same bytes: tenants never share pages.

A span (``SpanKey``) is a run of positions whose content is not their token
ids: every position of an image's span holds the same placeholder id, so two
prompts with different images of one size have equal ids. A page that any
span overlaps also hashes, per span in prompt order, the span's start relative
to the page's first position (negative when the span began on an earlier
page), its length and its content hash: equal images key their pages alike,
and a different image changes the hash of the first page it touches, so of
every page after it (the chain). A page no span touches hashes exactly as a
text page, so text caches are unchanged. Every page hash of the system (the
device prefix cache, the SSD tier's file names, the prefill worker's hand-over)
is ``chain_hashes`` over these inputs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import blake3
import numpy as np

HASH_SEED = b"flashserve/kvstore/page-hash/v1"
HASH_BYTES = 32
# The parent of a sequence's first page.
ROOT_HASH = bytes(HASH_BYTES)

Salt = bytes | str


# Marks the spans' part of a page's input (after the token ids, whose length a
# chain fixes: every page of it holds ``page_tokens`` ids).
_SPANS_TAG = b"spans"


@dataclass(frozen=True, slots=True)
class SpanKey:
    """Positions ``[offset, offset + length)`` of a sequence whose content is
    ``content_hash`` (an image's span), not their token ids."""

    offset: int
    length: int
    content_hash: bytes

    @property
    def end(self) -> int:
        return self.offset + self.length


def salt_bytes(salt: Salt) -> bytes:
    return salt.encode("utf-8") if isinstance(salt, str) else bytes(salt)


def page_hash(
    parent: bytes,
    token_ids: Sequence[int],
    salt: Salt,
    spans: Sequence[tuple[int, int, bytes]] = (),
) -> bytes:
    """Hash of one full page chained to its parent's hash (``ROOT_HASH`` for page 0).

    ``spans``: ``(start relative to the page, length, content hash)`` of each span
    overlapping the page, in order (none: a text page)."""
    assert len(parent) == HASH_BYTES
    s = salt_bytes(salt)
    h = blake3.blake3(HASH_SEED)
    h.update(parent)
    h.update(len(s).to_bytes(8, "little"))
    h.update(s)
    h.update(np.asarray(token_ids, dtype="<i8").tobytes())
    if spans:
        h.update(_SPANS_TAG + len(spans).to_bytes(8, "little"))
        for start, length, content in spans:
            h.update(start.to_bytes(8, "little", signed=True))
            h.update(length.to_bytes(8, "little"))
            h.update(len(content).to_bytes(8, "little"))
            h.update(content)
    return h.digest(length=HASH_BYTES)


def page_spans(spans: Sequence[SpanKey], first: int, end: int) -> list[tuple[int, int, bytes]]:
    """The ``page_hash`` terms of the spans overlapping positions ``[first, end)``."""
    return [
        (k.offset - first, k.length, k.content_hash)
        for k in spans
        if k.offset < end and k.end > first
    ]


def chain_hashes(
    token_ids: Sequence[int],
    salt: Salt,
    page_tokens: int,
    n_pages: int | None = None,
    parent: bytes = ROOT_HASH,
    first_page: int = 0,
    spans: Sequence[SpanKey] = (),
) -> list[bytes]:
    """Hashes of full pages ``first_page, first_page + 1, ...`` of ``token_ids``.

    ``parent`` is the hash of page ``first_page - 1`` (``ROOT_HASH`` when starting
    at 0). Stops at the last full page, or after ``n_pages`` pages. ``spans``: the
    sequence's image spans (``SpanKey``), in positions of ``token_ids``.
    """
    full = len(token_ids) // page_tokens
    end = full if n_pages is None else min(full, first_page + n_pages)
    out: list[bytes] = []
    for i in range(first_page, end):
        lo, hi = i * page_tokens, (i + 1) * page_tokens
        parent = page_hash(parent, token_ids[lo:hi], salt, page_spans(spans, lo, hi))
        out.append(parent)
    return out
