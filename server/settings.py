"""How the HTTP layer behaves: one dataclass; its fields with a ``help`` are flags of
``flashserve serve``.

Engine settings live in ``engine.config.EngineConfig``; these are only
what the server itself decides (who may call it, how large a body may be, how
often an idle stream is kept alive).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from server.openai.pricing import PriceTable

if TYPE_CHECKING:
    # Imported where used instead: ``flashserve serve --help`` reads this module for its
    # flags, and the metrics module brings prometheus_client.
    from server.metrics.disagg_metrics import Role

API_KEYS_ENV = "FLASHSERVE_API_KEYS"
# The name the API serves the model under unless --served-model-name says otherwise
# (server/openai/model_names.py routes DeepSeek's names to it). Here rather than there:
# that module brings the API errors (pydantic), which ``flashserve --help`` need not load.
DEFAULT_SERVED_MODEL_NAME = "deepseek-flash"


@dataclass(slots=True)
class ServerSettings:
    """Settings of one ``create_app``; ``api_keys`` empty means no authentication.

    A field with a ``help`` is a flag of ``flashserve serve`` (flashserve/config_args.py
    reads the metadata; ``group`` places it in ``--help``); the others the command
    fills itself.
    """

    served_model_name: str = field(
        default=DEFAULT_SERVED_MODEL_NAME,
        metadata={"group": "http", "help": "API model name (default %(default)s)"},
    )
    # The command adds the keys of FLASHSERVE_API_KEYS (collect_api_keys).
    api_keys: tuple[str, ...] = field(
        default=(),
        metadata={
            "group": "http",
            "flag": "--api-key",
            "action": "append",
            "help": f"accepted API key (repeatable; also {API_KEYS_ENV}, comma-separated); "
            "none = no authentication",
        },
    )
    # Larger than any honest request (128 tools with schemas, a long context as
    # text); small enough that a runaway upload is refused before it is parsed.
    max_body_bytes: int = field(
        default=32 << 20, metadata={"group": "http", "help": "larger bodies get 413"}
    )
    # A ": keep-alive" comment after this many seconds without an event keeps
    # proxies and clients from timing out a stream that waits in the queue.
    keep_alive_s: float = field(
        default=10.0,
        metadata={
            "group": "http",
            "flag": "--keep-alive-seconds",
            "help": "SSE ': keep-alive' comment after this long without an event",
        },
    )
    # Requests held at once (streaming or not, running or queued); over it: 429.
    max_concurrent_requests: int | None = field(
        default=None,
        metadata={
            "group": "http",
            "help": "requests held at once (running or queued); more get 429 (default: no limit)",
        },
    )
    # Output budget when a request names none; None = DeepSeek's defaults
    # (server/openai/model_names.py: 4,096 non-thinking, 32,768 thinking), capped by the context.
    default_max_tokens: int | None = field(
        default=None,
        metadata={
            "group": "http",
            "help": "output budget of requests naming none, both modes (default: DeepSeek's, "
            "4096 non-thinking and 32768 thinking, capped by the context)",
        },
    )
    # The checkpoint's fingerprint (the command computes it).
    system_fingerprint: str = "fp_flashserve"
    # How often a non-streamed request checks whether its client has gone.
    disconnect_poll_s: float = 0.5
    # both: the colocated server; prefill / decode: a worker of a split deployment
    # (docs/design/disaggregation.md). A router has settings of its own (server/disagg/settings.py).
    # The command's --role, which also names the router.
    role: Role = "both"
    # Prefill worker: how long a request waits for its pages to become durable on
    # SSD; pages not written by then are left for the decode worker to compute.
    publish_timeout_s: float = field(
        default=60.0,
        metadata={
            "group": "split",
            "flag": "--publish-timeout",
            "help": "prefill worker: seconds to wait for pages to reach the SSD tier; later "
            "ones are left to the decode worker (default %(default)s)",
        },
    )
    # Hardening (docs/design/hardening.md). Engine sequences one request may create
    # (prompts x n); each counts against max_concurrent_sequences while it is held.
    max_sequences_per_request: int = field(
        default=256,
        metadata={
            "group": "limits",
            "help": "engine sequences one request may create, prompts x n (default %(default)s)",
        },
    )
    # The flag's 0 is None here.
    max_concurrent_sequences: int | None = field(
        default=4096,
        metadata={
            "group": "limits",
            "help": "engine sequences held by all requests at once; more get 429; 0 = no "
            "limit (default %(default)s)",
        },
    )
    # Tokenisation and request planning run in worker threads, never on the event loop.
    preprocess_workers: int = field(
        default=4,
        metadata={
            "group": "limits",
            "help": "threads that tokenise and plan requests off the event loop (default "
            "%(default)s)",
        },
    )
    preprocess_timeout_s: float = field(
        default=30.0,
        metadata={
            "group": "limits",
            "flag": "--preprocess-timeout",
            "help": "seconds a request may spend tokenising and planning (default %(default)s)",
        },
    )
    # JSON of the schemas one request may ask to enforce (checked before the engine
    # compiles them; its own limits are EngineConfig.grammar_*).
    max_grammar_schema_bytes: int = field(
        default=256 << 10,
        metadata={
            "group": "limits",
            "help": "JSON bytes of the schemas one request may enforce (default %(default)s)",
        },
    )
    # /health answers 503 when requests are pending and the engine has not finished a
    # step (or an idle wait) for this long: a wedged engine fails its liveness probe.
    health_stall_s: float = field(
        default=30.0,
        metadata={
            "group": "limits",
            "flag": "--health-stall-timeout",
            "help": "/health is 503 when requests are pending and no engine step finished for "
            "this many seconds (default %(default)s)",
        },
    )
    # A request body not received within this many seconds of its headers gets a 408.
    body_read_timeout_s: float = field(
        default=60.0,
        metadata={
            "group": "limits",
            "flag": "--body-timeout",
            "help": "seconds a request's body may take to arrive; then 408 (default %(default)s)",
        },
    )
    # Prices per million tokens (server/openai/pricing.py): usage.cost and the cost counters.
    # The command builds the table from its cost flags.
    prices: PriceTable | None = None
    # Also expose the scheduler and cache metrics under vLLM's names (docs/metrics.md).
    vllm_metric_aliases: bool = field(
        default=False,
        metadata={
            "group": "http",
            "help": "also expose scheduler and cache metrics under vLLM's names (vllm:...), for "
            "the Gateway API inference extension and llm-d (docs/metrics.md)",
        },
    )

    # Images (docs/design/api.md, "Images"). Hosts whose http(s) image URLs the server
    # fetches (vLLM's flag); none: only data: URLs are taken.
    allowed_media_domains: tuple[str, ...] = field(
        default=(),
        metadata={
            "group": "http",
            "nargs": "+",
            "help": "hosts whose http(s) image URLs are fetched (exact names, e.g. "
            "images.example.com 127.0.0.1); default none: only data: URLs",
        },
    )
    # vLLM's flag: a JSON object of per-modality counts ('{"image": 4}') or a number.
    limit_mm_per_prompt: str = field(
        default='{"image": 16}',
        metadata={
            "group": "limits",
            "help": "images one request may carry, as vLLM's JSON ('{\"image\": 4}') or a "
            "number; 0 refuses images (default %(default)s)",
        },
    )
    max_image_bytes: int = field(
        default=20 << 20,
        metadata={
            "group": "limits",
            "help": "encoded bytes of one image, after base64 or download (default %(default)s)",
        },
    )
    # Checked on the container's header, before a pixel is decoded (a decompression bomb).
    max_image_pixels: int = field(
        default=50_000_000,
        metadata={
            "group": "limits",
            "help": "width x height of one decoded image (default %(default)s)",
        },
    )
    media_fetch_timeout_s: float = field(
        default=10.0,
        metadata={
            "group": "limits",
            "flag": "--media-fetch-timeout",
            "help": "seconds to download one image URL (default %(default)s)",
        },
    )

    # The chat page at / (server/playground/); off: / answers only its JSON index.
    playground: bool = field(
        default=True,
        metadata={
            "group": "http",
            "flag": "--no-playground",
            "help": "no chat page at / (it then answers only a JSON index of the API)",
        },
    )

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1:
            raise ValueError("ServerSettings.max_body_bytes must be >= 1")
        if not self.keep_alive_s > 0 or not self.disconnect_poll_s > 0:
            raise ValueError("ServerSettings: keep_alive_s and disconnect_poll_s must be > 0")
        for name in ("max_concurrent_requests", "default_max_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"ServerSettings.{name} must be >= 1 (or None)")
        from server.metrics.disagg_metrics import ROLES

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
        parse_image_limit(self.limit_mm_per_prompt)  # a bad flag fails at start-up
        for name in ("max_image_bytes", "max_image_pixels"):
            if getattr(self, name) < 1:
                raise ValueError(f"ServerSettings.{name} must be >= 1")
        if not self.media_fetch_timeout_s > 0:
            raise ValueError("ServerSettings.media_fetch_timeout_s must be > 0")
        self.allowed_media_domains = tuple(d.strip().lower() for d in self.allowed_media_domains)

    @property
    def max_images(self) -> int:
        """Images one request may carry (``limit_mm_per_prompt``'s ``image`` count)."""
        return parse_image_limit(self.limit_mm_per_prompt)


def parse_image_limit(text: str) -> int:
    """``'{"image": 4}'`` (vLLM's form) or ``'4'`` -> 4; other modalities are refused."""
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if isinstance(value, dict):
        unknown = set(value) - {"image"}
        if unknown:
            raise ValueError(f"--limit-mm-per-prompt: only images are served ({sorted(unknown)})")
        value = value.get("image", 0)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"--limit-mm-per-prompt: {text!r} is not a count of images")
    return value


def collect_api_keys(
    flags: Iterable[str] | None, env: Mapping[str, str] = os.environ
) -> tuple[str, ...]:
    """Keys from repeated ``--api-key`` flags and ``FLASHSERVE_API_KEYS`` (comma-separated),
    in that order, without blanks or repeats."""
    keys = list(flags or [])
    keys += env.get(API_KEYS_ENV, "").split(",")
    return tuple(dict.fromkeys(k.strip() for k in keys if k.strip()))
