"""Metrics of disaggregated serving (docs/design/disaggregation.md, docs/metrics.md).

Every role exposes every family, so one dashboard and one set of alerts serve
a colocated server and each pool of a split deployment alike; a role fills
only its own: the router times its calls to prefill workers and counts
fallbacks, a prefill worker counts the pages it publishes, a decode worker
times each handover (publish to admit) and counts the bytes it read.
``flashserve:server_role`` tells the roles apart in a query.
"""

from __future__ import annotations

from typing import Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "flashserve:"
Role = Literal["both", "prefill", "decode", "router"]
ROLES: tuple[Role, ...] = ("both", "prefill", "decode", "router")
# Why a request went to a decode worker without (all of) its pages:
# the prefill call timed out, failed (worker down, connection cut, 5xx), or the
# decode worker found fewer pages than were published (missing or corrupt).
FALLBACK_REASONS = ("prefill_timeout", "prefill_error", "missing_pages")

# Seconds: a prefill of a few pages on a GPU (10 ms) to a long CPU prefill.
PREFILL_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
# Seconds from a page chain being durable to the decode worker admitting it.
HANDOVER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
# Bytes: one tiny page (~34 KB) to a 128K-token official prompt (~114 MB), by 4x.
BYTES_BUCKETS = tuple(float(4**k) for k in range(7, 15))


class DisaggMetrics:
    """The ``flashserve:disagg_*`` families and the server's role, in ``registry``."""

    def __init__(self, registry: CollectorRegistry, model_name: str, role: Role) -> None:
        self.role = role
        labels = ["model_name"]

        def histogram(name: str, doc: str, buckets: tuple[float, ...]):
            h = Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=registry)
            return h.labels(model_name=model_name)

        def counter(name: str, doc: str):
            return Counter(PREFIX + name, doc, labels, registry=registry).labels(
                model_name=model_name
            )

        server_role = Gauge(
            PREFIX + "server_role",
            "1 for the role this server runs: both (colocated), prefill, decode or router.",
            ["model_name", "role"],
            registry=registry,
        )
        for r in ROLES:
            server_role.labels(model_name=model_name, role=r).set(int(r == role))
        self.prefill_seconds = histogram(
            "disagg_prefill_seconds",
            "Router: seconds of a call to a prefill worker, until its pages are durable "
            "(failed and timed-out calls included).",
            PREFILL_BUCKETS,
        )
        fallbacks = Counter(
            PREFIX + "disagg_fallbacks",
            "Requests whose decode worker computed pages a prefill worker should have "
            "handed over, by reason.",
            ["model_name", "reason"],
            registry=registry,
        )
        self.fallbacks = {
            r: fallbacks.labels(model_name=model_name, reason=r) for r in FALLBACK_REASONS
        }
        self.published_pages = counter(
            "disagg_published_pages", "Prefill worker: KV pages made durable for a decode worker."
        )
        self.published_bytes = counter(
            "disagg_published_bytes",
            "Prefill worker: bytes of those page files (headers and checksums included).",
        )
        self.handover_seconds = histogram(
            "disagg_handover_seconds",
            "Decode worker: seconds from a prefill worker's pages being durable to the "
            "request's admission.",
            HANDOVER_BUCKETS,
        )
        self.handover_bytes = histogram(
            "disagg_handover_bytes",
            "Decode worker: bytes of page files read from the SSD tier per handed-over prompt.",
            BYTES_BUCKETS,
        )

    def fallback(self, reason: str) -> None:
        self.fallbacks[reason].inc()
