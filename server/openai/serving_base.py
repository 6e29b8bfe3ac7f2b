"""One serving skeleton under every API front end (chat, completions, the next API).

A front end plans its engine calls and writes a ``ResponseBuilder``: what each
engine update becomes, as stream events or as state for the final body.
``serve`` owns the rest, the same for every front end: admission (``Generation``
validates the calls and takes a place), the event stream and its end marker,
keep-alive comments, the client leaving (the stream watches for it, a
non-streamed request polls for it; either way the engine requests are aborted),
the error event when the engine fails mid-stream, and the non-streamed collect.

The stream's framing is the front end's (``EventFraming``): OpenAI ends with
``data: [DONE]`` and reports a failure as a ``data:`` event holding the error
body; an API with named events (``event: ping``, ``event: error``) brings its own.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass

from fastapi import Request as HttpRequest
from fastapi.responses import Response
from pydantic import BaseModel

from server.http.errors import APIError, server_error
from server.http.sse import DONE, KEEP_ALIVE, EventStreamResponse, event
from server.openai.generation import (
    ChoiceUpdate,
    ClientGone,
    EngineCall,
    Generation,
    ServingContext,
    routed_of,
    run_to_end,
)

logger = logging.getLogger(__name__)

# nginx's "client closed request": logged, never read.
CLIENT_CLOSED = 499


@dataclass(frozen=True, slots=True)
class EventFraming:
    """How one API's event stream says "still here", "failed" and "done"."""

    keep_alive: bytes  # sent when nothing came within the keep-alive interval
    failure: Callable[[APIError], Iterable[bytes]]  # the events that end a failed stream
    done: bytes | None  # after the last event of a stream that did not fail


def _openai_failure(error: APIError) -> Iterable[bytes]:
    return (event(error.body()), DONE)


OPENAI_SSE = EventFraming(keep_alive=KEEP_ALIVE, failure=_openai_failure, done=DONE)


class ResponseBuilder(ABC):
    """The request-specific part of serving one API request."""

    def opening(self) -> Iterable[bytes]:
        """Events before any engine output (chat's role chunks, an unscored echo)."""
        return ()

    @abstractmethod
    def stream(self, gen: Generation, update: ChoiceUpdate) -> Iterable[bytes]:
        """Take in one update of a streamed request; the events it makes."""

    @abstractmethod
    def collect(self, update: ChoiceUpdate) -> None:
        """Take in one update of a non-streamed request."""

    def closing(self, gen: Generation) -> Iterable[bytes]:
        """Events after the last output, before the end marker (the usage chunk)."""
        return ()

    @abstractmethod
    def body(self, gen: Generation) -> BaseModel:
        """The non-streamed response, once every call has finished."""


async def serve(
    ctx: ServingContext,
    calls: list[EngineCall],
    builder: ResponseBuilder,
    *,
    stream: bool,
    http_request: HttpRequest,
    prompt_param: str,
    log_id: str,
    framing: EventFraming = OPENAI_SSE,
) -> Response:
    """Run ``calls`` and answer with ``builder``'s events or body (``log_id`` names the
    request in the log; ``prompt_param``: what the API calls the prompt, in errors)."""
    gen = Generation(
        ctx, calls, prompt_param=prompt_param, routed=routed_of(ctx, http_request.headers)
    )
    try:  # the engine compiles the grammars: a schema it cannot build is still a 4xx
        await gen.grammars_ready()
    except BaseException:
        await gen.close()
        raise
    if stream:
        events = _events(ctx, gen, builder, framing, log_id)
        return EventStreamResponse(events, on_close=gen.close)
    try:
        await run_to_end(
            gen, builder.collect, http_request.is_disconnected, ctx.settings.disconnect_poll_s
        )
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    finally:
        await gen.close()
    return Response(builder.body(gen).model_dump_json(), media_type="application/json")


async def _events(
    ctx: ServingContext,
    gen: Generation,
    builder: ResponseBuilder,
    framing: EventFraming,
    log_id: str,
) -> AsyncIterator[bytes]:
    """The stream body: opening events, each update's events (keep-alives while
    nothing comes), closing events, the end marker. The status line is sent before
    the first output, so a failure after it is an event, then the stream ends."""
    for chunk in builder.opening():
        yield chunk
    try:
        while not gen.finished:
            updates = await gen.next(ctx.settings.keep_alive_s)
            if updates is None:
                yield framing.keep_alive
                continue
            for update in updates:
                for chunk in builder.stream(gen, update):
                    yield chunk
    except APIError as exc:
        for chunk in framing.failure(exc):
            yield chunk
        return
    except Exception:  # a bug: end the stream with a server error
        logger.exception("stream %s failed", log_id)
        for chunk in framing.failure(server_error()):
            yield chunk
        return
    for chunk in builder.closing(gen):
        yield chunk
    if framing.done is not None:
        yield framing.done
