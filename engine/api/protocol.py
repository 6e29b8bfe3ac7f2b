"""``EngineClient``: what ``server/`` and ``flashserve serve`` may call on an engine.

Two implementations, over the same step loop (``engine/core/engine_core.py``):
``AsyncEngine`` (``engine/api/async_engine.py``, the loop on a thread of the API
process) and ``EngineCoreClient`` (``engine/api/core_client.py``, the loop in an
engine core process). Callers type against this protocol, never against either.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from tokenizers import Tokenizer

from engine.api.model_vision import ModelVision
from engine.api.request import Request, RequestOutput
from engine.core.llm_engine import EngineStats


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """What a prefill-only request left in the SSD tier for a decode worker.

    ``published_pages``: pages of the prompt's chain durable on SSD, counted
    from the first (a chain is usable up to its first missing page).
    ``hit_tokens``: of those, tokens this worker found cached and did not compute.
    """

    prompt_tokens: int
    published_pages: int
    page_tokens: int
    page_file_bytes: int
    hit_tokens: int

    @property
    def published_bytes(self) -> int:
        """Bytes of page files a decode worker reads to restore them (headers included)."""
        return self.published_pages * self.page_file_bytes


class EngineClient(Protocol):
    """An engine serving requests to asyncio callers."""

    def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Stream ``request``'s outputs; the last one has ``finished=True``. Raises
        ``RequestError`` for a request that can never run, ``EngineDeadError`` once the
        engine has stopped. Closing the iterator early aborts the request."""
        ...

    async def prefill(self, request: Request, timeout: float | None = None) -> PrefillResult:
        """Run a prefill-only request; wait up to ``timeout`` s for its pages on SSD."""
        ...

    def validate(self, request: Request) -> None:
        """Raise ``ValueError`` if ``request`` can never run (what ``generate`` checks first)."""
        ...

    def stats(self) -> EngineStats:
        """The latest step's snapshot, with running and waiting counted now."""
        ...

    def stalled_for(self) -> float:
        """Seconds without progress while requests are active (0 when idle)."""
        ...

    @property
    def is_running(self) -> bool: ...

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the engine, end open streams with ``EngineDeadError``, flush the SSD tier."""
        ...

    # The model facts a server builds requests from (read-only, set at build time).
    @property
    def tokenizer(self) -> Tokenizer | None: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def vision(self) -> ModelVision | None:
        """The image processor settings and placeholder id; None for a text-only model."""
        ...
