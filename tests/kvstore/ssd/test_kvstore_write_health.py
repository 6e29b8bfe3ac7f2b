"""Which write errors turn SSD writes off, and the re-probe that turns them back on."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest
from kvstore_helpers import content_for, tiny_layout

from kvstore import PersistentStore
from kvstore.ssd.write_health import WriteHealth

LAYOUT = tiny_layout()


def _err(code: int) -> OSError:
    return OSError(code, os.strerror(code))


@pytest.mark.parametrize(
    "code", [errno.ENOENT, errno.EEXIST, errno.EISDIR, errno.ENOTDIR, errno.ELOOP, errno.ESTALE]
)
def test_page_errors_never_turn_writes_off(code: int) -> None:
    health = WriteHealth()
    assert not any(health.failed(_err(code), now=float(i)) for i in range(50))
    assert health.enabled


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG])
def test_device_errors_turn_writes_off_at_once(code: int) -> None:
    health = WriteHealth(reprobe_s=60)
    assert health.failed(_err(code), now=100.0)
    assert not health.enabled and not health.may_write(159.9)


def test_other_errors_turn_writes_off_when_repeated() -> None:
    health = WriteHealth(repeat_limit=3)
    assert not health.failed(_err(errno.EIO), 0.0)
    assert not health.failed(_err(errno.EIO), 0.0)
    health.succeeded()  # a success between them: not persistent
    assert not health.failed(_err(errno.EIO), 0.0)
    assert not health.failed(_err(errno.EACCES), 0.0)
    assert health.failed(_err(errno.EIO), 0.0)  # third in a row
    assert not health.enabled


def test_reprobe_after_the_interval() -> None:
    health = WriteHealth(reprobe_s=60)
    health.failed(_err(errno.ENOSPC), now=0.0)
    assert not health.may_write(59.0)
    assert health.may_write(60.0) and health.probing and health.reprobes == 1
    # A page error during the probe says nothing about the device: still probing.
    assert not health.failed(_err(errno.EISDIR), 60.5) and health.probing
    # The probe's failure turns writes off again at once, whatever the errno.
    assert health.failed(_err(errno.EIO), 61.0) and not health.may_write(120.0)
    assert health.may_write(121.0)
    health.succeeded()
    assert health.enabled and not health.probing


def test_store_reenables_writes_after_a_transient_device_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = PersistentStore(tmp_path, LAYOUT, budget_bytes=10**9, reprobe_s=0.2)
    real_fsync = os.fsync
    full = [True]

    def fsync(fd: int) -> None:
        if full[0]:
            raise _err(errno.ENOSPC)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    pages = [bytes([i]) * 32 for i in range(1, 5)]
    assert store.put_chain([(h, content_for(h, LAYOUT.page_bytes)) for h in pages[:2]]) == 2
    store.flush()
    s = store.stats()
    assert (s.writes_enabled, s.write_errors, s.writes, s.writes_disabled) == (False, 1, 0, 1)
    assert not store.put(pages[2], content_for(pages[2], LAYOUT.page_bytes))  # off
    assert not list(tmp_path.rglob("*.tmp")) and not list(tmp_path.rglob("*.kvp"))
    full[0] = False  # space was freed
    time.sleep(0.25)
    assert store.put(pages[3], content_for(pages[3], LAYOUT.page_bytes))  # the probe
    store.flush()
    s = store.stats()
    assert (s.writes_enabled, s.write_reprobes, s.writes) == (True, 1, 1)
    assert store.get(pages[3]) is not None
    store.close()


def test_flush_with_a_timeout_returns_while_a_write_hangs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    store = PersistentStore(tmp_path, LAYOUT, budget_bytes=10**9)
    gate = threading.Event()
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        assert gate.wait(30)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    h = bytes([3]) * 32
    assert store.put(h, content_for(h, LAYOUT.page_bytes))
    t0 = time.monotonic()
    assert store.flush(timeout=0.2) is False
    assert 0.2 <= time.monotonic() - t0 < 2.0
    gate.set()
    assert store.flush(timeout=10) is True and store.stats().writes == 1
    store.close()
