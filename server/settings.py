"""How the HTTP layer behaves: one dataclass, filled from ``flashserve serve`` flags.

Engine settings live in ``engine.config.EngineConfig``; these are only
what the server itself decides (who may call it, how large a body may be, how
often an idle stream is kept alive).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from server.metrics.disagg_metrics import ROLES, Role
from server.openai.model_names import DEFAULT_SERVED_MODEL_NAME
from server.openai.pricing import PriceTable

API_KEYS_ENV = "FLASHSERVE_API_KEYS"


@dataclass(slots=True)
class ServerSettings:
    """Settings of one ``create_app``; ``api_keys`` empty means no authentication."""

    served_model_name: str = DEFAULT_SERVED_MODEL_NAME
    api_keys: tuple[str, ...] = ()
    # Larger than any honest request (128 tools with schemas, a long context as
    # text); small enough that a runaway upload is refused before it is parsed.
    max_body_bytes: int = 32 << 20
    # A ": keep-alive" comment after this many seconds without an event keeps
    # proxies and clients from timing out a stream that waits in the queue.
    keep_alive_s: float = 10.0
    # Requests held at once (streaming or not, running or queued); over it: 429.
    max_concurrent_requests: int | None = None
    # Output budget when a request names none; None = DeepSeek's defaults
    # (server/openai/model_names.py: 4,096 non-thinking, 32,768 thinking), capped by the context.
    default_max_tokens: int | None = None
    system_fingerprint: str = "fp_flashserve"
    # How often a non-streamed request checks whether its client has gone.
    disconnect_poll_s: float = 0.5
    # both: the colocated server; prefill / decode: a worker of a split deployment
    # (docs/design/disaggregation.md). A router has settings of its own (server/disagg/router.py).
    role: Role = "both"
    # Prefill worker: how long a request waits for its pages to become durable on
    # SSD; pages not written by then are left for the decode worker to compute.
    publish_timeout_s: float = 60.0
    # Hardening (docs/design/hardening.md). Engine sequences one request may create
    # (prompts x n); each counts against max_concurrent_sequences while it is held.
    max_sequences_per_request: int = 256
    max_concurrent_sequences: int | None = 4096
    # Tokenisation and request planning run in worker threads, never on the event loop.
    preprocess_workers: int = 4
    preprocess_timeout_s: float = 30.0
    # JSON of the schemas one request may ask to enforce (checked before the engine
    # compiles them; its own limits are EngineConfig.grammar_*).
    max_grammar_schema_bytes: int = 256 << 10
    # /health answers 503 when requests are pending and the engine has not finished a
    # step (or an idle wait) for this long: a wedged engine fails its liveness probe.
    health_stall_s: float = 30.0
    # A request body not received within this many seconds of its headers gets a 408.
    body_read_timeout_s: float = 60.0
    # Prices per million tokens (server/openai/pricing.py): usage.cost and the cost counters.
    prices: PriceTable | None = None
    # Also expose the scheduler and cache metrics under vLLM's names (docs/metrics.md).
    vllm_metric_aliases: bool = False

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError("ServerSettings.max_body_bytes must be >= 1")
        if not self.keep_alive_s > 0 or not self.disconnect_poll_s > 0:
            raise ValueError("ServerSettings: keep_alive_s and disconnect_poll_s must be > 0")
        for name in ("max_concurrent_requests", "default_max_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"ServerSettings.{name} must be >= 1 (or None)")
        if self.role not in ROLES:
            raise ValueError(f"ServerSettings.role must be one of {ROLES}, got {self.role!r}")
        if not self.publish_timeout_s > 0:
            raise ValueError("ServerSettings.publish_timeout_s must be > 0")
        for name in (
            "max_sequences_per_request",
            "preprocess_workers",
            "max_grammar_schema_bytes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"ServerSettings.{name} must be >= 1")
        if self.max_concurrent_sequences is not None and (
            self.max_concurrent_sequences < self.max_sequences_per_request
        ):
            raise ValueError(
                "ServerSettings.max_concurrent_sequences must be >= max_sequences_per_request "
                "(or None): a request at the per-request limit must be admissible"
            )
        for name in (
            "preprocess_timeout_s",
            "health_stall_s",
            "body_read_timeout_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"ServerSettings.{name} must be > 0")
        if any(not key for key in self.api_keys):
            raise ValueError("ServerSettings.api_keys: keys must not be empty")


def collect_api_keys(
    flags: Iterable[str] | None, env: Mapping[str, str] = os.environ
) -> tuple[str, ...]:
    """Keys from repeated ``--api-key`` flags and ``FLASHSERVE_API_KEYS`` (comma-separated),
    in that order, without blanks or repeats."""
    keys = list(flags or [])
    keys += env.get(API_KEYS_ENV, "").split(",")
    return tuple(dict.fromkeys(k.strip() for k in keys if k.strip()))
