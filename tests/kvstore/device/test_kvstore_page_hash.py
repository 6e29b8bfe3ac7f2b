"""Prefix-cache hash chain: stable across processes, separated by salt."""

from __future__ import annotations

import json
import struct

import blake3
from hypothesis import given, settings
from hypothesis import strategies as st
from kvstore_helpers import run_worker, tiny_layout

from kvstore import ROOT_HASH, chain_hashes, page_hash
from kvstore.device.page_hash import HASH_SEED, SpanKey


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


# ------------------------------------------------------------ image spans


def _span_oracle(parent: bytes, tokens: list[int], salt: bytes, spans) -> bytes:
    """A page over spans: the text encoding, then b"spans", the count and per span
    (start relative to the page, signed; length; hash length; hash)."""
    raw = HASH_SEED + parent + struct.pack("<Q", len(salt)) + salt
    raw += b"".join(struct.pack("<q", t) for t in tokens)
    raw += b"spans" + struct.pack("<Q", len(spans))
    for start, length, content in spans:
        raw += struct.pack("<qQQ", start, length, len(content)) + content
    return blake3.blake3(raw).digest()


IMG = 7
A, B = b"a" * 32, b"b" * 32


def _image_prompt() -> list[int]:
    # Pages of 4: text [0, 6), an image [6, 15), text [15, 20).
    return [100 + i for i in range(6)] + [IMG] * 9 + [200 + i for i in range(5)]


def test_pages_over_a_span_hash_the_image_and_where_the_page_cuts_it() -> None:
    ids = _image_prompt()
    chain = chain_hashes(ids, b"s", 4, spans=[SpanKey(6, 9, A)])
    text = chain_hashes(ids, b"s", 4)
    assert chain[0] == text[0]  # page 0 holds no image position
    # Page 1 holds [4, 8): the span starts 2 in; page 2 [8, 12) is 2 before it started.
    assert chain[1] == _span_oracle(chain[0], ids[4:8], b"s", [(2, 9, A)])
    assert chain[2] == _span_oracle(chain[1], ids[8:12], b"s", [(-2, 9, A)])
    assert chain[3] == _span_oracle(chain[2], ids[12:16], b"s", [(-6, 9, A)])
    assert chain[4] == page_hash(chain[3], ids[16:20], b"s")  # past the span: a text page


def test_equal_images_share_pages_and_another_image_differs_from_its_first_page() -> None:
    ids = _image_prompt()
    a = chain_hashes(ids, b"", 4, spans=[SpanKey(6, 9, A)])
    assert a == chain_hashes(ids, b"", 4, spans=[SpanKey(6, 9, bytes(A))])
    b = chain_hashes(ids, b"", 4, spans=[SpanKey(6, 9, B)])
    assert a[0] == b[0] and all(x != y for x, y in zip(a[1:], b[1:], strict=True))


def test_a_page_of_placeholders_is_keyed_by_which_part_of_the_span_it_holds() -> None:
    """Page 1 [4, 8) holds only placeholders in both chains, after the same text page 0:
    it holds positions 0-3 of image A in one and 0-2 (from 5 on) in the other."""
    ids = [1, 2, 3, 4] + [IMG] * 8
    parent = page_hash(ROOT_HASH, ids[:4], b"")

    def page_1(offset: int) -> bytes:
        span = [SpanKey(offset, 9, A)]
        (h,) = chain_hashes(ids, b"", 4, n_pages=1, parent=parent, first_page=1, spans=span)
        return h

    assert page_1(4) != page_1(5)
    # Committing in steps gives the one chain.
    spans = [SpanKey(4, 9, A)]
    whole = chain_hashes(ids, b"", 4, spans=spans)
    head = chain_hashes(ids, b"", 4, n_pages=1, spans=spans)
    tail = chain_hashes(ids, b"", 4, parent=head[-1], first_page=1, spans=spans)
    assert head + tail == whole and whole[1] == page_1(4)
