"""Servers sharing one --kv-dir (docs/design/kvstore.md, "Sharing a directory"): no one disables,
loses or deletes another's writes, whatever their pids or budgets."""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest
import torch
from kvstore_helpers import content_for, fill_and_commit, spawn_worker, tiny_layout
from kvstore_worker import burst_hash

from kvstore import PersistentStore, chain_hashes, open_local_kv
from kvstore.ssd.page_file import CHECKSUM_BYTES, HEADER_BYTES

LAYOUT = tiny_layout()
FILE_BYTES = HEADER_BYTES + LAYOUT.page_bytes + CHECKSUM_BYTES


def _page(h: bytes) -> torch.Tensor:
    return content_for(h, LAYOUT.page_bytes)


def _served_right(store: PersistentStore, h: bytes) -> bool:
    got = store.get(h)
    return got is not None and torch.equal(torch.frombuffer(got, dtype=torch.uint8), _page(h))


class _PausedRename:
    """Holds the first ``os.rename`` (a writer between fsync and rename) until released."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.at_rename = threading.Event()
        self.release = threading.Event()
        self.paused_temp: str = ""
        real = os.rename

        def rename(src: str, dst: str) -> None:
            if not self.at_rename.is_set():
                self.paused_temp = str(src)
                self.at_rename.set()
                assert self.release.wait(10), "the test never released the writer"
            real(src, dst)

        monkeypatch.setattr(os, "rename", rename)


def test_two_writers_of_one_pid_do_not_collide_on_a_temp_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two stores in one process share a pid, like two pid-1 containers on one volume.
    # With ".<hash>.<pid>.<seq>.tmp" both picked the same temp name for the same
    # page: the second one's O_EXCL create failed (EEXIST) and turned its writes off.
    a = PersistentStore(tmp_path, LAYOUT, budget_bytes=10**9)
    b = PersistentStore(tmp_path, LAYOUT, budget_bytes=10**9)
    paused = _PausedRename(monkeypatch)
    h = bytes([7]) * 32
    assert a.put(h, _page(h))
    assert paused.at_rename.wait(10)
    assert Path(paused.paused_temp).exists()
    assert b.put(h, _page(h))
    b.flush()  # b's temp file, write and rename while a's temp file exists
    paused.release.set()
    a.flush()
    for store in (a, b):
        s = store.stats()
        assert (s.writes, s.write_errors, s.writes_enabled) == (1, 0, True)
        assert _served_right(store, h)
    assert not list(tmp_path.rglob("*.tmp"))
    a.close()
    b.close()


def test_a_store_starting_mid_write_keeps_the_writers_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The start-up scan used to delete temp files whose writer pid "looked dead":
    # its own pid (a previous process's, it assumed) or any pid of another host or
    # container. The live writer's rename then failed with ENOENT and turned its
    # writes off. Here both stores share the pid, and the second starts while the
    # first is between fsync and rename.
    writer = PersistentStore(tmp_path, LAYOUT, budget_bytes=10**9)
    paused = _PausedRename(monkeypatch)
    h = bytes([9]) * 32
    assert writer.put(h, _page(h))
    assert paused.at_rename.wait(10)
    starter = PersistentStore(tmp_path, LAYOUT, budget_bytes=10**9)
    assert starter.stats().stray_temp_files == 0 and Path(paused.paused_temp).exists()
    paused.release.set()
    writer.flush()
    s = writer.stats()
    assert (s.writes, s.write_errors, s.writes_enabled) == (1, 0, True)
    assert starter.contains(h) and _served_right(starter, h)
    writer.close()
    starter.close()


def test_stores_starting_while_a_pid_1_process_writes_lose_no_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two processes that both believe they are pid 1 (two containers on one volume):
    # the worker writes 150 pages while this process starts stores on the directory
    # over and over, each scanning it (and its temp files) at start-up.
    n = 150
    proc = spawn_worker("write-as-pid-1", tmp_path, n)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "started"
    monkeypatch.setattr(os, "getpid", lambda: 1)
    starts = 0
    temps_seen = 0
    deadline = time.monotonic() + 60
    while proc.poll() is None:
        assert time.monotonic() < deadline, "the writer did not finish"
        temps_seen += len(list(tmp_path.rglob("*.tmp")))
        store = PersistentStore(tmp_path, LAYOUT, budget_bytes=10**10)
        assert store.stats().stray_temp_files == 0
        store.close()
        starts += 1
        time.sleep(0.01)  # leave the writer a core
    print(f"{starts} starts, {temps_seen} temp files seen")
    out, err = proc.communicate()
    assert proc.returncode == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    assert result == {"writes": n, "write_errors": 0, "writes_enabled": True, "files": n}
    # How many temp files a scan happens to see depends on timing; a store starting
    # between fsync and rename: test_a_store_starting_mid_write_keeps_the_writers_temp_file.
    assert starts >= 3, "the stores never started while the writer ran"
    store = PersistentStore(tmp_path, LAYOUT, budget_bytes=10**10)
    assert len(store) == n
    assert all(_served_right(store, burst_hash(i)) for i in range(n))
    store.close()


def test_a_directory_at_a_page_path_fails_that_page_only(tmp_path: Path) -> None:
    # rename() onto a directory fails with EISDIR; that used to turn SSD writes off.
    tokens = list(range(5 * 64 + 1))
    hashes = chain_hashes(tokens, "s", 64)
    kv, pool = open_local_kv(LAYOUT, 32 * LAYOUT.page_bytes, kv_dir=tmp_path, kv_dir_bytes=10**9)
    assert kv.store is not None
    blocker = kv.store.path(hashes[2])
    blocker.mkdir(parents=True)
    fill_and_commit(kv, pool, "a", tokens, "s")
    kv.flush()
    s = kv.stats().ssd
    assert (s.writes, s.write_errors, s.writes_enabled) == (4, 1, True)
    assert s.writes_disabled == 0
    assert all(kv.store.path(h).is_file() for i, h in enumerate(hashes) if i != 2)
    assert blocker.is_dir() and not list(tmp_path.rglob("*.tmp"))
    # Later writes go on.
    other = fill_and_commit(kv, pool, "b", list(range(9000, 9000 + 3 * 64)), "s")
    kv.flush()
    assert kv.stats().ssd.writes == 7 and all(kv.store.path(h).is_file() for h in other)
    kv.close()
    # After a restart the chain is served up to the directory and computed from there.
    kv, pool = open_local_kv(LAYOUT, 32 * LAYOUT.page_bytes, kv_dir=tmp_path, kv_dir_bytes=10**9)
    plan = kv.plan_restore("c", tokens, "s")
    assert plan.ssd_hit_tokens == 2 * 64
    kv.close()


def _write_pages(store: PersistentStore, pages: list[bytes]) -> None:
    assert store.put_chain([(h, _page(h)) for h in pages]) == len(pages)
    store.flush()


def test_a_smaller_budget_never_deletes_another_servers_fresh_pages(tmp_path: Path) -> None:
    # Server A (a large budget) wrote 40 pages and is using them; server B starts on
    # the same directory with room for 5. It used to evict 35 of A's pages at once.
    pages = [bytes([i + 1]) * 32 for i in range(40)]
    a = PersistentStore(tmp_path, LAYOUT, budget_bytes=100 * FILE_BYTES)
    _write_pages(a, pages)
    b = PersistentStore(tmp_path, LAYOUT, budget_bytes=5 * FILE_BYTES)
    assert len(list(tmp_path.rglob("*.kvp"))) == 40
    sb = b.stats()
    assert (sb.files, sb.evictions, sb.evictions_spared) == (40, 0, 40)
    # B's own write does not make room by deleting them either: it is dropped.
    mine = bytes([200]) * 32
    _write_pages(b, [mine])
    sb = b.stats()
    assert (sb.writes, sb.evictions, sb.dropped_writes) == (0, 0, 1)
    assert all(_served_right(a, h) for h in pages)
    b.close()
    a.close()


def test_files_idle_past_the_grace_period_are_evicted_oldest_first(tmp_path: Path) -> None:
    pages = [bytes([i + 1]) * 32 for i in range(40)]
    a = PersistentStore(tmp_path, LAYOUT, budget_bytes=100 * FILE_BYTES)
    _write_pages(a, pages)
    a.close()
    # Nobody has used them for two hours; page i was last used i seconds after page 0.
    then = time.time() - 7200
    for i, h in enumerate(pages):
        os.utime(a.path(h), (then + i, then + i))
    b = PersistentStore(tmp_path, LAYOUT, budget_bytes=5 * FILE_BYTES)
    s = b.stats()
    assert (s.files, s.evictions, s.evictions_spared) == (5, 35, 0)
    assert {bytes.fromhex(p.stem) for p in tmp_path.rglob("*.kvp")} == set(pages[35:])
    # A page idle for two hours that another server reads now (mtime refreshed) is
    # spared at the next eviction; the idle ones go.
    c = PersistentStore(tmp_path, LAYOUT, budget_bytes=10 * FILE_BYTES)
    assert c.stats().files == 5
    b.budget_bytes = 2 * FILE_BYTES
    assert _served_right(c, pages[35])  # c reads it: its mtime is now
    _write_pages(b, [bytes([201]) * 32])  # b needs room for one page: 4 must go
    on_disk = {bytes.fromhex(p.stem) for p in tmp_path.rglob("*.kvp")}
    assert on_disk == {pages[35], bytes([201]) * 32}
    assert b.stats().evictions_spared == 1
    b.close()
    c.close()
