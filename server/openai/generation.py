"""Running an API request's engine requests: admission, merge, cancellation, metrics.

An API request becomes one or more engine requests (``EngineCall``): one per
prompt of a completions request, or one per choice when each choice needs a
grammar of its own. ``Generation`` runs each in a task of its own and merges
their outputs, so waiting for the next output (with a timeout, for keep-alive
comments and disconnect checks) never cancels an engine stream. Closing it
cancels those tasks, which makes ``AsyncEngine.generate`` abort its request and
free its pages.

Every open ``Generation`` is listed in its context's ``OpenRequests``, so a server
that stops can end each request still running with one error (``shut_down``)
that the request's own API frames: an error event and the end marker on a stream,
an error body otherwise, rather than a connection cut mid-body.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

from tokenizers import Tokenizer

from engine.api.errors import RequestError
from engine.api.model_vision import ModelVision
from engine.api.protocol import EngineClient
from engine.api.request import CompletionOutput, Request, RequestOutput, TokenLogprob, Usage
from server.disagg.handover import (
    ARRIVAL_HEADER,
    HANDOVER_HEADER,
    Handover,
    local_time,
    parse_arrival,
)
from server.http.errors import (
    APIError,
    from_engine_error,
    invalid_request,
    overloaded,
    shutting_down,
    unavailable,
)
from server.metrics.metrics import ServerMetrics
from server.openai.logprobs import TokenTexts
from server.openai.pricing import Cost
from server.openai.protocol import Usage as ApiUsage
from server.openai.protocol import UsageCost
from server.settings import ServerSettings

T = TypeVar("T")


@dataclass(slots=True)
class Admission:
    """Counts requests and engine sequences in flight; over either limit a new request is
    a 429 (event loop only). A request with ``k`` prompts and ``n`` choices holds
    ``k * n`` sequences: fan-out is charged for what it costs the engine."""

    limit: int | None = None
    sequence_limit: int | None = None
    active: int = 0
    active_sequences: int = 0

    def check(self, sequences: int = 1) -> None:
        """429 if a request of ``sequences`` would not be admitted now (reserves nothing:
        callers check before expensive work, and ``enter`` decides)."""
        if self.limit is not None and self.active >= self.limit:
            raise overloaded()
        if (
            self.sequence_limit is not None
            and self.active_sequences + sequences > self.sequence_limit
        ):
            raise overloaded(
                "Server is busy: too many sequences (prompts x n) in flight; retry later"
            )

    def enter(self, sequences: int = 1) -> None:
        self.check(sequences)
        self.active += 1
        self.active_sequences += sequences

    def leave(self, sequences: int = 1) -> None:
        self.active -= 1
        self.active_sequences -= sequences


@dataclass(slots=True)
class OpenRequests:
    """The generations this server is running (event loop only). ``shut_down`` ends each
    with a 503 "shutting down" raised into its next read, and refuses later ones."""

    generations: set[Generation] = field(default_factory=set)
    shutting_down: bool = False

    def shut_down(self) -> int:
        """End every open generation (each gets an error of its own); how many."""
        self.shutting_down = True
        open_now = list(self.generations)
        for gen in open_now:
            gen.end(shutting_down())
        return len(open_now)


@dataclass(slots=True)
class ServingContext:
    """What serving any API request needs; one per app."""

    engine: EngineClient
    settings: ServerSettings
    metrics: ServerMetrics
    tokenizer: Tokenizer
    token_texts: TokenTexts
    admission: Admission = field(default_factory=Admission)
    open_requests: OpenRequests = field(default_factory=OpenRequests)

    # Worker threads for tokenisation and request planning (``offload``).
    pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(4, thread_name_prefix="preprocess")
    )
    # The model's image facts (``EngineClient.vision``); None: it takes text only.
    vision: ModelVision | None = None
    # Most text bytes one token stands for: a prompt of B bytes has at least
    # B / max_token_bytes tokens, which can refuse it before tokenising.
    max_token_bytes: int = 0

    def __post_init__(self) -> None:
        if self.max_token_bytes == 0 and self.tokenizer is not None:
            self.max_token_bytes = max(
                len(t.encode()) for t in self.tokenizer.get_vocab(with_added_tokens=True)
            )

    def encode(self, text: str, param: str = "messages") -> list[int]:
        """Prompt text (special tokens written out) -> ids; BOS is part of the text.

        Refuses text whose byte length alone proves it exceeds the context, without
        tokenising it. ``encode_batch`` releases the GIL (``encode`` does not), so a
        long prompt in a worker thread does not stall the event loop."""
        nbytes = len(text.encode("utf-8", "surrogatepass"))
        at_least = -(-nbytes // self.max_token_bytes)
        limit = self.engine.max_model_len
        if at_least >= limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your "
                f"{param} ({nbytes} bytes) resulted in at least {at_least} tokens. Please "
                f"reduce the length of the {param}.",
                param=param,
            )
        return self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids

    def decode(self, ids: list[int]) -> str:
        """Token ids -> text with special tokens written out (GIL released, as ``encode``)."""
        return self.tokenizer.decode_batch([ids], skip_special_tokens=False)[0]

    async def offload(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in a preprocessing thread, bounded by the preprocess timeout.

        Tokenising a long prompt or compiling a grammar must not stall other tenants'
        streams or ``/health``. A call still queued at the deadline is cancelled
        (503: every worker is busy); one that overran is left to finish (a thread
        cannot be stopped) and the request gets a 400."""
        future = self.pool.submit(fn, *args)
        timeout = self.settings.preprocess_timeout_s
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout)
        except TimeoutError:
            if future.cancelled() or future.cancel():
                raise unavailable("Every request worker is busy; retry later") from None
            raise invalid_request(
                f"The request took longer than {timeout:g} s to prepare (tokenise, build its "
                "grammar); shorten the prompt or simplify the schema"
            ) from None


@dataclass(slots=True)
class EngineCall:
    """One engine request serving choices ``first_index ..`` of the API request."""

    request: Request
    first_index: int
    prompt_group: int = 0  # calls of one prompt count its tokens once in the usage


@dataclass(slots=True)
class ChoiceUpdate:
    index: int  # the API choice index
    output: CompletionOutput


@dataclass(frozen=True, slots=True)
class Routed:
    """What a router said about a request a decode worker serves."""

    handover: Handover | None  # the pages a prefill worker published
    # On this host's monotonic clock: when the router received the request, and
    # when the prefill worker's pages were durable.
    client_arrival: float | None
    published: float | None


def routed_of(ctx: ServingContext, headers: Mapping[str, str]) -> Routed | None:
    """The router's headers, honoured by a decode worker only."""
    if ctx.settings.role != "decode":
        return None
    now_wall, now = time.time(), time.monotonic()
    handover = Handover.parse(headers.get(HANDOVER_HEADER))
    published = local_time(handover.published_at, now_wall, now) if handover else None
    arrival = parse_arrival(headers.get(ARRIVAL_HEADER), now_wall, now)
    return Routed(handover, arrival, published)


class Generation:
    """The merged outputs of an API request's engine calls."""

    def __init__(
        self,
        ctx: ServingContext,
        calls: list[EngineCall],
        *,
        prompt_param: str = "messages",
        clock: Callable[[], float] = time.monotonic,
        routed: Routed | None = None,
        wall_clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        """Validate every call, then take a place in the admission count (or raise).

        This is where a request is validated: the engine's ``validate`` refuses what can
        never run before any response starts, so it is a 400 or 422, not a failed
        stream (the engine checks again as it adds the request, for its own sake).
        ``prompt_param``: what the API calls the prompt, in the errors.

        ``routed`` (a decode worker of a split deployment): the pages a prefill
        worker published for these prompts, measured when each prompt's first
        call finishes, and the router's arrival time, from which TTFT and
        end-to-end latency are measured."""
        if not ctx.engine.is_running:  # a 503 now, rather than a stream that fails at once
            raise unavailable("The engine is not running")
        if ctx.open_requests.shutting_down:  # planned while the server began to stop
            raise shutting_down()
        for call in calls:
            try:
                ctx.engine.validate(call.request)
            except RequestError as exc:
                raise from_engine_error(exc, prompt_param) from exc
        self._sequences = sum(c.request.sampling_params.n for c in calls)
        ctx.admission.enter(self._sequences)
        self._ctx = ctx
        self._prompt_param = prompt_param
        self._calls = sorted(calls, key=lambda c: c.first_index)
        self._clock = clock
        self._arrived = wall_clock()  # what the request is priced at
        self._routed = routed or Routed(None, None, None)
        self._queue: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()
        self._usage: dict[int, Usage] = {}
        # Per engine call: the scores of its prompt tokens 1 .. (prompt_logprobs).
        self.prompt_scores: dict[int, list[TokenLogprob]] = {}
        self._open = len(calls)
        self._closed = False
        # Per call under a grammar: resolved by its first output (the engine compiled the
        # grammar) or its error.
        loop = asyncio.get_running_loop()
        self._grammar_ready: dict[int, asyncio.Future[None]] = {
            k: loop.create_future()
            for k, c in enumerate(self._calls)
            if c.request.sampling_params.structured is not None
        }
        self._tasks = [
            asyncio.create_task(self._pump(k, call)) for k, call in enumerate(self._calls)
        ]
        ctx.open_requests.generations.add(self)

    async def _pump(self, k: int, call: EngineCall) -> None:
        token_times: list[float] = []
        ready = self._grammar_ready.get(k)
        try:
            async for out in self._ctx.engine.generate(call.request):
                if ready is not None and not ready.done():
                    ready.set_result(None)
                if out.metrics.last_token_time is not None and any(
                    o.token_ids for o in out.outputs
                ):
                    token_times.append(out.metrics.last_token_time)
                if out.finished:
                    self._observe(out, token_times)
                    self._observe_handover(call, out)
                self._queue.put_nowait((k, out))
        except Exception as exc:  # CancelledError is not one: closing stays silent
            if ready is not None and not ready.done():
                ready.set_exception(exc)
            self._queue.put_nowait((k, exc))

    def end(self, error: APIError) -> None:
        """End this request with ``error`` (the server stops): its next read raises it, as
        an engine failure would, so the front end's own framing reports it. Closing the
        generation then aborts the engine requests."""
        # ``grammars_ready`` awaits the futures in order: failing the first pending one
        # wakes it (failing the others too would leave errors no one retrieves).
        pending = next((f for f in self._grammar_ready.values() if not f.done()), None)
        if pending is not None:
            pending.set_exception(error)
        self._queue.put_nowait((0, error))

    async def grammars_ready(self) -> None:
        """Wait until the engine has compiled every call's grammar; the API error of the
        first that it could not build (bounded by the engine's grammar timeout)."""
        for ready in self._grammar_ready.values():
            try:
                await ready
            except Exception as exc:
                raise from_engine_error(exc, self._prompt_param) from exc

    def _observe(self, out: RequestOutput, token_times: list[float]) -> None:
        m = out.metrics
        self._ctx.metrics.observe_request(
            arrival=m.arrival_time,
            first_scheduled=m.first_scheduled_time,
            token_times=token_times,
            finished=m.finished_time if m.finished_time is not None else self._clock(),
            client_arrival=self._routed.client_arrival,
        )

    def _observe_handover(self, call: EngineCall, out: RequestOutput) -> None:
        """Handover latency and bytes of a prompt's first call; a fallback when the
        engine restored fewer pages than the prefill worker published."""
        handover = self._routed.handover
        if handover is None or call is not self._first_of_group(call.prompt_group):
            return
        stats = self._ctx.engine.stats().kv
        pt = stats.page_tokens
        usage = out.usage
        # The decode side leaves at least one prompt token to compute (its logits).
        expected = min(handover.pages_for(call.prompt_group), (usage.prompt_tokens - 1) // pt)
        if expected == 0:
            return
        m = self._ctx.metrics.disagg
        if usage.prompt_cache_hit_tokens < expected * pt:
            m.fallback("missing_pages")
        m.handover_bytes.observe(usage.prompt_ssd_hit_tokens // pt * stats.ssd.file_bytes)
        scheduled, published = out.metrics.first_scheduled_time, self._routed.published
        if scheduled is not None and published is not None:
            m.handover_seconds.observe(max(0.0, scheduled - published))

    def _first_of_group(self, group: int) -> EngineCall:
        return next(c for c in self._calls if c.prompt_group == group)

    @property
    def finished(self) -> bool:
        """Every call has delivered its last output."""
        return self._open == 0

    async def next(self, timeout: float) -> list[ChoiceUpdate] | None:
        """The choices one engine output changed; None when nothing came within ``timeout``."""
        try:
            k, item = self._queue.get_nowait()
        except asyncio.QueueEmpty:
            try:
                k, item = await asyncio.wait_for(self._queue.get(), timeout)
            except TimeoutError:
                return None
        if isinstance(item, BaseException):
            raise from_engine_error(item, self._prompt_param)
        self._usage[k] = item.usage
        if item.prompt_logprobs is not None:
            self.prompt_scores[k] = item.prompt_logprobs
        if item.finished:
            self._open -= 1
        first = self._calls[k].first_index
        return [ChoiceUpdate(first + o.index, o) for o in item.outputs]

    def usage(self, reasoning_tokens: int = 0) -> ApiUsage:
        """Usage of the whole API request: each prompt counted once, every choice's output."""
        prompt = completion = cached = 0
        groups: set[int] = set()
        for k, call in enumerate(self._calls):
            u = self._usage.get(k)
            if u is None:
                continue
            completion += u.completion_tokens
            if call.prompt_group not in groups:
                groups.add(call.prompt_group)
                prompt += u.prompt_tokens
                hit = u.prompt_cache_hit_tokens
                handover = self._routed.handover
                if handover is not None:  # pages a prefill worker computed are no hit
                    page_tokens = self._ctx.engine.stats().kv.page_tokens
                    hit = handover.cached_tokens(call.prompt_group, hit, page_tokens)
                cached += hit
        usage = ApiUsage.build(prompt, completion, cached, min(reasoning_tokens, completion))
        cost = self.cost(usage)
        if cost is not None:
            usage.cost = UsageCost(
                currency=cost.currency,
                cache_hit_input=cost.cache_hit_input,
                cache_miss_input=cost.cache_miss_input,
                output=cost.output,
                total=cost.total,
                off_peak=cost.off_peak,
            )
        return usage

    def cost(self, usage: ApiUsage) -> Cost | None:
        """``usage`` at the server's prices when the request arrived; None without prices."""
        prices = self._ctx.settings.prices
        if prices is None:
            return None
        return prices.cost(
            hit_tokens=usage.prompt_cache_hit_tokens,
            miss_tokens=usage.prompt_cache_miss_tokens,
            output_tokens=usage.completion_tokens,
            when=self._arrived,
        )

    async def close(self) -> None:
        """Cancel unfinished calls (the engine aborts them) and leave the admission count."""
        if self._closed:
            return
        self._closed = True
        self._ctx.open_requests.generations.discard(self)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._ctx.admission.leave(self._sequences)
        # A prefill worker's tokens are billed by the decode worker that serves the answer.
        if self._ctx.settings.role != "prefill":
            cost = self.cost(self.usage())
            if cost is not None:
                self._ctx.metrics.add_cost(cost)


class ClientGone(Exception):
    """The client of a non-streamed request disconnected."""


async def run_to_end(
    gen: Generation,
    on_update: Callable[[ChoiceUpdate], object],  # its result is ignored
    is_disconnected: Callable[[], Awaitable[bool]],
    poll_s: float,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """Feed every update to ``on_update`` until all calls finish; ``ClientGone`` if the
    client leaves first (``is_disconnected``: an async check, made every ``poll_s``
    whether or not outputs keep coming)."""
    next_check = clock() + poll_s
    while not gen.finished:
        updates = await gen.next(max(0.0, next_check - clock()))
        for update in updates or ():
            on_update(update)
        if clock() >= next_check:
            if await is_disconnected():
                raise ClientGone
            next_check = clock() + poll_s
