"""KVCacheManager: prefix hits, the hit cap, replay start, tenants, eviction, SSD extension."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kvstore_helpers import content_for, fill_and_commit, tiny_layout

from kvstore import (
    DevicePool,
    KVCacheManager,
    LocalKV,
    OutOfPages,
    chain_hashes,
    open_local_kv,
    pack_records,
    unpack_page,
)
from kvstore.ssd.page_file import HEADER_BYTES

LAYOUT = tiny_layout()
PT = 64


def _kv(pages: int = 16, **kw: object) -> LocalKV:
    return open_local_kv(LAYOUT, pages * LAYOUT.page_bytes, **kw)  # type: ignore[arg-type]


def test_no_hit_then_device_hit() -> None:
    kv, pool = _kv()
    tokens = list(range(3 * PT + 5))
    plan = kv.plan_restore("a", tokens, "s")
    assert (plan.hit_tokens, plan.miss_tokens) == (0, len(tokens))
    fill_and_commit_existing(kv, pool, "a", tokens, "s")
    kv.free("a")
    plan = kv.plan_restore("b", tokens, "s")
    assert plan.hit_tokens == plan.device_hit_tokens == 3 * PT
    assert plan.miss_tokens == 5


def fill_and_commit_existing(
    kv: KVCacheManager, pool: DevicePool, rid: str, tokens: list[int], salt: str
) -> None:
    table = kv.allocate(rid, len(tokens))
    for i, h in enumerate(chain_hashes(tokens, salt, PT)):
        pool.pages[table[i]] = content_for(h, LAYOUT.page_bytes)
    kv.commit_full_pages(rid, tokens, salt)


@pytest.mark.parametrize(("n_tokens", "hit_pages"), [(2 * PT, 1), (2 * PT + 1, 2), (PT, 0)])
def test_hit_is_capped_so_one_token_is_computed(n_tokens: int, hit_pages: int) -> None:
    kv, pool = _kv()
    tokens = list(range(2 * PT + 1))
    fill_and_commit(kv, pool, "w", tokens, "s")
    kv.free("w")
    plan = kv.plan_restore("r", tokens[:n_tokens], "s")
    assert plan.hit_tokens == hit_pages * PT and plan.miss_tokens >= 1


def test_tenants_never_share_pages() -> None:
    kv, pool = _kv()
    tokens = list(range(3 * PT + 1))
    fill_and_commit(kv, pool, "a", tokens, "tenant-a")
    kv.free("a")
    assert kv.plan_restore("b", tokens, "tenant-b").hit_tokens == 0
    assert kv.plan_restore("c", tokens, "tenant-a").hit_tokens == 3 * PT


def test_divergent_suffix_shares_the_common_head() -> None:
    kv, pool = _kv()
    base = list(range(4 * PT + 1))
    fill_and_commit(kv, pool, "a", base, "s")
    forked = base[: 2 * PT] + [7] * (2 * PT + 1)
    plan = kv.plan_restore("b", forked, "s")
    assert plan.hit_tokens == 2 * PT
    assert plan.page_ids == kv.block_table("a")[:2]
    # Shared pages hold two references: freeing one request keeps them in use.
    assert kv.pool.refcounts[plan.page_ids[0]] == 2
    kv.free("a")
    assert kv.pool.refcounts[plan.page_ids[0]] == 1


def test_out_of_pages_is_clean_and_cached_pages_are_evicted_first() -> None:
    kv, pool = _kv(pages=4)
    tokens = list(range(3 * PT + 1))
    fill_and_commit(kv, pool, "a", tokens, "s")  # 4 pages: 3 full (cached) + 1 partial
    with pytest.raises(OutOfPages):
        kv.allocate("b", 1)
    assert not kv.can_allocate("b", 1)
    kv.free("a")
    assert kv.stats().device_pages_cached == 3 and kv.stats().device_pages_free == 1
    kv.allocate("b", 2 * PT)  # one free page + one evicted cached page (the chain's tail)
    assert kv.stats().device_evictions == 1
    kv.free("b")
    assert kv.plan_restore("c", tokens, "s").hit_tokens == 2 * PT


def test_pages_in_use_are_never_reallocated() -> None:
    kv, pool = _kv(pages=6)
    tokens = list(range(2 * PT + 1))
    fill_and_commit(kv, pool, "a", tokens, "s")
    held = set(kv.block_table("a"))
    got = kv.allocate("b", 3 * PT)
    assert not held & set(got)
    with pytest.raises(OutOfPages):
        kv.allocate("b", 4 * PT)
    assert kv.block_table("b") == got  # a failed grow leaves the table unchanged


def test_commit_is_incremental_and_decode_fills_pages() -> None:
    kv, _ = _kv()
    tokens = list(range(PT + 10))
    kv.plan_restore("a", tokens, "s")
    kv.allocate("a", len(tokens))
    assert kv.commit_full_pages("a", tokens, "s") == 1
    assert kv.commit_full_pages("a", tokens, "s") == 0
    tokens += list(range(54))  # decode fills page 1
    kv.allocate("a", len(tokens))
    assert kv.commit_full_pages("a", tokens, "s") == 1
    kv.free("a")
    assert kv.plan_restore("b", [*tokens, 1], "s").hit_tokens == 2 * PT
    with pytest.raises(AssertionError):
        kv.commit_full_pages("b", [*tokens, 1], "other-salt")


def test_ssd_extends_a_device_prefix(tmp_path: Path) -> None:
    kv, pool = _kv(pages=6, kv_dir=tmp_path, kv_dir_bytes=10**9)
    tokens = list(range(4 * PT + 1))
    hashes = fill_and_commit(kv, pool, "a", tokens, "s")
    kv.flush()
    kv.free("a")
    # Two free pages, then LRU evicts the chain's tail first: pages 3, 2, 1 go.
    kv.allocate("evict", 5 * PT)
    kv.free("evict")
    assert kv.pool.lookup(hashes[0]) is not None
    assert all(kv.pool.lookup(h) is None for h in hashes[1:])
    before = kv.stats()
    plan = kv.plan_restore("b", tokens, "s")
    assert plan.hit_tokens == 4 * PT
    assert (plan.device_hit_tokens, plan.ssd_hit_tokens) == (PT, 3 * PT)
    for page, h in zip(plan.page_ids, hashes, strict=True):
        assert torch.equal(pool.pages[page], content_for(h, LAYOUT.page_bytes))
    after = kv.stats()
    assert after.ssd_hit_tokens - before.ssd_hit_tokens == plan.ssd_hit_tokens
    assert after.ssd.reads - before.ssd.reads == plan.ssd_hit_tokens // PT
    # Loaded pages are now device-resident cached pages.
    kv.free("b")
    assert kv.plan_restore("c", tokens, "s").device_hit_tokens == 4 * PT
    kv.close()


def test_ssd_restore_stops_where_the_pool_is_full(tmp_path: Path) -> None:
    tokens = list(range(6 * PT + 1))
    with _kv(pages=8, kv_dir=tmp_path, kv_dir_bytes=10**9) as (kv, pool):
        fill_and_commit(kv, pool, "a", tokens, "s")
    kv, pool = _kv(pages=4, kv_dir=tmp_path, kv_dir_bytes=10**9)
    kv.allocate("other", PT)  # one page busy: three left for six SSD pages
    plan = kv.plan_restore("b", tokens, "s")
    assert plan.ssd_hit_tokens == plan.hit_tokens == 3 * PT
    with pytest.raises(OutOfPages):
        kv.allocate("b", len(tokens))
    kv.close()


def test_salted_pages_on_ssd_stay_private(tmp_path: Path) -> None:
    tokens = list(range(2 * PT + 1))
    with _kv(kv_dir=tmp_path, kv_dir_bytes=10**9) as (kv, pool):
        fill_and_commit(kv, pool, "a", tokens, "tenant-a")
    with _kv(kv_dir=tmp_path, kv_dir_bytes=10**9) as (kv, pool):
        assert kv.plan_restore("b", tokens, "tenant-b").hit_tokens == 0
        assert kv.plan_restore("c", tokens, "tenant-a").ssd_hit_tokens == 2 * PT


def test_records_written_through_page_tensors_reach_the_file(tmp_path: Path) -> None:
    """End to end: quantised-record bytes -> device views -> SSD file -> records again."""
    kv, pool = _kv(kv_dir=tmp_path, kv_dir_bytes=10**9)
    tokens = list(range(PT + 1))
    kv.plan_restore("a", tokens, "s")
    (page, _) = kv.allocate("a", len(tokens))
    src = pool.source(4)
    records = torch.randint(0, 256, (64, 288), dtype=torch.uint8)
    keys = torch.randint(0, 256, (64, 68), dtype=torch.uint8)
    src.main_data[page] = records[:, :256]
    src.main_scales[page] = records[:, 256:]
    src.index_data[page] = keys[:, :64]
    src.index_scales[page] = keys[:, 64:]
    kv.commit_full_pages("a", tokens, "s")
    kv.flush()
    assert kv.store is not None
    (h,) = chain_hashes(tokens, "s", PT)
    raw = kv.store.path(h).read_bytes()
    main_off, index_off = LAYOUT.offsets(4)
    payload = torch.frombuffer(bytearray(raw[HEADER_BYTES:]), dtype=torch.uint8)
    main_page = payload[main_off : main_off + 64 * 288]
    assert torch.equal(main_page, pack_records(records, 256))
    assert torch.equal(unpack_page(main_page, 288, 256), records)
    assert torch.equal(unpack_page(payload[index_off : index_off + 64 * 68], 68, 64), keys)
    kv.close()


def test_stats_count_lookups_and_hits() -> None:
    kv, pool = _kv()
    tokens = list(range(2 * PT + 1))
    fill_and_commit(kv, pool, "a", tokens, "s")
    kv.free("a")
    kv.plan_restore("b", tokens, "s")
    s = kv.stats()
    assert (s.lookups, s.lookup_tokens, s.device_hit_tokens) == (2, 2 * len(tokens), 2 * PT)
    assert s.ssd_hit_tokens == 0 and not s.ssd.enabled
    assert s.device_pages_in_use == 2 and s.device_pages_total == 16
