"""``EngineCore``: the one step loop, whichever transport feeds it.

The in-process client (``engine/api/async_engine.py``) runs it on a thread of
the API process with a ``queue.Queue`` as its inbox and itself as the sink;
the engine core process (``engine/core/core_process.py``) runs it with a ZeroMQ
socket as its inbox and a sink that encodes every call as a message to the
API process. The loop cannot tell the two apart: it takes commands
(``AddRequest``, ``AbortRequest``, ``Shutdown``) from an ``Inbox``, steps the
``LLMEngine`` and hands outputs, the stats snapshot and the published page
counts of prefill-only requests to a ``Sink``.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from engine.api.request import Request, RequestOutput
from engine.core.llm_engine import EngineStats, LLMEngine

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AddRequest:
    request: Request
    publish_timeout: float | None = None  # prefill-only: how long to wait for the SSD writes


@dataclass(frozen=True, slots=True)
class AbortRequest:
    request_id: str
    report: bool  # False: the consumer is gone, make no final output


@dataclass(frozen=True, slots=True)
class Shutdown:
    pass


Command = AddRequest | AbortRequest | Shutdown


class Inbox(Protocol):
    """Where commands come from; only the loop's thread reads it."""

    def next(self, timeout: float) -> Command | None:
        """The next queued command, waiting up to ``timeout`` s (0: never wait); None if none."""
        ...


class Sink(Protocol):
    """Where the loop's results go. Every call but ``on_published`` comes from the loop's
    thread; ``on_published`` comes from a thread waiting for SSD writes."""

    def on_step(self, outputs: list[RequestOutput], stats: EngineStats, applied_seqs: int) -> None:
        """A step's outputs (all requests together) and the stats taken after it, before
        the outputs are handed on; ``[]`` is a heartbeat. ``applied_seqs``: sequences of
        every request taken so far (``EngineCore.applied_seqs``)."""
        ...

    def on_rejected(self, request: Request, error: Exception, applied_seqs: int) -> None:
        """``LLMEngine.add_request`` raised for ``request`` (it was validated already: a bug)."""
        ...

    def on_published(self, request_id: str, pages: int) -> None:
        """Of a prefill-only request's page chain, ``pages`` are durable on SSD."""
        ...

    def on_failed(self, error: BaseException) -> None:
        """The loop raised ``error`` and has stopped: every request in it is lost."""
        ...


class CoreExit(enum.Enum):
    SHUTDOWN = "shutdown"  # a ``Shutdown`` command
    ORPHANED = "orphaned"  # ``alive()`` turned False: nobody is left to serve
    FAILED = "failed"  # the engine raised; the sink heard ``on_failed``


@dataclass(slots=True)
class EngineCore:
    """Owns the ``LLMEngine`` while ``run`` serves it.

    ``idle_wait_s``: how long an idle loop waits for a command before it reports a
    heartbeat. ``beat_s``: a busy step without outputs is reported only if the last
    busy report is at least this old (0: report every step)."""

    engine: LLMEngine
    idle_wait_s: float
    beat_s: float = 0.0
    # Sequences of the AddRequests taken so far (cumulative): a client subtracts it from
    # what it sent to count what is queued but not yet in the scheduler.
    applied_seqs: int = 0
    _publish_timeouts: dict[str, float | None] = field(default_factory=dict)
    _last_report: float = 0.0

    def run(self, inbox: Inbox, sink: Sink, alive: Callable[[], bool] = lambda: True) -> CoreExit:
        """Serve until a ``Shutdown`` command or until ``alive()`` is False (checked before
        every step and idle wait). If the engine raises, log it, tell ``sink.on_failed``
        and stop: a failed step leaves the engine's state unknown."""
        try:
            return self._serve(inbox, sink, alive)
        except BaseException as exc:  # a failed step poisons every request
            logger.exception("engine loop failed")
            sink.on_failed(exc)
            return CoreExit.FAILED

    def _serve(self, inbox: Inbox, sink: Sink, alive: Callable[[], bool]) -> CoreExit:
        engine = self.engine
        while True:
            if not alive():
                return CoreExit.ORPHANED
            busy = engine.has_unfinished_requests()
            cmd = inbox.next(0.0 if busy else self.idle_wait_s)
            if cmd is None and not busy:
                sink.on_step([], engine.stats(), self.applied_seqs)  # the idle heartbeat
                continue
            while cmd is not None:  # every queued command, before the step
                if isinstance(cmd, Shutdown):
                    return CoreExit.SHUTDOWN
                self._apply(cmd, sink)
                cmd = inbox.next(0.0)
            outputs = engine.step() if engine.has_unfinished_requests() else []
            now = time.monotonic()
            if outputs or now - self._last_report >= self.beat_s:
                self._last_report = now
                sink.on_step(outputs, engine.stats(), self.applied_seqs)
            for out in outputs:
                if out.published_pages is not None:
                    self._wait_published(sink, out.request_id, out.published_pages)

    def _apply(self, cmd: AddRequest | AbortRequest, sink: Sink) -> None:
        if isinstance(cmd, AbortRequest):
            # Frees pages now; a reported abort's final output comes with the next step.
            self.engine.abort(cmd.request_id, report=cmd.report)
            self._publish_timeouts.pop(cmd.request_id, None)
            return
        request = cmd.request
        self.applied_seqs += num_seqs(request)
        try:
            self.engine.add_request(request)
        except Exception as exc:  # validated already by the client; anything left is a bug
            sink.on_rejected(request, exc, self.applied_seqs)
            return
        if request.prefill_only:
            self._publish_timeouts[request.request_id] = cmd.publish_timeout

    def _wait_published(self, sink: Sink, request_id: str, chain: list[bytes]) -> None:
        """Wait for a prefill's SSD writes off the loop, then tell the sink how many made it."""
        timeout = self._publish_timeouts.pop(request_id, None)
        kv = self.engine.kv

        def wait() -> None:
            try:
                pages = kv.wait_published(chain, timeout)
            except Exception:
                logger.exception("waiting for published pages failed")
                pages = 0
            sink.on_published(request_id, pages)

        threading.Thread(target=wait, name="flashserve-publish", daemon=True).start()


def num_seqs(request: Request) -> int:
    """The sequences ``request`` puts in the scheduler."""
    return 1 if request.prefill_only else request.sampling_params.n
