"""The messages between the API process and the engine core process (msgspec, msgpack).

Two ZeroMQ PUSH/PULL sockets over ``ipc://`` files: requests, aborts and
shutdown go to the core; one ``StepMsg`` per engine step comes back with every
output of that step (all requests together, so a 32-stream batch is one
message, not 32), the stats snapshot ``/metrics`` and ``/health`` read, and
how many queued sequences the core has taken. Outputs decode straight into the
engine's own dataclasses (``CompletionOutput``, ``Usage`` ...); only an
output's exception travels as text (``WireError``).

A request's ``SamplingParams`` travel as their fields, its structured-output
spec among them (a schema's text: a few KB, compiled by the core itself); its
images as ``WireImage`` (plan, patch bytes, content hash: ``image_wire.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from engine.api.errors import GrammarError, RequestError
from engine.api.image_wire import WireImage, image_of, wire_image
from engine.api.request import (
    CompletionOutput,
    Request,
    RequestMetrics,
    RequestOutput,
    TokenLogprob,
    Usage,
)
from engine.api.request_limits import RequestLimits
from engine.api.sampling_params import SamplingParams, StructuredOutputSpec
from engine.core.llm_engine import EngineStats
from kvstore.device.page_hash import salt_bytes

# ------------------------------------------------------------ API process -> core


class AddMsg(msgspec.Struct, tag="add", array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]  # SamplingParams' fields (the spec as its fields)
    cache_salt: bytes  # the salt's bytes (what the page hashes use)
    priority: int
    arrival_time: float  # time.monotonic(): one clock for every process of the host
    prefill_only: bool
    num_seqs: int
    publish_timeout: float | None = None  # prefill-only: wait this long for the SSD writes
    images: list[WireImage] = []  # the prompt's images (``Request.images``), in order


class AbortMsg(msgspec.Struct, tag="abort", array_like=True):
    request_id: str
    report: bool  # False: the consumer is gone, make no final output


class ShutdownMsg(msgspec.Struct, tag="shutdown", array_like=True):
    pass


ToCore = AddMsg | AbortMsg | ShutdownMsg

# ------------------------------------------------------------ core -> API process


class WireError(msgspec.Struct, array_like=True):
    """An exception that ended one request: ``request`` (a ``RequestError``: its own
    fault, e.g. a field out of range or a dead grammar; ``param`` and the message are
    for the client), ``grammar`` (its grammar could not be built: ``param`` and
    ``status`` say what to answer) or ``internal`` (a bug; the text is for the log)."""

    kind: str
    message: str
    param: str | None = None
    status: int = 400


class WireOutput(msgspec.Struct, array_like=True):
    request_id: str
    outputs: list[CompletionOutput]
    finished: bool
    usage: Usage
    metrics: RequestMetrics
    prompt_logprobs: list[TokenLogprob] | None
    published_pages: list[bytes] | None
    error: WireError | None


class ReadyMsg(msgspec.Struct, tag="ready", array_like=True):
    """The core loaded its model: the facts the API process builds requests from."""

    limits: RequestLimits
    eos_token_id: int | None
    tokenizer_json: str | None  # the core's tokenizer, so both sides use the same one
    stats: EngineStats


class StepMsg(msgspec.Struct, tag="step", array_like=True):
    outputs: list[WireOutput]
    stats: EngineStats
    applied_seqs: int  # cumulative sequences of AddMsgs the core has taken


class QueueMsg(msgspec.Struct, tag="queue", array_like=True):
    """Running and waiting sequences just after a step was scheduled (sent when they
    changed), so ``/metrics`` does not wait for a long step's end to see admissions."""

    running: int
    waiting: int
    applied_seqs: int


class PublishedMsg(msgspec.Struct, tag="published", array_like=True):
    """A prefill-only request's pages: how many of its chain are durable on SSD."""

    request_id: str
    pages: int


class DeadMsg(msgspec.Struct, tag="dead", array_like=True):
    """The core failed (a step raised, or the model did not load) and is exiting."""

    message: str


FromCore = ReadyMsg | StepMsg | QueueMsg | PublishedMsg | DeadMsg

ENCODER = msgspec.msgpack.Encoder()
TO_CORE = msgspec.msgpack.Decoder(ToCore)
FROM_CORE = msgspec.msgpack.Decoder(FromCore)


# ------------------------------------------------------------ conversions


def add_msg(request: Request, publish_timeout: float | None = None) -> AddMsg:
    params = request.sampling_params
    fields = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    return AddMsg(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        params=fields,
        cache_salt=salt_bytes(request.cache_salt),
        priority=request.priority,
        arrival_time=request.arrival_time,
        prefill_only=request.prefill_only,
        num_seqs=1 if request.prefill_only else params.n,
        publish_timeout=publish_timeout,
        images=[wire_image(i) for i in request.images],
    )


def request_of(msg: AddMsg) -> Request:
    fields = dict(msg.params)
    # msgpack has no tuples and keeps int map keys: only logit_bias needs rebuilding.
    if fields.get("logit_bias") is not None:
        fields["logit_bias"] = {int(k): float(v) for k, v in fields["logit_bias"].items()}
    if fields.get("structured") is not None:
        fields["structured"] = StructuredOutputSpec(**fields["structured"])
    return Request(
        request_id=msg.request_id,
        prompt_token_ids=msg.prompt_token_ids,
        sampling_params=SamplingParams(**fields),
        cache_salt=msg.cache_salt,
        priority=msg.priority,
        arrival_time=msg.arrival_time,
        prefill_only=msg.prefill_only,
        images=[image_of(i) for i in msg.images],
    )


def wire_error(exc: BaseException) -> WireError:
    if isinstance(exc, GrammarError):
        return WireError("grammar", exc.message, exc.param, exc.status)
    if isinstance(exc, RequestError):
        return WireError("request", exc.message, exc.param)
    return WireError("internal", repr(exc))


def error_of(err: WireError) -> BaseException:
    if err.kind == "grammar":
        return GrammarError(err.message, param=err.param or "", status=err.status)
    if err.kind == "request":
        return RequestError(err.param, err.message)
    return RuntimeError(f"in the engine core: {err.message}")


def wire_output(out: RequestOutput) -> WireOutput:
    return WireOutput(
        request_id=out.request_id,
        outputs=out.outputs,
        finished=out.finished,
        usage=out.usage,
        metrics=out.metrics,
        prompt_logprobs=out.prompt_logprobs,
        published_pages=out.published_pages,
        error=None if out.error is None else wire_error(out.error),
    )


def output_of(msg: WireOutput) -> RequestOutput:
    return RequestOutput(
        request_id=msg.request_id,
        outputs=msg.outputs,
        finished=msg.finished,
        usage=msg.usage,
        metrics=msg.metrics,
        prompt_logprobs=msg.prompt_logprobs,
        published_pages=msg.published_pages,
        error=None if msg.error is None else error_of(msg.error),
    )
