"""The persistent (SSD) tier: one checksummed file per full page, written behind.

Files live under ``kv_dir/<fingerprint[:16]>/ab/cd/<page hash>.kvp``: one
subtree per layout fingerprint, so servers of different models can share a
directory without deleting each other's pages, and two levels of hash prefix
so no directory grows past what a filesystem indexes well.

Rules (docs/design/architecture.md §2.3; the shared-directory cases in docs/design/kvstore.md):
- A page becomes visible to lookups only after its file is complete: written
  to a temp file with a name no other writer can pick, fsynced, renamed,
  directory fsynced. A failed write leaves nothing findable.
- A failed write fails its page (``write_errors``); only device errors turn
  writes off, until a periodic re-probe (``write_health.py``).
- Only regular files are read: never a symlink, FIFO or directory. Reads on
  behalf of the engine run on worker threads with a deadline
  (``deadline_reader.py``); what is not read in time is a miss.
- A read that fails verification is a miss; the file is deleted and counted.
- A byte budget with LRU eviction bounds the directory. The directory may be
  shared by several servers (disaggregated prefill and decode workers,
  docs/design/disaggregation.md): a lookup that misses the index checks the
  disk once, so a page another process published is found without a rescan,
  and a file another process wrote or used within ``evict_grace_s`` (its
  mtime) is never evicted by this one.
- No disk call is made while holding ``_lock``, which the engine thread takes:
  a hung filesystem can stall the writer threads, never the engine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import os
import shutil
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import torch

from kvstore.device.layout import KVLayout
from kvstore.ssd.deadline_reader import DeadlineReader
from kvstore.ssd.page_file import (
    CHECKSUM_BYTES,
    HEADER_BYTES,
    PageHeader,
    checksum,
    decode_header,
    file_name,
    open_regular,
    read_into,
    shard_parts,
    temp_name,
)
from kvstore.ssd.persistent_scan import scan, unlink_quietly
from kvstore.ssd.write_health import WriteHealth, errno_name
from kvstore.stats import SSDStats

log = logging.getLogger("kvstore.ssd.persistent")

# Defaults (docs/design/kvstore.md, "Sharing a directory" and "Faults").
READ_TIMEOUT_S = 5.0  # a restore's SSD reads; then the rest is computed
STALE_TEMP_S = 3600.0  # a temp file untouched this long is a dead writer's
EVICT_GRACE_S = 600.0  # another process's file used this recently is not evicted
REPROBE_S = 60.0  # writes turned off by a device error are retried after this
# Fresh files of others skipped per eviction before the write gives up (bounds the work).
MAX_EVICTION_SKIPS = 256


class _Write(enum.Enum):
    DONE = enum.auto()
    PAGE_FAILED = enum.auto()  # that page only: the chain goes on
    STOPPED = enum.auto()  # writes off or over budget: the chain ends here


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _mtime(path: Path) -> float | None:
    """The mtime of a regular file at ``path``; None when there is none."""
    try:
        st = path.lstat()
    except OSError:
        return None
    return st.st_mtime if stat.S_ISREG(st.st_mode) else None


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
        *,
        read_timeout_s: float = READ_TIMEOUT_S,
        stale_temp_s: float = STALE_TEMP_S,
        evict_grace_s: float = EVICT_GRACE_S,
        reprobe_s: float = REPROBE_S,
    ) -> None:
        self.layout = layout
        self.root = Path(kv_dir) / layout.fingerprint[:16]
        self.file_bytes = HEADER_BYTES + layout.page_bytes + CHECKSUM_BYTES
        self.max_pending_writes = max_pending_writes
        self.evict_grace_s = evict_grace_s
        self._lock = threading.Lock()
        # Held by whoever evicts (writer threads, the constructor), never by the engine.
        self._evict_lock = threading.Lock()
        # page hash -> file size, least recently used first.
        self._index: OrderedDict[bytes, int] = OrderedDict()
        # Indexed pages this process has neither written nor read (found by the
        # start-up scan or a lookup): page hash -> wall time until which the file
        # counts as in use by another process (its mtime + evict_grace_s).
        self._foreign: dict[bytes, float] = {}
        # Dropped from the index, file not yet unlinked: not rewritten meanwhile.
        self._deleting: set[bytes] = set()
        self._pending: set[bytes] = set()
        self._futures: set[Future[None]] = set()
        self._total = 0
        self._health = WriteHealth(reprobe_s=reprobe_s)
        self._stats = SSDStats(enabled=True, writes_enabled=True)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            # Without its root the tier cannot write at all, whatever the errno says.
            self._stats.write_errors += 1
            self._health.disable(time.monotonic())
            self._warn_disabled(exc)
        self._scan(stale_temp_s)
        if budget_bytes is None:
            budget_bytes = self._default_budget()
        self.budget_bytes = budget_bytes
        self._stats.budget_bytes = budget_bytes
        # Over budget at start: evict what nobody used within the grace period
        # (a smaller budget than another live server's must not empty its pages).
        self._reserve(0, max_skips=len(self._index))
        self._writer = ThreadPoolExecutor(write_workers, thread_name_prefix="kv-ssd-write")
        self._reader = DeadlineReader(read_workers, read_timeout_s, "kv-ssd-read")

    def _default_budget(self) -> int:
        """No explicit budget: 90% of what the filesystem can hold for us now."""
        try:
            usage = shutil.disk_usage(self.root)
        except OSError:
            return 0
        return int((usage.free + self._total) * 0.9)

    @property
    def read_timeout_s(self) -> float:
        return self._reader.timeout_s

    @read_timeout_s.setter
    def read_timeout_s(self, value: float) -> None:
        self._reader.timeout_s = value

    # ------------------------------------------------------------- lookup
    def path(self, page_hash: bytes) -> Path:
        a, b = shard_parts(page_hash)
        return self.root / a / b / file_name(page_hash)

    def contains(self, page_hash: bytes) -> bool:
        """Whether the page is in the tier: indexed, or published since by another process.

        The disk check for an unindexed page runs under the read deadline.
        """
        with self._lock:
            if page_hash in self._index:
                return True
            if page_hash in self._pending or page_hash in self._deleting:
                return False
        return bool(self._reader.map(self._discover, [page_hash])[0])

    def _discover(self, page_hash: bytes) -> bool:
        """Index a complete file another process wrote (size checked here, bytes on read)."""
        try:
            st = self.path(page_hash).lstat()
        except OSError:
            return False
        if not stat.S_ISREG(st.st_mode) or st.st_size != self.file_bytes:
            return False
        with self._lock:
            if page_hash not in self._index and page_hash not in self._deleting:
                self._index[page_hash] = st.st_size
                self._foreign[page_hash] = st.st_mtime + self.evict_grace_s
                self._total += st.st_size
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
        reader = self._reader.counters()
        with self._lock:
            s = dataclasses.replace(self._stats)
            s.files = len(self._index)
            s.bytes = self._total
            s.pending_writes = len(self._pending)
            s.file_bytes = self.file_bytes
            s.writes_enabled = self._health.enabled
            s.write_reprobes = self._health.reprobes
            s.read_timeouts = reader.timeouts
            s.reads_skipped = reader.skipped
            s.reads_overdue = reader.overdue
            s.read_errors += reader.failures
            return s

    # -------------------------------------------------------------- reads
    def get(self, page_hash: bytes, touch: bool = True) -> memoryview | None:
        """The verified payload of a page, or None (a miss: absent or failed checks).

        Runs on the caller's thread with no deadline (``get_many`` has one).
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
            fd = open_regular(path)  # not a symlink, FIFO or directory
            try:
                n = read_into(fd, buf)
                ok = self._verify(buf, n, page_hash)
                if ok:
                    # Persist recency: the next start's LRU order, other servers' grace.
                    with contextlib.suppress(OSError):
                        os.utime(fd)
            finally:
                os.close(fd)
        except FileNotFoundError:
            with self._lock:
                self._drop(page_hash)
                self._stats.missing_files += 1
            return None
        except OSError as exc:
            log.warning("kv page read failed (%s): %s; treated as a miss", exc, path)
            with self._lock:
                self._stats.read_errors += 1
            self._remove(page_hash)
            return None
        if not ok:
            log.warning("kv page failed verification, deleted: %s", path)
            with self._lock:
                self._stats.checksum_failures += 1
            self._remove(page_hash)
            return None
        with self._lock:
            self._foreign.pop(page_hash, None)  # we use it: our LRU knows it now
            self._stats.reads += 1
            self._stats.read_bytes += n
            self._stats.read_seconds += time.perf_counter() - t0
        return memoryview(buf)[HEADER_BYTES : HEADER_BYTES + self.layout.page_bytes]

    def get_many(self, page_hashes: Sequence[bytes]) -> list[memoryview | None]:
        """Parallel ``get`` of a chain within the read deadline; the chain's head becomes
        the most recently used. A page not read in time is None (a miss)."""
        with self._lock:
            for h in reversed(page_hashes):
                if h in self._index:
                    self._index.move_to_end(h)
        return self._reader.map(lambda h: self.get(h, touch=False), page_hashes)

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
            probing = self._health.probing
            if not self._health.may_write(time.monotonic()):
                return 0
            if self._health.probing and not probing:
                log.info("kv persistent tier: re-probing SSD writes")
            room = self.max_pending_writes - len(self._pending)
            todo = [
                (h, t)
                for h, t in pages
                if h not in self._index and h not in self._pending and h not in self._deleting
            ]
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

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every queued write has finished (or failed), or ``timeout`` passes
        (a hung disk must not hold up a bounded shutdown); True when all finished."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                futures = list(self._futures)
            if not futures:
                return True
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return False
            wait(futures, timeout=left)

    def close(self) -> None:
        self.flush()
        self._writer.shutdown(wait=True)
        self._reader.shutdown()

    def _write_chain(self, pages: list[tuple[bytes, torch.Tensor]], event: object) -> None:
        if event is not None:
            event.synchronize()  # type: ignore[attr-defined]
        done: list[bytes] = []
        try:
            for page_hash, snapshot in pages:
                outcome = self._write_one(page_hash, snapshot)
                if outcome is _Write.DONE:
                    done.append(page_hash)
                elif outcome is _Write.STOPPED or not self._writes_on():
                    break  # budget or device: the head written so far is what counts
        finally:
            with self._lock:
                self._pending.difference_update(h for h, _ in pages)
                # Tail first, head last: the head is the most recently used.
                for h in reversed(done):
                    self._index[h] = self.file_bytes
                    self._foreign.pop(h, None)

    def _writes_on(self) -> bool:
        with self._lock:
            return self._health.enabled

    def _write_one(self, page_hash: bytes, snapshot: torch.Tensor) -> _Write:
        """Write one file (temp, fsync, rename, fsync dir)."""
        t0 = time.perf_counter()
        size = self.file_bytes
        if not self._writes_on():
            return _Write.STOPPED
        # Reserve the bytes first so concurrent writers never overshoot the budget.
        if not self._reserve(size):
            with self._lock:
                self._stats.dropped_writes += 1  # over budget: the rest of the chain too
            return _Write.STOPPED
        final = self.path(page_hash)
        tmp = final.with_name(temp_name(page_hash))
        try:
            header = self._expected_header(page_hash).encode()
            payload = snapshot.numpy().data  # a memoryview, no copy
            trailer = checksum(header, payload)
            self._make_shard_dirs(final.parent)
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(tmp, flags, 0o644)
            try:
                with open(fd, "wb", closefd=True) as f:
                    f.write(header)
                    f.write(payload)
                    f.write(trailer)
                    f.flush()
                    os.fsync(f.fileno())
                os.rename(tmp, final)
            except BaseException:
                unlink_quietly(tmp)
                raise
            _fsync_dir(final.parent)
        except OSError as exc:
            self._write_failed(page_hash, size, exc)
            return _Write.PAGE_FAILED
        with self._lock:
            if self._health.probing:
                log.warning("kv persistent tier: SSD writes re-enabled")
            self._health.succeeded()
            self._stats.writes += 1
            self._stats.write_bytes += size
            self._stats.write_seconds += time.perf_counter() - t0
        return _Write.DONE

    def _write_failed(self, page_hash: bytes, size: int, exc: OSError) -> None:
        with self._lock:
            self._total -= size
            self._stats.write_errors += 1
            off = self._health.failed(exc, time.monotonic())
            still_on = self._health.enabled
        if off:
            self._warn_disabled(exc)
        elif still_on:
            log.warning(
                "kv persistent tier: write of page %s failed (%s: %s); that page is not "
                "stored, writes go on",
                page_hash.hex()[:16],
                errno_name(exc),
                exc,
            )

    def _warn_disabled(self, exc: OSError) -> None:
        log.warning(
            "kv persistent tier: write failed (%s: %s); SSD writes disabled for %.0f s, "
            "reads and serving continue",
            errno_name(exc),
            exc,
            self._health.reprobe_s,
        )
        with self._lock:
            self._stats.writes_disabled += 1

    def _make_shard_dirs(self, shard: Path) -> None:
        if shard.is_dir():
            return
        shard.mkdir(parents=True, exist_ok=True)
        # New directory entries must survive a power cut like the files in them.
        _fsync_dir(shard.parent)
        _fsync_dir(shard.parent.parent)

    # -------------------------------------------------- index maintenance
    def _reserve(self, size: int, max_skips: int = MAX_EVICTION_SKIPS) -> bool:
        """Evict least recently used files until ``size`` more bytes fit the budget, then
        charge them; False when they cannot fit.

        A file found by the scan or a lookup and not used by us since is evicted
        only if its mtime is older than ``evict_grace_s``: another server may be
        using it. Such fresh files move to the recent end; after ``max_skips`` of
        them the reservation gives up. Files are unlinked outside ``_lock``.
        """
        skips = 0
        with self._evict_lock:
            while True:
                with self._lock:
                    if self._total + size <= self.budget_bytes:
                        self._total += size
                        return True
                    if not self._index or skips >= min(max_skips, len(self._index)):
                        return False
                    victim = next(iter(self._index))
                    fresh_until = self._foreign.get(victim)
                    if fresh_until is not None and fresh_until > time.time():
                        self._spare(victim, fresh_until)
                        skips += 1
                        continue
                    if fresh_until is None:
                        self._begin_delete(victim)
                path = self.path(victim)
                if fresh_until is not None:
                    # Its grace ran out by what we saw; has another server touched it since?
                    mtime = _mtime(path)
                    with self._lock:
                        if self._foreign.get(victim) != fresh_until:
                            continue  # read, rewritten or dropped meanwhile: look again
                        if mtime is None:
                            self._drop(victim)
                            self._stats.missing_files += 1
                            continue
                        if mtime + self.evict_grace_s > time.time():
                            self._spare(victim, mtime + self.evict_grace_s)
                            skips += 1
                            continue
                        self._begin_delete(victim)
                unlink_quietly(path)
                with self._lock:
                    self._deleting.discard(victim)
                    self._stats.evictions += 1

    def _spare(self, page_hash: bytes, fresh_until: float) -> None:
        """Lock held: keep another process's fresh file, as recently used."""
        self._foreign[page_hash] = fresh_until
        self._index.move_to_end(page_hash)
        self._stats.evictions_spared += 1

    def _drop(self, page_hash: bytes) -> None:
        """Lock held: forget a page."""
        self._foreign.pop(page_hash, None)
        size = self._index.pop(page_hash, None)
        if size is not None:
            self._total -= size

    def _begin_delete(self, page_hash: bytes) -> None:
        """Lock held: forget a page whose file is about to be unlinked; until then it is
        neither rewritten nor rediscovered (the unlink would remove the new file)."""
        self._drop(page_hash)
        self._deleting.add(page_hash)

    def _remove(self, page_hash: bytes) -> None:
        """Forget a page and unlink its file (not under the lock)."""
        with self._lock:
            self._begin_delete(page_hash)
        unlink_quietly(self.path(page_hash))
        with self._lock:
            self._deleting.discard(page_hash)

    def _scan(self, stale_temp_s: float) -> None:
        """Rebuild the index from the directory (constructor only)."""
        t0 = time.perf_counter()
        found = scan(self.root, self.file_bytes, self._expected_header, stale_temp_s)
        for page_hash, size, mtime in found.pages:
            self._index[page_hash] = size
            self._foreign[page_hash] = mtime + self.evict_grace_s
            self._total += size
        self._stats.skipped_files += found.skipped_files
        self._stats.stray_temp_files += found.stray_temp_files
        self._stats.scan_seconds = time.perf_counter() - t0
