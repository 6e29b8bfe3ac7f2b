"""When the SSD tier stops writing, and when it tries again.

Why: docs/design/kvstore.md, "Persistent tier" (errors).

A failed write fails its page. Only errors that say the device itself cannot
take writes turn writes off, and then only until a periodic re-probe:

- page errors (ENOENT, EEXIST, EISDIR, ENOTDIR, ELOOP, ENAMETOOLONG, ENOTEMPTY,
  ESTALE) concern one path: another process removed a temp file or a shard
  directory, or put something at the page's path. They never turn writes off.
- device errors (ENOSPC, EDQUOT, EROFS, EFBIG) turn writes off at once: every
  page is the same size on the same filesystem, so the next would fail too.
- anything else (EIO, EACCES, EPERM, ...) turns writes off after
  ``repeat_limit`` consecutive failures with no success between them.

While off, the first write offered after ``reprobe_s`` is let through as a
probe: it succeeds and writes stay on, or fails and they are off for another
``reprobe_s``.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass

PAGE_ERRNOS = frozenset(
    {
        errno.ENOENT,
        errno.EEXIST,
        errno.EISDIR,
        errno.ENOTDIR,
        errno.ELOOP,
        errno.ENAMETOOLONG,
        errno.ENOTEMPTY,
        errno.ESTALE,
    }
)
DEVICE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG})


def errno_name(exc: OSError) -> str:
    return errno.errorcode.get(exc.errno or 0, str(exc.errno))


@dataclass(slots=True)
class WriteHealth:
    """Caller holds the store's lock; ``now`` is ``time.monotonic()``."""

    reprobe_s: float = 60.0
    repeat_limit: int = 3
    enabled: bool = True
    probing: bool = False
    consecutive_failures: int = 0
    reprobe_at: float = 0.0
    reprobes: int = 0

    def may_write(self, now: float) -> bool:
        """Whether to write now; starts a probe when writes are off and it is time."""
        if not self.enabled and now >= self.reprobe_at:
            self.enabled = True
            self.probing = True
            self.reprobes += 1
        return self.enabled

    def succeeded(self) -> None:
        self.consecutive_failures = 0
        self.probing = False

    def failed(self, exc: OSError, now: float) -> bool:
        """Record a failed page write; True when it turns writes off."""
        if not self.enabled:
            return False
        code = exc.errno or 0
        if code in PAGE_ERRNOS:
            return False  # says nothing about the device, probe or not
        self.consecutive_failures += 1
        if self.probing or code in DEVICE_ERRNOS or self.consecutive_failures >= self.repeat_limit:
            self.disable(now)
            return True
        return False

    def disable(self, now: float) -> None:
        self.enabled = False
        self.probing = False
        self.reprobe_at = now + self.reprobe_s
