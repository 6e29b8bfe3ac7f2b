"""Process crashes, full disks and read-only directories: never a wrong page, never a crash."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from kvstore_helpers import content_for, fill_and_commit, run_worker, spawn_worker, tiny_layout

from kvstore import PersistentStore, open_local_kv
from kvstore.ssd.page_file import CHECKSUM_BYTES, HEADER_BYTES

LAYOUT = tiny_layout()
FILE_BYTES = HEADER_BYTES + LAYOUT.page_bytes + CHECKSUM_BYTES


def _files(root: Path, pattern: str) -> list[Path]:
    return [p for p in root.rglob(pattern) if p.is_file()]


def _age_temp_files(root: Path) -> None:
    """Make the dead writer's temp files look as old as a crash long ago."""
    then = time.time() - 7200
    for p in _files(root, "*.tmp"):
        os.utime(p, (then, then))


def _assert_every_indexed_page_is_right(store: PersistentStore) -> int:
    """Read every page the rebuilt index offers and compare with the bytes written."""
    served = 0
    for h in list(store._index):
        got = store.get(h)
        assert got is not None, "an indexed page failed its checksum after a restart"
        expect = content_for(h, LAYOUT.page_bytes)
        assert torch.equal(torch.frombuffer(got, dtype=torch.uint8), expect)
        served += 1
    return served


def test_kill_9_during_write_burst(tmp_path: Path) -> None:
    proc = spawn_worker("burst", tmp_path)
    try:
        deadline = time.monotonic() + 60
        while len(_files(tmp_path, "*.kvp")) < 40:
            assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
            assert time.monotonic() < deadline, "the writer made no progress"
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL
    on_disk = len(_files(tmp_path, "*.kvp"))
    _age_temp_files(tmp_path)
    store = PersistentStore(tmp_path, LAYOUT, budget_bytes=10**10)
    s = store.stats()
    # Renames are atomic: every complete-looking file is indexed; torn temps removed.
    assert s.skipped_files == 0 and s.files == on_disk >= 40
    assert not _files(tmp_path, "*.tmp")
    assert _assert_every_indexed_page_is_right(store) == on_disk
    assert store.stats().checksum_failures == 0
    store.close()


def test_killed_between_fsync_and_rename(tmp_path: Path) -> None:
    # The worker SIGKILLs itself at its 6th rename: 5 pages done, page 6 a fsynced temp.
    with pytest.raises(subprocess.CalledProcessError) as err:
        run_worker("die-before-rename", tmp_path, 6)
    assert err.value.returncode == -signal.SIGKILL
    assert len(_files(tmp_path, "*.tmp")) == 1
    _age_temp_files(tmp_path)
    store = PersistentStore(tmp_path, LAYOUT, budget_bytes=10**9)
    s = store.stats()
    assert (s.files, s.stray_temp_files, s.skipped_files) == (5, 1, 0)
    assert not _files(tmp_path, "*.tmp")
    assert _assert_every_indexed_page_is_right(store) == 5
    store.close()


@contextlib.contextmanager
def _tmpfs(path: Path, size: str) -> Iterator[None]:
    """A real small filesystem; skips where mounting is not permitted."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if res.returncode != 0:
        pytest.skip(f"mount refused here: {res.stderr.strip()}")
    try:
        yield
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def test_full_disk_tmpfs_disables_writes_and_keeps_serving(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mnt = tmp_path / "small"
    pages_that_fit = 4
    with _tmpfs(mnt, f"{pages_that_fit * 36 + 4}k"):
        kv, pool = open_local_kv(LAYOUT, 32 * LAYOUT.page_bytes, kv_dir=mnt, kv_dir_bytes=10**9)
        tokens = list(range(10 * 64 + 1))
        with caplog.at_level(logging.WARNING, logger="kvstore.ssd.persistent"):
            fill_and_commit(kv, pool, "a", tokens, "s")
            kv.flush()
        s = kv.stats().ssd
        assert not s.writes_enabled and s.write_errors == 1
        assert 1 <= s.writes <= pages_that_fit and s.files == s.writes
        assert "ENOSPC" in caplog.text
        assert not _files(mnt, "*.tmp"), "a failed write must not leave its temp file"
        # Serving goes on: the device tier hits, new commits neither raise nor queue.
        kv.free("a")
        assert kv.plan_restore("b", tokens, "s").device_hit_tokens == 10 * 64
        fill_and_commit(kv, pool, "c", list(range(5000, 5000 + 3 * 64)), "s")
        kv.close()
        assert kv.stats().ssd.writes == s.writes
        # The pages that made it are a head of the chain and restore after a restart.
        kv2, _ = open_local_kv(LAYOUT, 32 * LAYOUT.page_bytes, kv_dir=mnt, kv_dir_bytes=10**9)
        plan = kv2.plan_restore("d", tokens, "s")
        assert plan.ssd_hit_tokens == s.writes * 64
        assert kv2.store is not None
        assert _assert_every_indexed_page_is_right(kv2.store) == s.writes
        kv2.close()


def test_file_size_limit_fails_writes_without_crashing(tmp_path: Path) -> None:
    # Works without mount privileges: RLIMIT_FSIZE below one file makes write() fail.
    out = run_worker("fsize-limit", tmp_path, FILE_BYTES // 2)
    assert out["writes_enabled"] is False and out["write_errors"] == 1 and out["writes"] == 0
    assert out["device_hit_tokens"] == 5 * 64
    assert out["files"] == [], "no partial or temp file may remain"


def _make_read_only(path: Path) -> Iterator[None]:
    """Remount ``path`` (a tmpfs) read-only as root; chmod when not root."""
    if os.geteuid() != 0:
        for p in [path, *path.rglob("*")]:
            if p.is_dir():
                p.chmod(0o555)
        try:
            yield
        finally:
            for p in [path, *path.rglob("*")]:
                if p.is_dir():
                    p.chmod(0o755)
        return
    subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)
    yield


def test_read_only_directory_serves_reads_and_refuses_writes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    mnt = tmp_path / "ro"
    tokens = list(range(4 * 64 + 1))
    ctx = _tmpfs(mnt, "4m") if os.geteuid() == 0 else contextlib.nullcontext()
    with ctx:
        mnt.mkdir(exist_ok=True)
        with open_local_kv(LAYOUT, 32 * LAYOUT.page_bytes, kv_dir=mnt, kv_dir_bytes=10**9) as (
            kv,
            pool,
        ):
            hashes = fill_and_commit(kv, pool, "a", tokens, "s")
        store = PersistentStore(mnt, LAYOUT, budget_bytes=10**9)
        victim = store.path(hashes[3])
        store.close()
        raw = bytearray(victim.read_bytes())
        raw[HEADER_BYTES + 7] ^= 1
        victim.write_bytes(raw)
        for _ in _make_read_only(mnt):
            with caplog.at_level(logging.WARNING, logger="kvstore.ssd.persistent"):
                kv, pool = open_local_kv(
                    LAYOUT, 32 * LAYOUT.page_bytes, kv_dir=mnt, kv_dir_bytes=10**9
                )
                plan = kv.plan_restore("b", tokens, "s")
                # Pages 0-2 verify; page 3 fails its checksum: a miss, though undeletable.
                assert plan.ssd_hit_tokens == 3 * 64
                for page, h in zip(plan.page_ids, hashes, strict=False):
                    assert torch.equal(pool.pages[page], content_for(h, LAYOUT.page_bytes))
                fill_and_commit(kv, pool, "c", list(range(9000, 9000 + 2 * 64)), "s")
                kv.flush()
                s = kv.stats().ssd
                assert s.checksum_failures == 1 and victim.exists()
                assert s.write_errors == 1 and not s.writes_enabled and s.writes == 0
                kv.close()
            assert "SSD writes disabled" in caplog.text
