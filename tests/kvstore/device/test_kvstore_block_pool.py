"""BlockPool: refcounts, free list, prefix-cache map and LRU eviction."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvstore import BlockPool, OutOfPages

N_PAGES = 8


def _h(tag: int) -> bytes:
    return tag.to_bytes(32, "little")


def _check_invariants(pool: BlockPool, held: dict[int, list[int]]) -> None:
    counts = [0] * pool.num_pages
    for pages in held.values():
        for p in pages:
            counts[p] += 1
    assert pool.refcounts == counts
    free, lru = set(pool.free_list), set(pool.lru)
    assert len(free) == len(pool.free_list) and not free & lru
    assert all(counts[p] == 0 and p not in pool.page_to_hash for p in free)
    assert all(counts[p] == 0 and p in pool.page_to_hash for p in lru)
    in_use = sum(c > 0 for c in counts)
    assert len(free) + len(lru) + in_use == pool.num_pages == pool.num_available + pool.num_in_use
    assert {h: p for p, h in pool.page_to_hash.items()} == pool.hash_to_page


ops = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "register", "share", "release"]),
        st.integers(0, 3),  # request
        st.integers(0, 10),  # size / index / pick
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(ops)
def test_random_sequences_never_free_a_page_in_use(sequence: list[tuple[str, int, int]]) -> None:
    pool = BlockPool(N_PAGES)
    held: dict[int, list[int]] = {r: [] for r in range(4)}
    content: dict[int, int] = {}  # page -> tag of the bytes written at allocation
    next_tag = 0
    known: list[int] = []  # tags ever registered
    for op, r, k in sequence:
        if op == "alloc":
            available = pool.num_available
            if k > available:
                with pytest.raises(OutOfPages):
                    pool.allocate(k)
                assert pool.num_available == available  # nothing taken
            else:
                pages = pool.allocate(k)
                in_use = {p for ps in held.values() for p in ps}
                assert not set(pages) & in_use, "handed out a page someone holds"
                for p in pages:
                    content[p] = next_tag
                    next_tag += 1
                held[r].extend(pages)
        elif op == "register" and held[r]:
            page = held[r][k % len(held[r])]
            pool.register(page, _h(content[page]))
            known.append(content[page])
        elif op == "share" and known:
            tag = known[k % len(known)]
            page = pool.lookup(_h(tag))
            if page is not None:
                assert content[page] == tag, "lookup returned a page whose bytes changed"
                pool.share(page)
                held[r].append(page)
        elif op == "release":
            pool.release(list(reversed(held[r])))
            held[r] = []
        _check_invariants(pool, held)


def test_out_of_pages_allocates_nothing() -> None:
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(OutOfPages) as err:
        pool.allocate(2)
    assert (err.value.needed, err.value.available) == (2, 1)
    assert pool.num_available == 1


def test_cached_pages_stay_until_needed_then_lru_goes_first() -> None:
    pool = BlockPool(4)
    a = pool.allocate(2)  # a chain: head a[0], tail a[1]
    b = pool.allocate(1)
    for page, tag in ((a[0], 1), (a[1], 2), (b[0], 3)):
        pool.register(page, _h(tag))
    pool.release(list(reversed(a)))  # tail released first -> evicted first
    pool.release(b)
    assert pool.lookup(_h(1)) == a[0] and pool.num_available == 4
    got = pool.allocate(2)  # one free page, then the least recently released (a's tail)
    assert a[1] in got and pool.lookup(_h(2)) is None
    assert pool.lookup(_h(1)) == a[0] and pool.lookup(_h(3)) == b[0]
    assert pool.evictions == 1


def test_share_pins_a_cached_page_against_eviction() -> None:
    pool = BlockPool(2)
    (p,) = pool.allocate(1)
    pool.register(p, _h(7))
    pool.release([p])
    pool.share(pool.lookup(_h(7)))  # type: ignore[arg-type]
    assert pool.num_available == 1
    (q,) = pool.allocate(1)
    assert q != p
    with pytest.raises(OutOfPages):
        pool.allocate(1)


def test_duplicate_hash_keeps_first_copy() -> None:
    pool = BlockPool(3)
    p, q = pool.allocate(2)
    assert pool.register(p, _h(5))
    assert not pool.register(q, _h(5))
    pool.release([q])  # the duplicate was never cached: back on the free list
    assert q in pool.free_list and pool.lookup(_h(5)) == p
