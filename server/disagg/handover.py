"""What a router tells a decode worker about the pages a prefill worker published.

The KV bytes themselves never travel over HTTP: they are page files in the
shared SSD tier, keyed by the prefix-cache hash chain, so the decode worker
finds them by its own lookup. The header only carries what the decode worker
cannot know: how many pages were published per prompt (to detect a fallback),
how many of those the prefill worker found cached rather than computed (so the
client's usage counts as cache hits only tokens nobody computed for it, as a
colocated server would), and when they became durable (to time the handover).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

HANDOVER_HEADER = "x-flashserve-handover"
# The router's ``time.time()`` when the client's request reached it: a decode
# worker measures TTFT and end-to-end latency from there, so its histograms show
# what the client saw, prefill call included.
ARRIVAL_HEADER = "x-flashserve-arrived-at"

# The internal route of a prefill worker for each public route.
PREFILL_ROUTES = {
    "/v1/chat/completions": "/internal/prefill/chat",
    "/chat/completions": "/internal/prefill/chat",
    "/beta/chat/completions": "/internal/prefill/chat",
    "/v1/completions": "/internal/prefill/completions",
    "/completions": "/internal/prefill/completions",
    "/beta/completions": "/internal/prefill/fim",
}

# Public routes the router sends straight to a decode worker, which prefills them
# itself: no prefill-worker route plans a Messages body. An agent's repeated context
# still hits that worker's prefix cache, and session affinity keeps the
# conversation on it.
DECODE_ROUTES = (
    "/v1/messages",
    "/anthropic/v1/messages",
    "/v1/messages/count_tokens",
    "/anthropic/v1/messages/count_tokens",
)


@dataclass(frozen=True, slots=True)
class Handover:
    """Pages published for each prompt of a request (its prompt groups, in order)."""

    pages: tuple[int, ...]
    published_at: float  # time.time() on the prefill worker once the pages were durable
    # Per prompt: tokens the prefill worker found in its cache (it computed the rest
    # of the published pages for this request).
    hit_tokens: tuple[int, ...] = ()

    def header(self) -> str:
        return json.dumps(
            {
                "pages": list(self.pages),
                "hit_tokens": list(self.hit_tokens),
                "published_at": self.published_at,
            }
        )

    @classmethod
    def parse(cls, value: str | None) -> Handover | None:
        """The header's handover, or None when absent or malformed (then nothing is
        measured: a bad header must not fail a request the decode worker can serve)."""
        if not value:
            return None
        try:
            raw = json.loads(value)
            pages = tuple(int(p) for p in raw["pages"])
            hits = tuple(int(h) for h in raw.get("hit_tokens", ()))
            published_at = float(raw["published_at"])
        except (ValueError, TypeError, KeyError, AttributeError, OverflowError):
            return None  # OverflowError: a page count of 1e400 (int(inf))
        if any(n < 0 for n in pages + hits) or not math.isfinite(published_at):
            return None
        return cls(pages, published_at, hits)

    def pages_for(self, prompt_group: int) -> int:
        return self.pages[prompt_group] if prompt_group < len(self.pages) else 0

    def cached_tokens(self, prompt_group: int, restored_tokens: int, page_tokens: int) -> int:
        """Prompt tokens nobody computed for this request, of the ``restored_tokens`` the
        decode worker found cached: minus those the prefill worker computed for it
        (published tokens past its own cache hit)."""
        published = self.pages_for(prompt_group) * page_tokens
        hit = self.hit_tokens[prompt_group] if prompt_group < len(self.hit_tokens) else 0
        return restored_tokens - max(0, min(restored_tokens, published) - hit)


def local_time(wall: float, now_wall: float, now_monotonic: float) -> float:
    """Another host's ``time.time()`` on this host's monotonic clock (the engine's);
    a time in the future (clock skew) counts as now."""
    return now_monotonic - max(0.0, now_wall - wall)


def parse_arrival(value: str | None, now_wall: float, now_monotonic: float) -> float | None:
    """The router's arrival time on this host's monotonic clock, or None when absent
    or malformed."""
    if not value:
        return None
    try:
        wall = float(value)
    except ValueError:
        return None
    if not math.isfinite(wall):
        return None
    return local_time(wall, now_wall, now_monotonic)
