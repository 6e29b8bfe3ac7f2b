"""vLLM-named aliases of flashserve's metrics (``--vllm-metric-aliases``; docs/metrics.md).

The Kubernetes inference stack reads model servers by vLLM's names: the
Gateway API inference extension's endpoint picker (and llm-d's, built on it)
scrapes ``vllm:num_requests_waiting``, ``vllm:num_requests_running``,
``vllm:kv_cache_usage_perc`` (``vllm:gpu_cache_usage_perc`` in older
releases), ``vllm:lora_requests_info`` (an endpoint without it is marked
unhealthy by recent pickers) and ``vllm:cache_config_info`` (block size and
block count, for prefix-aware scheduling); autoscalers and dashboards read the
token counters and latency histograms. Each alias is the same number as its
``flashserve:`` metric, read from the same snapshot or observed at the same
time; the KV usage is the device tier's (the one a picker balances).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from engine.core.llm_engine import EngineStats

VLLM = "vllm:"
# vLLM name -> (flashserve engine metric, its label value to take, or None)
GAUGES = {
    "num_requests_running": ("num_requests_running", None),
    "num_requests_waiting": ("num_requests_waiting", None),
    "kv_cache_usage_perc": ("kv_cache_usage_perc", "device"),
    "gpu_cache_usage_perc": ("kv_cache_usage_perc", "device"),
}
COUNTERS = {  # without _total (prometheus_client appends it)
    "prompt_tokens": ("prompt_tokens", None),
    "generation_tokens": ("generation_tokens", None),
    "num_preemptions": ("preemptions", None),
    "prefix_cache_queries": ("prefix_cache_queries", "device"),
    "prefix_cache_hits": ("prefix_cache_hits", "device"),
    "spec_decode_num_drafts": ("spec_decode_num_drafts", None),
    "spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens", None),
    "spec_decode_num_accepted_tokens": ("spec_decode_num_accepted_tokens", None),
}
# vLLM name -> flashserve engine metric, with its one extra label kept as it is.
LABELLED_COUNTERS = {
    "request_success": ("request_success", "finished_reason"),
    "spec_decode_num_accepted_tokens_per_pos": (
        "spec_decode_num_accepted_tokens_per_pos",
        "position",
    ),
}
# The histograms ServerMetrics observes twice, under both names.
HISTOGRAMS = (
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
)


class VLLMAliasCollector(Collector):
    """Yields the vLLM-named gauges and counters from the engine snapshot at scrape time."""

    def __init__(
        self,
        model_name: str,
        stats: Callable[[], EngineStats | None],
        values: Callable[[EngineStats | None], dict[str, dict[str | None, float]]],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.model_name = model_name
        self._stats = stats
        self._values = values
        self._clock = clock

    def describe(self) -> Iterator[Metric]:
        yield from self._families({}, None)

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        yield from self._families(self._values(stats), stats)

    def _families(self, values, stats: EngineStats | None) -> Iterator[Metric]:
        m = [self.model_name]
        for name, (source, label) in GAUGES.items():
            g = GaugeMetricFamily(
                VLLM + name, f"Alias of flashserve:{source}.", labels=["model_name"]
            )
            if values:
                g.add_metric(m, values[source][label])
            yield g
        for name, (source, label) in COUNTERS.items():
            c = CounterMetricFamily(
                VLLM + name, f"Alias of flashserve:{source}_total.", labels=["model_name"]
            )
            if values:
                c.add_metric(m, values[source][label])
            yield c
        for name, (source, label) in LABELLED_COUNTERS.items():
            c = CounterMetricFamily(
                VLLM + name, f"Alias of flashserve:{source}_total.", labels=["model_name", label]
            )
            for label_value, value in (values.get(source) or {}).items():
                c.add_metric([*m, str(label_value)], value)
            yield c
        # No LoRA adapters: the series says so (pickers require it to exist).
        lora = GaugeMetricFamily(
            VLLM + "lora_requests_info",
            "LoRA adapters: none are served (value: the time of this scrape).",
            labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        if values:
            lora.add_metric(["0", "", ""], self._clock())
        yield lora
        cache = GaugeMetricFamily(
            VLLM + "cache_config_info",
            "KV cache layout: block_size = page tokens, num_gpu_blocks = device pages.",
            labels=["model_name", "block_size", "num_gpu_blocks"],
        )
        if values:
            kv = stats.kv if stats is not None else None
            block = str(kv.page_tokens) if kv is not None else "0"
            blocks = str(kv.device_pages_total) if kv is not None else "0"
            cache.add_metric([*m, block, blocks], 1.0)
        yield cache
