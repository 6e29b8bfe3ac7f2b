"""Drive a workload against one server: sessions start at their arrival offsets, turns
of a session go one after another, ``--max-concurrency`` caps requests in flight."""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass

import httpx
from tokenizers import Tokenizer

from bench.serving.arrivals import arrival_offsets
from bench.serving.client import (
    ClientConfig,
    RequestRecord,
    scrape_metrics,
    served_model,
    stream_request,
)
from bench.serving.metrics import server_counters
from bench.serving.workloads import Message, Session, Workload, completion_prompt


@dataclass(slots=True)
class Arrivals:
    request_rate: float = float("inf")  # sessions per second
    burstiness: float = 1.0
    max_concurrency: int | None = None  # requests in flight at once; None = no cap
    seed: int = 0


@dataclass(slots=True)
class RunResult:
    """The raw outcome of one run: records, wall-clock duration, server counters."""

    model: str
    records: list[RequestRecord]
    duration_s: float
    counters_before: dict[str, float] | None = None
    counters_after: dict[str, float] | None = None


class Progress:
    """A one-line request counter on stderr (rewritten in place on a terminal)."""

    def __init__(self, total: int, label: str = "bench", enabled: bool = True) -> None:
        self.total, self.label, self.enabled = total, label, enabled
        self.done = self.failed = 0
        self.t0 = time.perf_counter()
        self.tty = sys.stderr.isatty()

    def update(self, record: RequestRecord) -> None:
        self.done += 1
        self.failed += not record.success
        if self.enabled and (self.tty or self.done == self.total):
            self._write("\r" if self.tty else "")

    def close(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")
            sys.stderr.flush()

    def _write(self, lead: str) -> None:
        width = 30
        filled = width * self.done // max(1, self.total)
        bar = "#" * filled + "." * (width - filled)
        elapsed = time.perf_counter() - self.t0
        sys.stderr.write(
            f"{lead}[{self.label}] [{bar}] {self.done}/{self.total} requests, "
            f"{self.failed} failed, {elapsed:.1f} s" + ("" if self.tty else "\n")
        )
        sys.stderr.flush()


def prompt_tokens_client(tokenizer: Tokenizer, history: list[Message], endpoint: str) -> int:
    """Client-side prompt length: the completions prompt, or every message's content."""
    if endpoint == "completions":
        texts = [completion_prompt(history)]
    else:
        texts = [m["content"] for m in history]
    return sum(len(tokenizer.encode(t, add_special_tokens=False).ids) for t in texts if t)


async def run_session(
    client: httpx.AsyncClient,
    cfg: ClientConfig,
    session: Session,
    tokenizer: Tokenizer,
    start_at: float,
    clock_zero: float,
    limit: asyncio.Semaphore | None,
    records: list[RequestRecord],
    progress: Progress,
) -> None:
    """Send the session's turns in order, each after the previous reply."""
    await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
    history: list[Message] = []
    failed = False
    for index, turn in enumerate(session.turns):
        history += turn.messages
        record = RequestRecord(
            session_id=session.session_id,
            turn=index,
            group=session.group,
            prompt_len=prompt_tokens_client(tokenizer, history, cfg.endpoint),
            max_tokens=turn.max_tokens,
        )
        if failed:
            record.error = "skipped: an earlier turn of the session failed"
        else:
            if limit is None:
                await stream_request(client, cfg, history, record, clock_zero)
            else:
                async with limit:
                    await stream_request(client, cfg, history, record, clock_zero)
            failed = not record.success
        if record.success:
            record.output_tokens = (
                record.completion_tokens
                if record.completion_tokens is not None
                else len(
                    tokenizer.encode(record.reasoning + record.text, add_special_tokens=False).ids
                )
            )
            history.append({"role": "assistant", "content": record.text})
        records.append(record)
        progress.update(record)


async def settled_metrics(
    client: httpx.AsyncClient, base_url: str, pause_s: float = 0.2, tries: int = 10
) -> str | None:
    """A scrape taken once two in a row agree: the server's counters may come from a
    snapshot taken just after the step that finished the last request."""
    text = await scrape_metrics(client, base_url)
    for _ in range(tries):
        if text is None:
            return None
        await asyncio.sleep(pause_s)
        again = await scrape_metrics(client, base_url)
        if again is not None and server_counters(again) == server_counters(text):
            return again
        text = again
    return text


async def run_workload(
    workload: Workload,
    cfg: ClientConfig,
    tokenizer: Tokenizer,
    arrivals: Arrivals,
    label: str = "bench",
    show_progress: bool = True,
    transport: httpx.AsyncBaseTransport | None = None,
) -> RunResult:
    """Run every session of ``workload`` against ``cfg.base_url``; returns raw records.

    ``transport``: an httpx transport to use instead of the network (tests)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(
        limits=limits, timeout=cfg.timeout_s, transport=transport
    ) as client:
        if not cfg.model:
            cfg.model = await served_model(client, cfg.base_url)
        before = await scrape_metrics(client, cfg.base_url)
        offsets = arrival_offsets(
            len(workload.sessions), arrivals.request_rate, arrivals.burstiness, arrivals.seed
        )
        limit = asyncio.Semaphore(arrivals.max_concurrency) if arrivals.max_concurrency else None
        records: list[RequestRecord] = []
        progress = Progress(workload.num_requests, label, show_progress)
        clock_zero = time.perf_counter()
        await asyncio.gather(
            *(
                run_session(
                    client, cfg, s, tokenizer, clock_zero + t, clock_zero, limit, records, progress
                )
                for s, t in zip(workload.sessions, offsets, strict=True)
            )
        )
        duration = time.perf_counter() - clock_zero
        progress.close()
        after = await settled_metrics(client, cfg.base_url)
    records.sort(key=lambda r: (r.session_id, r.turn))
    return RunResult(
        model=cfg.model,
        records=records,
        duration_s=duration,
        counters_before=server_counters(before) if before is not None else None,
        counters_after=server_counters(after) if after is not None else None,
    )
