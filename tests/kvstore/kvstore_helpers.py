"""Shared pieces of the kvstore tests: layouts, deterministic page bytes, subprocesses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import blake3
import torch

from kvstore import DevicePool, KVCacheManager, KVLayout, chain_hashes, kv_layout

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("kvstore_worker.py")

OFFICIAL_RATIOS = [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0]
TINY_RATIOS = [0, 0, 2, 2, 1, 1, 1, 1, 0]


def tiny_layout(page_tokens: int = 64, **kw: object) -> KVLayout:
    return kv_layout([2, 4], TINY_RATIOS, page_tokens=page_tokens, **kw)  # type: ignore[arg-type]


def official_layout(**kw: object) -> KVLayout:
    return kv_layout([2, 8, 14, 20], OFFICIAL_RATIOS, **kw)  # type: ignore[arg-type]


def content_for(page_hash: bytes, nbytes: int) -> torch.Tensor:
    """The bytes a test writes into the page named ``page_hash``: checkable anywhere."""
    raw = blake3.blake3(b"test-page-content" + page_hash).digest(length=nbytes)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def fill_and_commit(
    kv: KVCacheManager, pool: DevicePool, rid: str, tokens: Sequence[int], salt: str
) -> list[bytes]:
    """Open a request, write every missing full page's bytes into ``pool`` (the runner's
    part), commit; returns the hashes."""
    plan = kv.plan_restore(rid, tokens, salt)
    table = kv.allocate(rid, len(tokens))
    hashes = chain_hashes(tokens, salt, kv.page_tokens)
    for i in range(len(plan.page_ids), len(hashes)):
        pool.pages[table[i]] = content_for(hashes[i], kv.layout.page_bytes)
    kv.commit_full_pages(rid, tokens, salt)
    return hashes


def run_worker(*args: object, timeout: float = 60) -> dict:
    """Run ``kvstore_worker.py`` in a fresh interpreter; returns its JSON answer."""
    out = subprocess.run(
        [sys.executable, str(WORKER), *map(str, args)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def spawn_worker(*args: object) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(WORKER), *map(str, args)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
