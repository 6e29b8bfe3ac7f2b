"""``AsyncEngine``: the in-process ``EngineClient`` (``engine/api/protocol.py``).

The step loop (``EngineCore``, ``engine/core/engine_core.py``) runs on a thread
of this process, with a ``queue.Queue`` as its inbox and this client as its
sink: it calls ``on_step`` and friends (``engine/api/stream.py``) on its own
thread, which put outputs on per-request ``asyncio.Queue``s with
``loop.call_soon_threadsafe``. The asyncio side only puts commands on the
queue; it never waits on model compute. A request whose consumer goes away
(the async iterator is closed or its task cancelled) is aborted, and its pages
are freed by the loop before its next step. ``flashserve serve`` runs the loop
in a process of its own by default (``engine/api/core_client.py``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from pathlib import Path

from tokenizers import Tokenizer

from engine.api.errors import EngineDeadError
from engine.api.model_vision import ModelVision, model_vision
from engine.api.request import Request
from engine.api.stream import StreamingClient
from engine.config import EngineConfig
from engine.core.engine_core import (
    AbortRequest,
    AddRequest,
    Command,
    CoreExit,
    EngineCore,
    Shutdown,
)
from engine.core.llm_engine import LLMEngine
from engine.loader.builder import build_engine

logger = logging.getLogger(__name__)

# How long the idle engine thread waits on its inbox before it reports a heartbeat.
_IDLE_WAIT_S = 0.5


class _QueueInbox:
    """The loop's inbox: a thread-safe queue the asyncio side puts commands on."""

    def __init__(self) -> None:
        self.queue: queue.Queue[Command] = queue.Queue()

    def next(self, timeout: float) -> Command | None:
        try:
            return self.queue.get(timeout=timeout) if timeout > 0 else self.queue.get_nowait()
        except queue.Empty:
            return None


class AsyncEngine(StreamingClient):
    """``generate`` / ``prefill`` / ``abort`` / ``stats`` / ``shutdown`` over an engine thread."""

    def __init__(
        self,
        engine_config: EngineConfig,
        model: str | Path = "tiny",
        *,
        engine: LLMEngine | None = None,
        encoder_only: bool = False,
    ) -> None:
        """Load ``model`` ("tiny" = a seeded random tiny model, or a checkpoint
        directory) and start the engine thread. ``engine``: use a prebuilt engine
        (``model`` still names what it was built from: the vision facts are read
        from it). ``encoder_only``: a prefill worker's engine (see ``build_engine``)."""
        self.config = engine_config
        self._vision = model_vision(model)
        self.engine = (
            engine
            if engine is not None
            else build_engine(engine_config, model, encoder_only=encoder_only)
        )
        super().__init__(self.engine.stats())
        self._inbox = _QueueInbox()
        self._core = EngineCore(self.engine, idle_wait_s=_IDLE_WAIT_S)
        self._thread = threading.Thread(target=self._run, name="flashserve-engine", daemon=True)
        self._thread.start()

    def validate(self, request: Request) -> None:
        """Raise ``ValueError`` if ``request`` can never run (what ``generate`` checks first)."""
        self.engine.validate(request)

    # The model facts a server needs to build requests (read-only, set at build time).
    @property
    def tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.engine.vocab_size

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def eos_token_id(self) -> int | None:
        return self.engine.eos_token_id

    @property
    def vision(self) -> ModelVision | None:
        return self._vision

    @property
    def is_running(self) -> bool:
        with self._lock:
            failed = self._error is not None
        return self._thread.is_alive() and not failed

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the engine thread, end open streams with ``EngineDeadError``, flush KV.

        ``timeout`` bounds the whole: the wait for the engine thread's current step,
        then the SSD flush (run in a thread of its own so a hung disk cannot hold the
        process past it). A thread still in its step at the deadline is left alone
        (closing the KV tier under it would be unsafe) and nothing is flushed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            self._stopping = True
        self._inbox.queue.put(Shutdown())
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.error("engine thread busy after %s s; the SSD tier is not flushed", timeout)
            return
        closer = threading.Thread(target=self.engine.close, name="flashserve-close", daemon=True)
        closer.start()
        closer.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        if closer.is_alive():
            logger.error("the SSD flush did not finish within the shutdown timeout")

    # ------------------------------------------------------------ the transport
    def _submit(self, request: Request, publish_timeout: float | None) -> None:
        self._inbox.queue.put(AddRequest(request, publish_timeout))

    def _withdraw(self, request_id: str, report: bool) -> None:
        self._inbox.queue.put(AbortRequest(request_id, report))

    def _queue_now(self) -> tuple[int, int, int]:
        # Read across threads: the scheduler's queue lengths are two len() calls.
        running, waiting = self.engine.queue_lengths()
        return running, waiting, self._core.applied_seqs

    # ------------------------------------------------------------ engine thread
    def _run(self) -> None:
        if self._core.run(self._inbox, self) is CoreExit.SHUTDOWN:
            self._fail_all(EngineDeadError("the engine was shut down"))

    def on_failed(self, error: BaseException) -> None:
        """The loop's step raised: every stream fails, new requests are refused."""
        self._die(EngineDeadError(f"engine step failed: {error!r}"), error)
