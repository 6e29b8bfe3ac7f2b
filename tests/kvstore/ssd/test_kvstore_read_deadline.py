"""Reads never block the engine: only regular files are read, and a read that hangs is a
miss after the read deadline (docs/design/kvstore.md, "Persistent tier")."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
from kvstore_helpers import fill_and_commit, tiny_layout

import kvstore.ssd.persistent as persistent
from kvstore import LocalKV, chain_hashes, open_local_kv
from kvstore.ssd.deadline_reader import DeadlineReader

LAYOUT = tiny_layout()
PT = LAYOUT.page_tokens
TOKENS = list(range(5 * PT + 1))
HASHES = chain_hashes(TOKENS, "s", PT)
T = TypeVar("T")


def _manager(kv_dir: Path) -> LocalKV:
    return open_local_kv(LAYOUT, 32 * LAYOUT.page_bytes, kv_dir=kv_dir, kv_dir_bytes=10**9)


@pytest.fixture
def kv_dir(tmp_path: Path) -> Path:
    """A directory holding the 5 pages of ``TOKENS``."""
    with _manager(tmp_path) as (kv, pool):
        fill_and_commit(kv, pool, "w", TOKENS, "s")
    return tmp_path


def _bounded(fn: Callable[[], T], fifo: Path | None = None, limit: float = 10) -> tuple[T, float]:
    """``fn()`` and its seconds, failing (not hanging) if it takes over ``limit``."""
    out: list[T] = []
    t0 = time.perf_counter()
    worker = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    worker.start()
    worker.join(limit)
    if worker.is_alive():
        if fifo is not None:  # let the blocked reader see end-of-file, then fail
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"blocked for more than {limit} s")
    return out[0], time.perf_counter() - t0


def test_a_fifo_at_a_page_path_is_a_miss_at_once(kv_dir: Path) -> None:
    # A page file replaced by a FIFO (as a hung NFS read would): open() used to wait
    # for a writer forever, in the engine's restore, and every later request behind it.
    kv, _ = _manager(kv_dir)
    assert kv.store is not None and len(kv.store) == 5
    fifo = kv.store.path(HASHES[2])
    fifo.unlink()
    os.mkfifo(fifo)
    plan, seconds = _bounded(lambda: kv.plan_restore("q", TOKENS, "s"), fifo)
    assert plan.ssd_hit_tokens == 2 * PT
    assert seconds < 1.0 < kv.store.read_timeout_s  # refused, not waited out
    s = kv.stats().ssd
    assert (s.read_errors, s.read_timeouts) == (1, 0) and not fifo.exists()
    # The next request is served as usual: pages 0 and 1 from the device, 2 computed.
    kv.free("q")
    plan, seconds = _bounded(lambda: kv.plan_restore("q2", TOKENS, "s"))
    assert (plan.device_hit_tokens, plan.ssd_hit_tokens) == (2 * PT, 0) and seconds < 1.0
    kv.close()


def test_a_fifo_is_never_opened_by_the_scan_or_a_lookup(kv_dir: Path) -> None:
    with _manager(kv_dir) as (kv, _):
        assert kv.store is not None
        paths = [kv.store.path(h) for h in HASHES]
    paths[1].unlink()
    os.mkfifo(paths[1])
    kv, seconds = _bounded(lambda: _manager(kv_dir).manager, paths[1])
    assert kv.store is not None and seconds < 5.0
    assert (kv.stats().ssd.files, kv.stats().ssd.skipped_files) == (4, 1)
    # A FIFO appearing where a lookup checks for a page another process published.
    os.mkfifo(paths[1])
    found, seconds = _bounded(lambda: kv.store.contains(HASHES[1]), paths[1])
    assert found is False and seconds < 1.0
    kv.close()


@pytest.mark.parametrize("kind", ["directory", "symlink"])
def test_a_directory_or_symlink_at_a_page_path_is_a_miss(kv_dir: Path, kind: str) -> None:
    kv, _ = _manager(kv_dir)
    assert kv.store is not None
    path = kv.store.path(HASHES[3])
    target = path.with_name("elsewhere.bin")
    path.rename(target)  # a valid page file, but not at its own path
    if kind == "directory":
        path.mkdir()
    else:
        path.symlink_to(target)
    plan = kv.plan_restore("q", TOKENS, "s")
    assert plan.ssd_hit_tokens == 3 * PT
    assert kv.stats().ssd.read_errors == 1
    assert target.exists()  # only the link is removed, never what it points to
    kv.close()


def test_a_hung_read_is_a_miss_after_the_deadline_and_never_queues_others(
    kv_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A regular file whose read never returns (a hard-mounted NFS server gone away):
    # simulated by holding the read of page 2 until the test releases it.
    kv, _ = _manager(kv_dir)
    assert kv.store is not None
    kv.store.read_timeout_s = 0.3
    release = threading.Event()
    stuck = kv.store.path(HASHES[2]).name
    real_read = persistent.read_into

    def read_into(fd: int, buf: bytearray) -> int:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(stuck):
            assert release.wait(30)
        return real_read(fd, buf)

    monkeypatch.setattr(persistent, "read_into", read_into)
    plan, seconds = _bounded(lambda: kv.plan_restore("q1", TOKENS, "s"))
    assert plan.ssd_hit_tokens == 2 * PT and 0.3 <= seconds < 2.0
    s = kv.stats().ssd
    assert (s.read_timeouts, s.reads_overdue) == (1, 1)
    # While that read is stuck, a restore needing SSD pages misses them at once.
    kv.free("q1")
    plan, seconds = _bounded(lambda: kv.plan_restore("q2", TOKENS, "s"))
    assert (plan.device_hit_tokens, plan.ssd_hit_tokens) == (2 * PT, 0) and seconds < 0.2
    assert kv.stats().ssd.reads_skipped == 1
    kv.free("q2")
    # Once it returns, reads resume: page 2 from SSD, 3 and 4 were kept on the device.
    release.set()
    deadline = time.monotonic() + 10
    while kv.stats().ssd.reads_overdue:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    plan = kv.plan_restore("q3", TOKENS, "s")
    assert (plan.hit_tokens, plan.ssd_hit_tokens) == (5 * PT, PT)
    kv.close()


def test_deadline_reader_keeps_what_finished_and_contains_failures() -> None:
    reader = DeadlineReader(2, 0.2, "test-read")
    gate = threading.Event()

    def read(i: int) -> int:
        if i == 1:
            gate.wait(10)
        if i == 2:
            raise RuntimeError("a bug in a read")
        return i * 10

    assert reader.map(read, [0, 1, 2, 3]) == [0, None, None, 30]
    c = reader.counters()
    assert (c.timeouts, c.overdue, c.failures) == (1, 1, 1)
    assert all(t.daemon for t in reader._workers)  # a stuck read never blocks exit
    gate.set()
    reader.shutdown()
