"""A second process for the kvstore tests: restarts, crashes, resource limits.

Usage: python kvstore_worker.py MODE ARGS...; prints one JSON line on success.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys

import blake3
from kvstore_helpers import content_for, fill_and_commit, tiny_layout

from kvstore import PersistentStore, chain_hashes, open_local_kv


def burst_hash(i: int) -> bytes:
    return blake3.blake3(b"burst" + i.to_bytes(8, "little")).digest()


def mode_hash(tokens_json: str, salt: str, page_tokens: str) -> dict:
    hashes = chain_hashes(json.loads(tokens_json), salt, int(page_tokens))
    return {"hashes": [h.hex() for h in hashes], "fingerprint": tiny_layout().fingerprint}


def mode_write(kv_dir: str, n_tokens: str, salt: str) -> dict:
    """Write a prompt's full pages through the manager, then exit cleanly."""
    layout = tiny_layout()
    with open_local_kv(layout, 64 * layout.page_bytes, kv_dir=kv_dir, kv_dir_bytes=10**9) as (
        kv,
        pool,
    ):
        hashes = fill_and_commit(kv, pool, "r", list(range(int(n_tokens))), salt)
    return {"hashes": [h.hex() for h in hashes]}


def mode_burst(kv_dir: str) -> dict:
    """Write pages as fast as possible until killed (the parent sends SIGKILL)."""
    layout = tiny_layout()
    store = PersistentStore(kv_dir, layout, budget_bytes=10**10, write_workers=4)
    i = 0
    while True:
        h = burst_hash(i)
        if store.put(h, content_for(h, layout.page_bytes)):
            i += 1


def mode_write_as_pid_1(kv_dir: str, n_pages: str) -> dict:
    """Write ``n_pages`` one-page chains as a process that believes it is pid 1 (as in
    a container), then report what the store counted and which pages it holds."""
    os.getpid = lambda: 1  # type: ignore[assignment]
    layout = tiny_layout()
    store = PersistentStore(kv_dir, layout, budget_bytes=10**10, write_workers=2)
    print("started", flush=True)
    for i in range(int(n_pages)):
        h = burst_hash(i)
        assert store.put(h, content_for(h, layout.page_bytes))
    store.flush()
    store.close()
    s = store.stats()
    return {
        "writes": s.writes,
        "write_errors": s.write_errors,
        "writes_enabled": s.writes_enabled,
        "files": s.files,
    }


def mode_die_before_rename(kv_dir: str, n_pages: str) -> dict:
    """Die by SIGKILL at the rename of page n: n - 1 pages done, one temp file left."""
    layout = tiny_layout()
    store = PersistentStore(kv_dir, layout, budget_bytes=10**9, write_workers=1)
    calls = 0
    real_rename = os.rename

    def rename(src: str, dst: str) -> None:
        nonlocal calls
        calls += 1
        if calls == int(n_pages):
            os.kill(os.getpid(), signal.SIGKILL)
        real_rename(src, dst)

    os.rename = rename  # type: ignore[assignment]
    for i in range(int(n_pages)):
        h = burst_hash(i)
        store.put(h, content_for(h, layout.page_bytes))
    store.flush()
    return {"error": "survived"}


def mode_fsize_limit(kv_dir: str, limit: str) -> dict:
    """Write pages with RLIMIT_FSIZE below one file: every write fails with EFBIG."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(limit), int(limit)))
    layout = tiny_layout()
    kv, pool = open_local_kv(layout, 16 * layout.page_bytes, kv_dir=kv_dir, kv_dir_bytes=10**9)
    tokens = list(range(5 * 64 + 1))
    fill_and_commit(kv, pool, "a", tokens, "s")
    kv.flush()
    kv.free("a")
    # Serving continues: the device tier still hits, new commits do not raise.
    plan = kv.plan_restore("b", tokens, "s")
    fill_and_commit(kv, pool, "c", list(range(1000, 1000 + 3 * 64)), "s")
    kv.close()
    s = kv.stats().ssd
    return {
        "writes_enabled": s.writes_enabled,
        "write_errors": s.write_errors,
        "writes": s.writes,
        "device_hit_tokens": plan.device_hit_tokens,
        "files": sorted(
            os.path.relpath(os.path.join(d, f), kv_dir) for d, _, fs in os.walk(kv_dir) for f in fs
        ),
    }


if __name__ == "__main__":
    mode, *args = sys.argv[1:]
    result = globals()["mode_" + mode.replace("-", "_")](*args)
    print(json.dumps(result))
