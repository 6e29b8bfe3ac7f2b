"""The persistent (SSD) tier: one checksummed file per full page, written behind.

Files live under ``kv_dir/<fingerprint[:16]>/ab/cd/<page hash>.kvp``: one
subtree per layout fingerprint, so servers of different models can share a
directory without deleting each other's pages, and two levels of hash prefix
so no directory grows past what a filesystem indexes well.

Rules (docs/design/architecture.md §2.3):
- A page becomes visible to lookups only after its file is complete: written
  to a temp file, fsynced, renamed, directory fsynced. A failed write leaves
  nothing findable.
- A read that fails verification is a miss; the file is deleted and counted.
- Any OSError while writing (ENOSPC, EIO, EROFS, EACCES, EFBIG) disables
  writes for the rest of the process with one warning; reads go on.
- A byte budget with LRU eviction bounds the directory.
- The directory may be shared by several processes (disaggregated prefill and
  decode workers, docs/design/disaggregation.md): a lookup that misses the
  index checks the disk once, so a page another process published is found
  without a rescan. Verification on read still decides whether it is used.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import shutil
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import torch

from kvstore.layout import KVLayout
from kvstore.page_file import (
    CHECKSUM_BYTES,
    HEADER_BYTES,
    TEMP_SUFFIX,
    PageHeader,
    checksum,
    decode_header,
    file_name,
    shard_parts,
)
from kvstore.persistent_scan import scan, unlink_quietly
from kvstore.stats import SSDStats

log = logging.getLogger("kvstore.persistent")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class PersistentStore:
    """Content-addressed page files with a rebuilt-on-start LRU index."""

    def __init__(
        self,
        kv_dir: str | os.PathLike[str],
        layout: KVLayout,
        budget_bytes: int | None = None,
        write_workers: int = 2,
        read_workers: int = 4,
        max_pending_writes: int = 1024,
    ) -> None:
        self.layout = layout
        self.root = Path(kv_dir) / layout.fingerprint[:16]
        self.file_bytes = HEADER_BYTES + layout.page_bytes + CHECKSUM_BYTES
        self.max_pending_writes = max_pending_writes
        self._lock = threading.Lock()
        # page hash -> file size, least recently used first.
        self._index: OrderedDict[bytes, int] = OrderedDict()
        self._pending: set[bytes] = set()
        self._futures: set[Future[None]] = set()
        self._total = 0
        self._tmp_seq = 0
        self._stats = SSDStats(enabled=True, writes_enabled=True)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            self._stats.write_errors += 1
            self._disable_writes(exc)
        self._scan()
        if budget_bytes is None:
            budget_bytes = self._default_budget()
        self.budget_bytes = budget_bytes
        self._stats.budget_bytes = budget_bytes
        with self._lock:
            self._evict_until(budget_bytes)
        self._writer = ThreadPoolExecutor(write_workers, thread_name_prefix="kv-ssd-write")
        self._reader = ThreadPoolExecutor(read_workers, thread_name_prefix="kv-ssd-read")

    def _default_budget(self) -> int:
        """No explicit budget: 90% of what the filesystem can hold for us now."""
        try:
            usage = shutil.disk_usage(self.root)
        except OSError:
            return 0
        return int((usage.free + self._total) * 0.9)

    # ------------------------------------------------------------- lookup
    def path(self, page_hash: bytes) -> Path:
        a, b = shard_parts(page_hash)
        return self.root / a / b / file_name(page_hash)

    def contains(self, page_hash: bytes) -> bool:
        """Whether the page is in the tier: indexed, or published since by another process."""
        with self._lock:
            if page_hash in self._index:
                return True
            if page_hash in self._pending:
                return False
        return self._discover(page_hash)

    def _discover(self, page_hash: bytes) -> bool:
        """Index a complete file another process wrote (size checked here, bytes on read)."""
        try:
            size = self.path(page_hash).stat().st_size
        except OSError:
            return False
        if size != self.file_bytes:
            return False
        with self._lock:
            if page_hash not in self._index:
                self._index[page_hash] = size
                self._total += size
                self._stats.discovered_files += 1
        return True

    def wait_written(self, page_hashes: Sequence[bytes], timeout: float | None = None) -> int:
        """Wait until none of ``page_hashes`` is queued; the length of their leading run
        now in the tier (a chain is usable up to its first missing page)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                pending = any(h in self._pending for h in page_hashes)
                futures = list(self._futures)
            if not pending or not futures:
                break
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            wait(futures, timeout=left, return_when="FIRST_COMPLETED")
        with self._lock:
            run = 0
            for h in page_hashes:
                if h not in self._index:
                    break
                run += 1
            return run

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    def stats(self) -> SSDStats:
        with self._lock:
            s = dataclasses.replace(self._stats)
            s.files = len(self._index)
            s.bytes = self._total
            s.pending_writes = len(self._pending)
            s.file_bytes = self.file_bytes
            return s

    # -------------------------------------------------------------- reads
    def get(self, page_hash: bytes, touch: bool = True) -> memoryview | None:
        """The verified payload of a page, or None (a miss: absent or failed checks).

        ``touch`` makes the page the most recently used.
        """
        with self._lock:
            size = self._index.get(page_hash)
            if size is not None and touch:
                self._index.move_to_end(page_hash)
        if size is None:
            return None
        path = self.path(page_hash)
        t0 = time.perf_counter()
        buf = bytearray(size + 1)  # one spare byte: a file that grew is caught too
        try:
            with open(path, "rb", buffering=0) as f:
                n = f.readinto(buf)
        except FileNotFoundError:
            with self._lock:
                self._drop(page_hash)
                self._stats.missing_files += 1
            return None
        except OSError as exc:
            log.warning("kv page read failed (%s): %s; treated as a miss", exc, path)
            with self._lock:
                self._stats.read_errors += 1
                self._delete(page_hash)
            return None
        if not self._verify(buf, n, page_hash):
            log.warning("kv page failed verification, deleted: %s", path)
            with self._lock:
                self._stats.checksum_failures += 1
                self._delete(page_hash)
            return None
        # Persist recency for the next start's LRU order; best effort.
        with contextlib.suppress(OSError):
            os.utime(path)
        with self._lock:
            self._stats.reads += 1
            self._stats.read_bytes += n
            self._stats.read_seconds += time.perf_counter() - t0
        return memoryview(buf)[HEADER_BYTES : HEADER_BYTES + self.layout.page_bytes]

    def get_many(self, page_hashes: Sequence[bytes]) -> list[memoryview | None]:
        """Parallel ``get`` of a chain; the chain's head becomes the most recently used."""
        with self._lock:
            for h in reversed(page_hashes):
                if h in self._index:
                    self._index.move_to_end(h)
        return list(self._reader.map(lambda h: self.get(h, touch=False), page_hashes))

    def _verify(self, buf: bytearray, n: int, page_hash: bytes) -> bool:
        if n != self.file_bytes:
            return False
        header = decode_header(bytes(buf[:HEADER_BYTES]))
        if header is None or header != self._expected_header(page_hash):
            return False
        end = HEADER_BYTES + self.layout.page_bytes
        view = memoryview(buf)
        return checksum(view[:HEADER_BYTES], view[HEADER_BYTES:end]) == bytes(view[end:n])

    def _expected_header(self, page_hash: bytes) -> PageHeader:
        return PageHeader(
            fingerprint=self.layout.fingerprint_bytes,
            page_tokens=self.layout.page_tokens,
            n_entries=self.layout.entries_per_page,
            payload_bytes=self.layout.page_bytes,
            page_hash=page_hash,
        )

    # ------------------------------------------------------------- writes
    def put(self, page_hash: bytes, payload: torch.Tensor) -> bool:
        """Queue a write-behind of one page; False when not queued (present, off, full)."""
        return self.put_chain([(page_hash, payload)]) == 1

    def put_chain(self, pages: Sequence[tuple[bytes, torch.Tensor]]) -> int:
        """Queue consecutive pages of one chain, head first; returns how many were queued.

        One worker writes them in order, so a disk that fills up or a crash
        leaves a usable head rather than an unreachable tail; on completion the
        head becomes the most recently used, so the budget evicts tails first.
        The bytes are snapshotted now: a device page may be reused before the
        write runs (on a GPU: an asynchronous copy to pinned memory, awaited by
        the worker).
        """
        with self._lock:
            if not self._stats.writes_enabled:
                return 0
            room = self.max_pending_writes - len(self._pending)
            todo = [(h, t) for h, t in pages if h not in self._index and h not in self._pending]
            self._stats.dropped_writes += max(0, len(todo) - room)
            todo = todo[: max(0, room)]
            self._pending.update(h for h, _ in todo)
        if not todo:
            return 0
        snapshots: list[tuple[bytes, torch.Tensor]] = []
        event = None
        for h, payload in todo:
            assert payload.dtype == torch.uint8 and payload.numel() == self.layout.page_bytes
            if payload.is_cuda:
                snap = torch.empty(payload.numel(), dtype=torch.uint8, pin_memory=True)
                snap.copy_(payload.reshape(-1), non_blocking=True)
            else:
                snap = payload.reshape(-1).clone()
            snapshots.append((h, snap))
        if any(payload.is_cuda for _, payload in todo):
            event = torch.cuda.Event()
            event.record()
        fut = self._writer.submit(self._write_chain, snapshots, event)
        with self._lock:
            self._futures.add(fut)
        fut.add_done_callback(self._forget_future)
        return len(todo)

    def _forget_future(self, fut: Future[None]) -> None:
        with self._lock:
            self._futures.discard(fut)

    def flush(self) -> None:
        """Wait until every queued write has finished (or failed)."""
        while True:
            with self._lock:
                futures = list(self._futures)
            if not futures:
                return
            wait(futures)

    def close(self) -> None:
        self.flush()
        self._writer.shutdown(wait=True)
        self._reader.shutdown(wait=True)

    def _write_chain(self, pages: list[tuple[bytes, torch.Tensor]], event: object) -> None:
        if event is not None:
            event.synchronize()  # type: ignore[attr-defined]
        done: list[bytes] = []
        try:
            for page_hash, snapshot in pages:
                if not self._write_one(page_hash, snapshot):
                    break
                done.append(page_hash)
        finally:
            with self._lock:
                self._pending.difference_update(h for h, _ in pages)
                # Tail first, head last: the head is the most recently used.
                for h in reversed(done):
                    self._index[h] = self.file_bytes

    def _write_one(self, page_hash: bytes, snapshot: torch.Tensor) -> bool:
        """Write one file (temp, fsync, rename, fsync dir); False stops the chain."""
        t0 = time.perf_counter()
        size = self.file_bytes
        with self._lock:
            if not self._stats.writes_enabled:
                return False
            # Reserve the bytes first so concurrent writers never overshoot the budget.
            self._evict_until(self.budget_bytes - size)
            if self._total + size > self.budget_bytes:
                self._stats.dropped_writes += 1  # the rest of an over-budget chain
                return False
            self._total += size
            self._tmp_seq += 1
            seq = self._tmp_seq
        final = self.path(page_hash)
        tmp = final.with_name(f".{page_hash.hex()}.{os.getpid()}.{seq}{TEMP_SUFFIX}")
        try:
            header = self._expected_header(page_hash).encode()
            payload = snapshot.numpy().data  # a memoryview, no copy
            trailer = checksum(header, payload)
            self._make_shard_dirs(final.parent)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                with open(fd, "wb", closefd=True) as f:
                    f.write(header)
                    f.write(payload)
                    f.write(trailer)
                    f.flush()
                    os.fsync(f.fileno())
            except BaseException:
                unlink_quietly(tmp)
                raise
            os.rename(tmp, final)
            _fsync_dir(final.parent)
        except OSError as exc:
            with self._lock:
                self._total -= size
                self._stats.write_errors += 1
                self._disable_writes(exc)
            return False
        with self._lock:
            self._stats.writes += 1
            self._stats.write_bytes += size
            self._stats.write_seconds += time.perf_counter() - t0
        return True

    def _make_shard_dirs(self, shard: Path) -> None:
        if shard.is_dir():
            return
        shard.mkdir(parents=True, exist_ok=True)
        # New directory entries must survive a power cut like the files in them.
        _fsync_dir(shard.parent)
        _fsync_dir(shard.parent.parent)

    def _disable_writes(self, exc: OSError) -> None:
        """Caller holds the lock (or is the constructor)."""
        if self._stats.writes_enabled:
            name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
            log.warning(
                "kv persistent tier: write failed (%s: %s); SSD writes disabled, "
                "reads and serving continue",
                name,
                exc,
            )
        self._stats.writes_enabled = False

    # -------------------------------------------------- index maintenance
    def _evict_until(self, limit: int) -> None:
        """Delete least recently used files until the total is <= limit (lock held)."""
        while self._index and self._total > limit:
            victim = next(iter(self._index))
            self._delete(victim)
            self._stats.evictions += 1

    def _drop(self, page_hash: bytes) -> None:
        size = self._index.pop(page_hash, None)
        if size is not None:
            self._total -= size

    def _delete(self, page_hash: bytes) -> None:
        """Forget and unlink under the lock, so a concurrent rewrite is never unlinked."""
        self._drop(page_hash)
        unlink_quietly(self.path(page_hash))

    def _scan(self) -> None:
        """Rebuild the index from the directory (constructor only)."""
        t0 = time.perf_counter()
        found = scan(self.root, self.file_bytes, self._expected_header)
        for page_hash, size in found.pages:
            self._index[page_hash] = size
            self._total += size
        self._stats.skipped_files += found.skipped_files
        self._stats.stray_temp_files += found.stray_temp_files
        self._stats.scan_seconds = time.perf_counter() - t0
