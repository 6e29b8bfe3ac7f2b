"""Counters the kvstore reports for metrics (a snapshot; plain numbers only)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SSDStats:
    """Persistent tier. Byte and latency counters are cumulative since start."""

    enabled: bool = False
    writes_enabled: bool = False
    files: int = 0
    bytes: int = 0
    budget_bytes: int = 0
    pending_writes: int = 0
    writes: int = 0
    write_bytes: int = 0
    write_seconds: float = 0.0
    reads: int = 0
    read_bytes: int = 0
    read_seconds: float = 0.0
    evictions: int = 0
    # Reads that failed verification (checksum, size, header): served as misses.
    checksum_failures: int = 0
    # Indexed files that vanished before a read (deleted behind our back).
    missing_files: int = 0
    # Files dropped by the start-up scan: wrong magic, version, fingerprint, size, name.
    skipped_files: int = 0
    # Temp files untouched for stale_temp_s (a dead writer's), removed by the start-up scan.
    stray_temp_files: int = 0
    # Page writes that failed with an OSError: each fails its page only.
    write_errors: int = 0
    # Times a device error (ENOSPC, EROFS, EDQUOT, EFBIG; EIO, EACCES... repeated)
    # turned writes off, and re-probes since (writes_enabled is the current state).
    writes_disabled: int = 0
    write_reprobes: int = 0
    # Reads that raised (not a regular file, a symlink, EIO, ...): misses.
    read_errors: int = 0
    # Restores whose SSD reads reached the read deadline; pages missed at once
    # because a read was still overdue; reads running past their deadline now.
    read_timeouts: int = 0
    reads_skipped: int = 0
    reads_overdue: int = 0
    # Another process's files left alone by eviction: used within the grace period.
    evictions_spared: int = 0
    # Writes not queued because too many were pending, or a page exceeds the budget.
    dropped_writes: int = 0
    # Files another process published into a shared directory, found by a lookup.
    discovered_files: int = 0
    scan_seconds: float = 0.0
    file_bytes: int = 0  # size of one page file: header + payload + checksum


@dataclass(slots=True)
class KVStats:
    """Device tier, prefix cache and persistent tier in one snapshot."""

    page_tokens: int = 0
    page_bytes: int = 0
    device_pages_total: int = 0
    device_pages_in_use: int = 0
    device_pages_cached: int = 0  # registered hash, refcount 0, evictable
    device_pages_free: int = 0  # no hash, refcount 0
    device_bytes: int = 0
    device_evictions: int = 0
    # Prefix lookups: one per plan_restore; tokens counted over the capped prefix.
    lookups: int = 0
    lookup_tokens: int = 0
    device_hit_tokens: int = 0
    ssd_lookup_pages: int = 0  # pages looked up on SSD after a device miss
    ssd_hit_tokens: int = 0
    ssd: SSDStats = field(default_factory=SSDStats)
