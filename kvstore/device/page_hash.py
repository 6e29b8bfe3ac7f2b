"""Prefix-cache page hashes (docs/design/architecture.md §2.3).

hash(page i) = BLAKE3(seed, hash(page i - 1), salt, the page's token ids).
The seed is a fixed string, never Python's randomised ``hash``, so the same
tokens and salt give the same 32 bytes in every process and after a restart;
the persistent tier names its files by this hash. The salt is length-prefixed
and the tokens are fixed-width little-endian int64, so no two different
(salt, tokens) inputs encode to the same bytes: tenants never share pages.
"""

from __future__ import annotations

from collections.abc import Sequence

import blake3
import numpy as np

HASH_SEED = b"flashserve/kvstore/page-hash/v1"
HASH_BYTES = 32
# The parent of a sequence's first page.
ROOT_HASH = bytes(HASH_BYTES)

Salt = bytes | str


def salt_bytes(salt: Salt) -> bytes:
    return salt.encode("utf-8") if isinstance(salt, str) else bytes(salt)


def page_hash(parent: bytes, token_ids: Sequence[int], salt: Salt) -> bytes:
    """Hash of one full page chained to its parent's hash (``ROOT_HASH`` for page 0)."""
    assert len(parent) == HASH_BYTES
    s = salt_bytes(salt)
    h = blake3.blake3(HASH_SEED)
    h.update(parent)
    h.update(len(s).to_bytes(8, "little"))
    h.update(s)
    h.update(np.asarray(token_ids, dtype="<i8").tobytes())
    return h.digest(length=HASH_BYTES)


def chain_hashes(
    token_ids: Sequence[int],
    salt: Salt,
    page_tokens: int,
    n_pages: int | None = None,
    parent: bytes = ROOT_HASH,
    first_page: int = 0,
) -> list[bytes]:
    """Hashes of full pages ``first_page, first_page + 1, ...`` of ``token_ids``.

    ``parent`` is the hash of page ``first_page - 1`` (``ROOT_HASH`` when starting
    at 0). Stops at the last full page, or after ``n_pages`` pages.
    """
    full = len(token_ids) // page_tokens
    end = full if n_pages is None else min(full, first_page + n_pages)
    out: list[bytes] = []
    for i in range(first_page, end):
        parent = page_hash(parent, token_ids[i * page_tokens : (i + 1) * page_tokens], salt)
        out.append(parent)
    return out
