"""Prometheus metrics of one served model (names and meanings: docs/metrics.md).

Two sources feed the scrape:

- ``observe_request`` records the four latency histograms when a request ends
  (the server holds its timings);
- ``set_engine_stats`` keeps the engine's latest ``stats()`` snapshot; gauges
  and counters are read from it at scrape time. The engine's counters are
  cumulative, so the exposed counters are the engine's own totals, never a
  second count kept beside them.

Metric names are a public interface: dashboards and alerts in ``deploy/`` use
them, and tests check that each one is exposed.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import TYPE_CHECKING, Literal

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.api.request import FINISH_REASONS
from server.metrics.disagg_metrics import DisaggMetrics, Role
from server.metrics.vllm_metrics import VLLM, VLLMAliasCollector
from server.openai.pricing import KINDS as COST_KINDS
from server.openai.pricing import Cost

if TYPE_CHECKING:
    from engine.core.llm_engine import EngineStats
    from kvstore.stats import KVStats, SSDStats

PREFIX = "flashserve:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TIERS = ("device", "ssd")

# Bucket bounds in seconds. TTFT spans a cached short prompt on a GPU (10 ms)
# to a long CPU prefill; ITL a GPU decode step (1 ms) to a slow CPU step.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5, 10)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640, 1280, 2560)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


@dataclass(frozen=True, slots=True)
class EngineMetric:
    """A gauge or counter read from ``EngineStats``. Counter names omit ``_total``
    (prometheus_client appends it)."""

    name: str
    kind: Literal["gauge", "counter"]
    doc: str
    label: str | None = None  # the one label besides model_name, if any


ENGINE_METRICS = (
    EngineMetric("num_requests_running", "gauge", "Requests admitted by the scheduler."),
    EngineMetric("num_requests_waiting", "gauge", "Requests waiting for admission."),
    EngineMetric(
        "kv_cache_usage_perc",
        "gauge",
        "Fraction of the KV tier in use, 0 to 1 (device: pages referenced; ssd: bytes/budget).",
        "tier",
    ),
    EngineMetric("kv_ssd_bytes", "gauge", "Bytes of page files in the SSD tier."),
    EngineMetric(
        "prefix_cache_queries",
        "counter",
        "Prompt tokens looked up in the tier (ssd: those the device tier missed).",
        "tier",
    ),
    EngineMetric(
        "prefix_cache_hits", "counter", "Prompt tokens found in the tier (whole pages).", "tier"
    ),
    EngineMetric("prompt_tokens", "counter", "Prompt tokens of finished requests."),
    EngineMetric("generation_tokens", "counter", "Tokens generated, all choices."),
    EngineMetric(
        "prompt_cache_hit_tokens",
        "counter",
        "Prompt tokens of finished requests served from the prefix cache.",
    ),
    EngineMetric(
        "replay_tokens",
        "counter",
        "Rows below a cache hit re-run to rebuild sliding windows, finished requests.",
    ),
    EngineMetric(
        "request_success", "counter", "Finished choices by finish reason.", "finished_reason"
    ),
    EngineMetric("preemptions", "counter", "Sequences preempted for lack of KV pages."),
    EngineMetric(
        "kv_ssd_checksum_failures",
        "counter",
        "SSD page reads that failed verification and were served as misses.",
    ),
    EngineMetric(
        "kv_ssd_write_errors",
        "counter",
        "OS errors writing SSD pages; the first one disables SSD writes until restart.",
    ),
    # Speculative decoding (vLLM's spec_decode_* counters; all 0 without --speculative-config).
    EngineMetric(
        "spec_decode_num_drafts", "counter", "Drafts verified: one per sequence per verify step."
    ),
    EngineMetric("spec_decode_num_draft_tokens", "counter", "Draft tokens verified."),
    EngineMetric("spec_decode_num_accepted_tokens", "counter", "Draft tokens accepted."),
    EngineMetric(
        "spec_decode_num_accepted_tokens_per_pos",
        "counter",
        "Drafts whose token at this position (0 = first) was accepted.",
        "position",
    ),
)

# The values every labelled series takes from the first scrape on. ``position`` takes
# 0 .. K-1 from the snapshot's per-position counts (K is the engine's, unknown here).
LABEL_VALUES: dict[str | None, tuple[str, ...]] = {
    "tier": TIERS,
    "finished_reason": FINISH_REASONS,
    "position": (),
}

# name -> {label value (None when the metric has no extra label): value}
EngineValues = dict[str, dict[str | None, float]]


def engine_values(s: EngineStats | None) -> EngineValues:
    """Each engine metric's samples in ``s`` (all zeros before the first snapshot)."""
    if s is None:
        return {
            spec.name: dict.fromkeys(LABEL_VALUES.get(spec.label, (None,)), 0)
            for spec in ENGINE_METRICS
        }
    kv, c = s.kv, s.counters
    ssd = kv.ssd
    # Every known reason is exposed from the start, so rate() sees the first one.
    finished: dict[str | None, float] = dict.fromkeys(FINISH_REASONS, 0)
    finished.update(c.finished)
    return {
        "num_requests_running": {None: s.running},
        "num_requests_waiting": {None: s.waiting},
        "kv_cache_usage_perc": {"device": device_usage(kv), "ssd": ssd_usage(ssd)},
        "kv_ssd_bytes": {None: ssd.bytes},
        # Tokens, like vLLM's prefix cache counters. The SSD tier is asked only
        # for pages the device tier missed, so its rate is a conditional hit rate.
        "prefix_cache_queries": {
            "device": kv.lookup_tokens,
            "ssd": kv.ssd_lookup_pages * kv.page_tokens,
        },
        "prefix_cache_hits": {"device": kv.device_hit_tokens, "ssd": kv.ssd_hit_tokens},
        "prompt_tokens": {None: c.prompt_tokens},
        "generation_tokens": {None: c.generation_tokens},
        "prompt_cache_hit_tokens": {None: c.prompt_cache_hit_tokens},
        "replay_tokens": {None: c.replay_tokens},
        "request_success": finished,
        "preemptions": {None: s.preemptions},
        "kv_ssd_checksum_failures": {None: ssd.checksum_failures},
        "kv_ssd_write_errors": {None: ssd.write_errors},
        "spec_decode_num_drafts": {None: c.spec_drafts},
        "spec_decode_num_draft_tokens": {None: c.spec_draft_tokens},
        "spec_decode_num_accepted_tokens": {None: c.spec_accepted_tokens},
        "spec_decode_num_accepted_tokens_per_pos": {
            str(j): n for j, n in enumerate(c.spec_accepted_per_pos)
        },
    }


def device_usage(kv: KVStats) -> float:
    """Pages referenced by requests over all pages (cached, evictable pages count as free)."""
    if kv.device_pages_total == 0:
        return 0.0
    return kv.device_pages_in_use / kv.device_pages_total


def ssd_usage(ssd: SSDStats) -> float:
    """Bytes of page files over the tier's byte budget (0 with no SSD tier)."""
    if not ssd.enabled:
        return 0.0
    if ssd.budget_bytes <= 0:
        return 1.0 if ssd.bytes > 0 else 0.0
    return ssd.bytes / ssd.budget_bytes


class EngineCollector(Collector):
    """Yields ``ENGINE_METRICS`` from the last snapshot at scrape time."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.stats: EngineStats | None = None

    def describe(self) -> Iterator[Metric]:
        # Names without samples: lets the registry refuse a duplicate name.
        for spec in ENGINE_METRICS:
            yield _family(spec)

    def collect(self) -> Iterator[Metric]:
        values = engine_values(self.stats)
        for spec in ENGINE_METRICS:
            family = _family(spec)
            for label_value, value in values[spec.name].items():
                labels = (
                    [self.model_name] if label_value is None else [self.model_name, label_value]
                )
                family.add_metric(labels, value)
            yield family


def _family(spec: EngineMetric) -> GaugeMetricFamily | CounterMetricFamily:
    labels = ["model_name"] if spec.label is None else ["model_name", spec.label]
    cls = GaugeMetricFamily if spec.kind == "gauge" else CounterMetricFamily
    return cls(PREFIX + spec.name, spec.doc, labels=labels)


class ServerMetrics:
    """Every ``flashserve:`` metric of one model, in a registry of its own."""

    def __init__(
        self,
        model_name: str,
        registry: CollectorRegistry | None = None,
        role: Role = "both",
        vllm_aliases: bool = False,
    ) -> None:
        """``role`` "router" has no engine: its scrape carries no engine gauges or counters.
        ``vllm_aliases``: also every ``vllm:`` alias (server/metrics/vllm_metrics.py)."""
        self.model_name = model_name
        # A registry per app: two apps (or tests) in one process never collide.
        self.registry = CollectorRegistry() if registry is None else registry
        prefixes = [PREFIX, VLLM] if vllm_aliases else [PREFIX]

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> _Observers:
            return _Observers(
                [
                    Histogram(
                        prefix + name, doc, ["model_name"], buckets=buckets, registry=self.registry
                    ).labels(model_name=model_name)
                    for prefix in prefixes
                ]
            )

        self.time_to_first_token = histogram(
            "time_to_first_token_seconds",
            "Seconds from arrival to the first generated token.",
            TTFT_BUCKETS,
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds",
            "Seconds between consecutive engine steps that gave a request tokens.",
            ITL_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds",
            "Seconds from arrival to the end of a request.",
            E2E_BUCKETS,
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds",
            "Seconds from arrival to the first scheduling.",
            QUEUE_BUCKETS,
        )
        cost = Counter(
            PREFIX + "cost",
            "What finished requests cost at the price table, by token kind (its currency).",
            ["model_name", "kind"],
            registry=self.registry,
        )
        self.cost = {kind: cost.labels(model_name=model_name, kind=kind) for kind in COST_KINDS}
        self.cost_saved_by_cache = Counter(
            PREFIX + "cost_saved_by_cache",
            "What cache-hit input tokens would have cost more at the cache-miss price.",
            ["model_name"],
            registry=self.registry,
        ).labels(model_name=model_name)
        self.engine = EngineCollector(model_name)
        if role != "router":
            self.registry.register(self.engine)
            if vllm_aliases:
                self.registry.register(
                    VLLMAliasCollector(model_name, lambda: self.engine.stats, engine_values)
                )
        self.disagg = DisaggMetrics(self.registry, model_name, role)

    def observe_request(
        self,
        *,
        arrival: float,
        first_scheduled: float | None,
        token_times: Sequence[float],
        finished: float,
        client_arrival: float | None = None,
    ) -> None:
        """Record the latencies of one finished request (seconds, all on one clock).

        ``client_arrival``: when a router received the request, if one did (a
        decode worker): TTFT and end-to-end latency count from there, so they
        include the prefill call; queue time stays this server's own.

        ``token_times``: when each output step of the request produced tokens
        (``RequestOutput.metrics.last_token_time`` of each streamed output).
        Tokens of one step share a time, so the inter-token latency is measured
        between distinct steps: several tokens in one step count once.
        """
        if first_scheduled is not None:
            self.request_queue_time.observe(first_scheduled - arrival)
        start = min(arrival, client_arrival) if client_arrival is not None else arrival
        steps = _distinct(token_times)
        if steps:
            self.time_to_first_token.observe(steps[0] - start)
        for earlier, later in pairwise(steps):
            self.inter_token_latency.observe(later - earlier)
        self.e2e_request_latency.observe(finished - start)

    def add_cost(self, cost: Cost) -> None:
        """Count one request's cost (server/openai/pricing.py)."""
        for kind in COST_KINDS:
            self.cost[kind].inc(getattr(cost, kind))
        self.cost_saved_by_cache.inc(cost.saved_by_cache)

    def set_engine_stats(self, stats: EngineStats) -> None:
        """The engine's latest ``stats()``; the next scrape reads gauges and counters from it."""
        self.engine.stats = stats

    def render(self) -> bytes:
        """Every metric in the text exposition format (served with ``CONTENT_TYPE``)."""
        return generate_latest(self.registry)


class _Observers:
    """One observation into the histogram and its aliases."""

    __slots__ = ("_histograms",)

    def __init__(self, histograms: list) -> None:
        self._histograms = histograms

    def observe(self, value: float) -> None:
        for h in self._histograms:
            h.observe(value)


def _distinct(times: Iterable[float]) -> list[float]:
    """``times`` without consecutive repeats."""
    out: list[float] = []
    for t in times:
        if not out or t != out[-1]:
            out.append(t)
    return out
