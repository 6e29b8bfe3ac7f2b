"""Prefix-cache hash chain: stable across processes, separated by salt."""

from __future__ import annotations

import json
import struct

import blake3
from hypothesis import given, settings
from hypothesis import strategies as st
from kvstore_helpers import run_worker, tiny_layout

from kvstore import ROOT_HASH, chain_hashes, page_hash
from kvstore.device.page_hash import HASH_SEED


def _oracle(parent: bytes, tokens: list[int], salt: bytes) -> bytes:
    """The documented encoding, written out with struct instead of numpy."""
    raw = HASH_SEED + parent + struct.pack("<Q", len(salt)) + salt
    raw += b"".join(struct.pack("<q", t) for t in tokens)
    return blake3.blake3(raw).digest()


def test_hash_matches_documented_encoding() -> None:
    tokens = [0, 1, 129279, 5, 2**31 + 7]
    h0 = page_hash(ROOT_HASH, tokens, "tenant-a")
    assert h0 == _oracle(bytes(32), tokens, b"tenant-a")
    assert page_hash(h0, [9, 9], b"tenant-a") == _oracle(h0, [9, 9], b"tenant-a")


def test_same_tokens_and_salt_give_same_chain_in_another_process() -> None:
    tokens = list(range(1000, 1000 + 5 * 16 + 3))
    here = [h.hex() for h in chain_hashes(tokens, "user-7", 16)]
    there = run_worker("hash", json.dumps(tokens), "user-7", 16)
    assert len(here) == 5 and here == there["hashes"]
    # The layout fingerprint (which names the SSD subtree) is just as stable.
    assert there["fingerprint"] == tiny_layout().fingerprint


def test_chain_links_pages() -> None:
    tokens = list(range(64))
    chain = chain_hashes(tokens, "s", 16)
    changed = chain_hashes([99, *tokens[1:]], "s", 16)
    # A change in page 0 changes every later page's hash.
    assert all(a != b for a, b in zip(chain, changed, strict=True))
    # Resuming the chain from a parent gives the same tail.
    assert chain_hashes(tokens, "s", 16, parent=chain[1], first_page=2) == chain[2:]
    assert chain_hashes(tokens, "s", 16, n_pages=2) == chain[:2]
    assert chain_hashes(tokens[:63], "s", 16) == chain[:3]  # partial page not hashed


def test_length_prefixed_salt_prevents_boundary_ambiguity() -> None:
    # Naive salt||tokens would make these two inputs identical byte strings.
    t0 = 12345
    shifted_salt = struct.pack("<q", t0)
    assert page_hash(ROOT_HASH, [t0, 7], b"") != page_hash(ROOT_HASH, [7], shifted_salt)


@settings(max_examples=100, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 129279), min_size=4, max_size=24),
    salt_a=st.binary(max_size=12),
    salt_b=st.binary(max_size=12),
)
def test_different_salt_never_meets_another_tenants_chain(
    tokens: list[int], salt_a: bytes, salt_b: bytes
) -> None:
    a = chain_hashes(tokens, salt_a, 4)
    b = chain_hashes(tokens, salt_b, 4)
    if salt_a == salt_b:
        assert a == b
    else:
        assert not set(a) & set(b)


def test_str_salt_is_its_utf8_bytes() -> None:
    assert page_hash(ROOT_HASH, [1], "ü") == page_hash(ROOT_HASH, [1], "ü".encode())
