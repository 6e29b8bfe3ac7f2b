"""Persistent tier on a real filesystem: restart, corruption, budget, stray files."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from kvstore_helpers import content_for, run_worker, tiny_layout

from kvstore import DevicePool, KVCacheManager, PersistentStore, open_local_kv
from kvstore.ssd.page_file import CHECKSUM_BYTES, HEADER_BYTES

LAYOUT = tiny_layout()
PT = LAYOUT.page_tokens
TOKENS = list(range(5 * PT + 10))  # 5 full pages, hit cap 5


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[bytes]]:
    """A directory whose pages another process wrote (once per module: it is slow)."""
    kv_dir = tmp_path_factory.mktemp("written")
    out = run_worker("write", kv_dir, len(TOKENS), "tenant")
    return kv_dir, [bytes.fromhex(h) for h in out["hashes"]]


@pytest.fixture
def hashes(written: tuple[Path, list[bytes]], tmp_path: Path) -> list[bytes]:
    """A private copy of the written directory at ``tmp_path``; returns the page hashes."""
    shutil.copytree(written[0], tmp_path, dirs_exist_ok=True, copy_function=shutil.copy2)
    return written[1]


def _restore(kv_dir: Path, **kw: object) -> tuple[KVCacheManager, DevicePool, object]:
    kv, pool = open_local_kv(
        LAYOUT, 16 * LAYOUT.page_bytes, kv_dir=kv_dir, kv_dir_bytes=10**9, **kw
    )
    return kv, pool, kv.plan_restore("q", TOKENS, "tenant")


def test_write_restart_find_read_back_identical(tmp_path: Path, hashes: list[bytes]) -> None:
    kv, pool, plan = _restore(tmp_path)
    assert plan.hit_tokens == plan.ssd_hit_tokens == 5 * PT
    assert plan.device_hit_tokens == 0 and plan.miss_tokens == 10
    for page, h in zip(plan.page_ids, hashes, strict=True):
        assert torch.equal(pool.pages[page], content_for(h, LAYOUT.page_bytes))
    s = kv.stats().ssd
    assert (s.files, s.reads, s.checksum_failures, s.skipped_files) == (5, 5, 0, 0)
    kv.close()


def _flip(path: Path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x40
    path.write_bytes(raw)


def _truncate(path: Path) -> None:
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)


def _extend(path: Path) -> None:
    with open(path, "ab") as f:
        f.write(b"\0")


def _wrong_fingerprint(path: Path, h: bytes) -> None:
    other = tiny_layout(model_id="another-checkpoint")
    store = PersistentStore(path.parent / "other-model", other, budget_bytes=10**9)
    store.put(h, content_for(h, other.page_bytes))
    store.close()
    path.write_bytes(store.path(h).read_bytes())


FAULTS = {
    # name: (damage, counter it must raise when done before restart)
    "flip_payload": (lambda p, h: _flip(p, HEADER_BYTES + 1000), "checksum_failures"),
    "flip_checksum": (lambda p, h: _flip(p, p.stat().st_size - 1), "checksum_failures"),
    "flip_header_fingerprint": (lambda p, h: _flip(p, 20), "skipped_files"),
    "flip_magic": (lambda p, h: _flip(p, 0), "skipped_files"),
    "truncate": (lambda p, h: _truncate(p), "skipped_files"),
    "extend": (lambda p, h: _extend(p), "skipped_files"),
    "wrong_fingerprint": (_wrong_fingerprint, "skipped_files"),
    "delete": (lambda p, h: p.unlink(), None),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_damaged_file_before_restart_is_a_miss_never_a_wrong_page(
    tmp_path: Path, hashes: list[bytes], fault: str
) -> None:
    damage, counter = FAULTS[fault]
    victim = PersistentStore(tmp_path, LAYOUT, budget_bytes=10**9)
    path = victim.path(hashes[2])
    victim.close()
    damage(path, hashes[2])
    kv, pool, plan = _restore(tmp_path)
    # Pages 0 and 1 are served; the chain stops at the damaged page 2.
    assert plan.hit_tokens == 2 * PT
    for page, h in zip(plan.page_ids, hashes, strict=False):
        assert torch.equal(pool.pages[page], content_for(h, LAYOUT.page_bytes))
    s = kv.stats().ssd
    if counter is not None:
        assert getattr(s, counter) == 1
    assert not path.exists(), "a damaged file must be deleted"
    kv.close()


@pytest.mark.parametrize("fault", ["flip_payload", "truncate", "extend", "delete"])
def test_damage_after_start_is_detected_at_read(
    tmp_path: Path, hashes: list[bytes], fault: str
) -> None:
    kv, _ = open_local_kv(LAYOUT, 16 * LAYOUT.page_bytes, kv_dir=tmp_path, kv_dir_bytes=10**9)
    assert kv.store is not None and len(kv.store) == 5
    path = kv.store.path(hashes[3])
    FAULTS[fault][0](path, hashes[3])
    plan = kv.plan_restore("q", TOKENS, "tenant")
    assert plan.hit_tokens == 3 * PT
    s = kv.stats().ssd
    if fault == "delete":
        assert s.missing_files == 1
    else:
        assert s.checksum_failures == 1 and not path.exists()
    assert s.files == 4
    # Page 4 was loaded and verified before the cut: it stays cached on the device.
    kv.free("q")
    again = kv.plan_restore("q2", TOKENS, "tenant")
    assert again.hit_tokens == 3 * PT and again.device_hit_tokens == 3 * PT
    kv.close()


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stray_temp_files_are_judged_by_age_not_pid(tmp_path: Path, hashes: list[bytes]) -> None:
    store = PersistentStore(tmp_path, LAYOUT, budget_bytes=10**9)
    shard = store.path(hashes[0]).parent
    store.close()
    # Old (pid-style name of a live process, even ours): a writer that died long ago.
    old = shard / f".{hashes[0].hex()}.{os.getpid()}.1.tmp"
    old.write_bytes(b"half a page")
    two_hours_ago = time.time() - 7200
    os.utime(old, (two_hours_ago, two_hours_ago))
    # Fresh, though its pid is dead here: a live writer in another container or host.
    fresh = shard / f".{hashes[1].hex()}.{_dead_pid()}.1.tmp"
    fresh.write_bytes(b"being written")
    store = PersistentStore(tmp_path, LAYOUT, budget_bytes=10**9)
    s = store.stats()
    assert s.stray_temp_files == 1 and not old.exists() and fresh.exists()
    assert s.files == 5 and s.skipped_files == 0
    store.close()
    # The threshold is a parameter: with 0 every temp file is stale.
    store = PersistentStore(tmp_path, LAYOUT, budget_bytes=10**9, stale_temp_s=0)
    assert store.stats().stray_temp_files == 1 and not fresh.exists()
    store.close()


def test_file_in_wrong_shard_or_bad_name_is_skipped(tmp_path: Path, hashes: list[bytes]) -> None:
    store = PersistentStore(tmp_path, LAYOUT, budget_bytes=10**9)
    good = store.path(hashes[0])
    store.close()
    moved = store.root / "00" / "00" / good.name
    moved.parent.mkdir(parents=True, exist_ok=True)
    good.rename(moved)
    bad_name = good.parent / ("zz" + good.name[2:])
    store.path(hashes[1]).rename(bad_name)
    unrelated = good.parent / "README"
    unrelated.write_text("not ours")
    store = PersistentStore(tmp_path, LAYOUT, budget_bytes=10**9)
    s = store.stats()
    assert (s.files, s.skipped_files) == (3, 2)
    assert not moved.exists() and not bad_name.exists() and unrelated.exists()
    store.close()


def test_other_models_subtree_is_left_alone(tmp_path: Path, hashes: list[bytes]) -> None:
    other = PersistentStore(tmp_path, tiny_layout(model_id="m2"), budget_bytes=10**9)
    assert len(other) == 0 and other.stats().skipped_files == 0
    other.close()
    assert len(PersistentStore(tmp_path, LAYOUT, budget_bytes=10**9)) == len(hashes)


def _put_sync(store: PersistentStore, h: bytes) -> None:
    assert store.put(h, content_for(h, LAYOUT.page_bytes))
    store.flush()
    time.sleep(0.01)  # distinct mtimes even on coarse filesystem clocks


def _on_disk(store: PersistentStore) -> set[bytes]:
    return {bytes.fromhex(p.stem) for p in store.root.rglob("*.kvp")}


def test_budget_evicts_least_recently_used(tmp_path: Path) -> None:
    file_bytes = HEADER_BYTES + LAYOUT.page_bytes + CHECKSUM_BYTES
    store = PersistentStore(tmp_path, LAYOUT, budget_bytes=3 * file_bytes + 100)
    hs = [bytes([i]) * 32 for i in range(6)]
    for h in hs[:5]:
        _put_sync(store, h)
    assert _on_disk(store) == set(hs[2:5])
    assert store.get(hs[2]) is not None  # touch: hs[3] is now the oldest
    _put_sync(store, hs[5])
    assert _on_disk(store) == {hs[2], hs[4], hs[5]}
    s = store.stats()
    assert s.evictions == 3 and s.bytes == 3 * file_bytes <= s.budget_bytes
    assert sum(p.stat().st_size for p in store.root.rglob("*.kvp")) == s.bytes
    store.close()
    # After a restart with a smaller budget the least recently used goes first
    # (files older than the grace period: 0 here; by default a just-used file stays).
    time.sleep(0.01)
    store = PersistentStore(tmp_path, LAYOUT, budget_bytes=2 * file_bytes, evict_grace_s=0)
    assert _on_disk(store) == {hs[2], hs[5]} == set(store._index)
    store.close()


def test_budget_below_one_page_stores_nothing(tmp_path: Path) -> None:
    store = PersistentStore(tmp_path, LAYOUT, budget_bytes=LAYOUT.page_bytes)
    h = bytes(32)
    assert store.put(h, content_for(h, LAYOUT.page_bytes))
    store.close()
    s = store.stats()
    assert s.files == 0 and s.dropped_writes == 1 and not _on_disk(store)


def test_write_queue_is_bounded(tmp_path: Path) -> None:
    store = PersistentStore(tmp_path, LAYOUT, budget_bytes=10**9, max_pending_writes=0)
    h = bytes(32)
    assert not store.put(h, content_for(h, LAYOUT.page_bytes))
    assert store.stats().dropped_writes == 1
    store.close()


def test_write_is_off_the_callers_thread_and_snapshots_bytes(tmp_path: Path) -> None:
    import threading

    store = PersistentStore(tmp_path, LAYOUT, budget_bytes=10**9)
    seen: list[str] = []
    real = store._write_one

    def spy(*args: object) -> bool:
        seen.append(threading.current_thread().name)
        return real(*args)  # type: ignore[arg-type]

    store._write_one = spy  # type: ignore[method-assign]
    h = bytes(32)
    page = content_for(h, LAYOUT.page_bytes).clone()
    expect = page.clone()
    store.put(h, page)
    page.zero_()  # the device page is reused right away
    store.flush()
    assert seen and seen[0].startswith("kv-ssd-write")
    got = store.get(h)
    assert got is not None and torch.equal(torch.frombuffer(got, dtype=torch.uint8), expect)
    store.close()


def test_chain_over_budget_keeps_its_head_most_recently_used(tmp_path: Path) -> None:
    file_bytes = HEADER_BYTES + LAYOUT.page_bytes + CHECKSUM_BYTES
    store = PersistentStore(tmp_path, LAYOUT, budget_bytes=3 * file_bytes)
    chain = [bytes([i + 1]) * 32 for i in range(5)]
    assert store.put_chain([(h, content_for(h, LAYOUT.page_bytes)) for h in chain]) == 5
    store.flush()
    # A tail without its head is unreachable: the head is what must survive.
    assert _on_disk(store) == set(chain[:3]) and store.stats().dropped_writes == 1
    assert list(store._index) == [chain[2], chain[1], chain[0]]  # eviction order: tail first
    store.close()


def test_uncreatable_directory_disables_writes(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    tokens = list(range(2 * PT + 1))
    with open_local_kv(LAYOUT, 8 * LAYOUT.page_bytes, kv_dir=blocker / "kv") as (kv, _):
        plan = kv.plan_restore("a", tokens, "s")
        kv.allocate("a", len(tokens))
        assert kv.commit_full_pages("a", tokens, "s") == 2  # the device tier still caches
        s = kv.stats().ssd
        assert s.write_errors == 1 and not s.writes_enabled and s.files == 0
    assert plan.hit_tokens == 0


# ------------------------------------------------------- a directory shared by processes


def test_pages_published_after_start_are_found_by_lookup(
    written: tuple[Path, list[bytes]], tmp_path: Path
) -> None:
    """A decode worker opened the directory before a prefill worker wrote into it."""
    kv, pool = open_local_kv(LAYOUT, 16 * LAYOUT.page_bytes, kv_dir=tmp_path, kv_dir_bytes=10**9)
    assert kv.stats().ssd.files == 0
    shutil.copytree(written[0], tmp_path, dirs_exist_ok=True, copy_function=shutil.copy2)
    plan = kv.plan_restore("q", TOKENS, "tenant")
    assert plan.ssd_hit_tokens == 5 * PT
    for page, h in zip(plan.page_ids, written[1], strict=True):
        assert torch.equal(pool.pages[page], content_for(h, LAYOUT.page_bytes))
    s = kv.stats().ssd
    assert (s.discovered_files, s.files, s.bytes) == (5, 5, 5 * s.file_bytes)
    kv.close()


def test_a_corrupted_published_page_ends_the_hit_there(
    written: tuple[Path, list[bytes]], tmp_path: Path
) -> None:
    kv, _ = open_local_kv(LAYOUT, 16 * LAYOUT.page_bytes, kv_dir=tmp_path, kv_dir_bytes=10**9)
    shutil.copytree(written[0], tmp_path, dirs_exist_ok=True, copy_function=shutil.copy2)
    _flip(kv.store.path(written[1][2]), HEADER_BYTES + 7)
    truncated = kv.store.path(written[1][4])
    truncated.write_bytes(truncated.read_bytes()[:-1])  # never indexed: wrong size
    plan = kv.plan_restore("q", TOKENS, "tenant")
    assert plan.hit_tokens == 2 * PT  # pages 0 and 1; page 2 fails its checksum
    s = kv.stats().ssd
    assert s.checksum_failures == 1 and not kv.store.path(written[1][2]).exists()
    kv.close()


def test_wait_published_counts_the_durable_head_of_a_chain(tmp_path: Path) -> None:
    kv, _ = open_local_kv(LAYOUT, 16 * LAYOUT.page_bytes, kv_dir=tmp_path, kv_dir_bytes=10**9)
    kv.plan_restore("w", TOKENS, "tenant")
    kv.allocate("w", len(TOKENS))
    kv.commit_full_pages("w", TOKENS, "tenant")
    chain = kv.publish("w")
    assert len(chain) == 5
    assert kv.wait_published(chain, timeout=30) == 5
    assert all(kv.store.path(h).stat().st_size == kv.store.file_bytes for h in chain)
    # A missing middle page cuts the usable chain there.
    kv.store.path(chain[1]).unlink()
    other, _ = open_local_kv(LAYOUT, 16 * LAYOUT.page_bytes, kv_dir=tmp_path, kv_dir_bytes=10**9)
    assert other.wait_published(chain) == 1
    # Publishing again rewrites what the device still holds.
    kv.store._drop(chain[1])  # the tier forgot it (as after an eviction)
    kv.publish("w")
    assert kv.wait_published(chain, timeout=30) == 5
    kv.close()
    other.close()
