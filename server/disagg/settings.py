"""How the router of a split deployment behaves: one dataclass; its fields with a
``help`` are flags of ``flashserve serve --role router``.

Apart from ``server/disagg/router.py`` (which brings FastAPI and httpx) so that
``flashserve serve --help`` reads the flags without importing the web stack.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

# How a worker of a pool is chosen (server/disagg/worker_pool.py).
Routing = Literal["affinity", "least-loaded"]
ROUTINGS: tuple[Routing, ...] = ("affinity", "least-loaded")


@dataclass(frozen=True, slots=True)
class RouterSettings:
    """Where the pools are and how long the router waits for each.

    A field with a ``help`` is a flag of ``flashserve serve`` (flashserve/config_args.py
    reads the metadata); ``connect_timeout_s`` is fixed.
    """

    prefill_urls: tuple[str, ...] = field(
        metadata={
            "flag": "--prefill-url",
            "action": "append",
            "help": "router: a prefill worker (repeatable)",
        }
    )
    decode_urls: tuple[str, ...] = field(
        metadata={
            "flag": "--decode-url",
            "action": "append",
            "help": "router: a decode worker (repeatable)",
        }
    )
    # The whole prefill call: compute plus the SSD writes becoming durable.
    prefill_timeout_s: float = field(
        default=120.0,
        metadata={
            "flag": "--prefill-timeout",
            "help": "router: seconds a prefill call may take before the decode worker "
            "prefills instead (default %(default)s)",
        },
    )
    # Between two reads of a decode worker's response (SSE keep-alives arrive
    # every few seconds; a non-streamed answer arrives whole at the end).
    decode_timeout_s: float = field(
        default=600.0,
        metadata={
            "flag": "--decode-timeout",
            "help": "router: seconds between two reads of a decode worker's answer (default "
            "%(default)s)",
        },
    )
    connect_timeout_s: float = 5.0
    # How a worker is chosen (server/disagg/worker_pool.py): a conversation's own worker,
    # unless it has ``affinity_slack`` more requests in flight than the least busy.
    routing: Routing = field(
        default="affinity",
        metadata={
            "help": "router: affinity keeps a conversation on one worker of each pool (its "
            "device tier holds the earlier turns) unless that worker is --affinity-slack "
            "requests busier than the least busy; least-loaded ignores conversations "
            "(default %(default)s)",
        },
    )
    affinity_slack: int = field(
        default=4, metadata={"help": "router: see --routing (default %(default)s)"}
    )

    def __post_init__(self) -> None:
        if not self.prefill_urls or not self.decode_urls:
            raise ValueError("a router needs at least one prefill URL and one decode URL")
        for name in ("prefill_timeout_s", "decode_timeout_s", "connect_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"RouterSettings.{name} must be > 0")
        if self.routing not in ROUTINGS:
            raise ValueError(f"RouterSettings.routing must be one of {ROUTINGS}")
        if self.affinity_slack < 0:
            raise ValueError("RouterSettings.affinity_slack must be >= 0")
