"""Messages between the engine core and its per-rank workers (msgspec, msgpack).

One ZeroMQ ROUTER socket in the core, one DEALER per worker (tcp, so a worker
on another node connects the same way). Per step the core sends each DP group
one ``StepWork`` (the same bytes to each of its TP ranks) and every rank answers
one ``StepDone``; only a group's TP rank 0 carries logits, prompt scores and the
drafter's captured layer inputs (docs/design/parallelism.md, "Speculative decoding").
"""

from __future__ import annotations

import msgspec
import torch

from engine.api.image_wire import WireImage
from engine.api.request import TokenLogprob


class WorkerSpec(msgspec.Struct, array_like=True):
    """What a worker needs to start (argv of ``python -m engine.parallel.worker``)."""

    rank: int
    world_size: int
    local_rank: int
    tensor_parallel_size: int
    expert_parallel: bool
    dist_url: str  # torch.distributed's init_method, tcp://master:port
    core_url: str  # the core's step socket
    model: str  # checkpoint directory
    model_id: str  # the KV layout's model id (the core's)
    device: str
    dtype: str
    quantization: str
    kv_cache_bytes: int
    page_tokens: int
    kv_dtype: str
    max_num_seqs: int
    timeout_s: float
    threads: int | None
    parent_pid: int  # exit when this process is gone (0: do not watch)
    encoder_cache_bytes: int = 256 << 20  # the rank's encoder cache (EngineConfig's)


class Hello(msgspec.Struct, tag="hello", array_like=True):
    rank: int
    pid: int


class SeqState(msgspec.Struct, array_like=True):
    """A sequence's state as the runner reads it; tokens as a delta since the last send."""

    seq_id: int
    token_base: int  # tokens the worker holds already (0: a new mirror)
    new_tokens: list[int]
    num_prompt_tokens: int
    block_table: list[int]
    stored_tokens: int
    layer_starts: list[int]
    prefill_only: bool
    prompt_logprobs: int | None
    prompt_scored: bool
    # The prompt's images, with a new mirror only (token_base 0): each rank runs the
    # vision tower itself (replicated, docs/design/images.md).
    images: list[WireImage] = []
    # Rows the engine kept (``Sequence.num_computed``): a verify step's rejected rows
    # are rolled back to it when the sequence runs again (engine/runner/verify_undo.py).
    num_computed: int = 0


class StepWork(msgspec.Struct, tag="step", array_like=True):
    step: int
    released: list[int]  # seq ids whose runner state goes first
    seqs: list[SeqState]
    decodes: list[int]
    prefills: list[tuple[int, int, int, bool]]  # (seq id, start, end, last)
    any_rows: bool  # some rank runs a forward this step (an idle EP rank must join it)
    # The SSD tier: page bytes the core loaded (into these page ids), and pages whose
    # bytes it wants back (committed; read before anything this step writes).
    restore: list[tuple[int, bytes]] = []
    fetch: list[int] = []
    # Speculative decoding: (seq id, draft tokens) of each decode that verifies this
    # step. Drafts are not committed tokens: the worker appends them for the step only.
    drafts: list[tuple[int, list[int]]] = []
    # Layers whose block inputs the group's TP rank 0 captures from this step on
    # (sent once, when the core's speculator asks; a drafter in the core reads them).
    capture: list[int] = []


class HiddenRows(msgspec.Struct, array_like=True):
    """One sequence's input rows of one captured layer in the last step."""

    seq_id: int
    layer: int
    first: int  # the position of the first row
    shape: list[int]
    dtype: str  # torch's name (bfloat16 has no numpy dtype)
    data: bytes


def hidden_rows(seq_id: int, layer: int, first: int, rows: torch.Tensor) -> HiddenRows:
    rows = rows.detach().contiguous().cpu()
    data = rows.view(torch.uint8).numpy().tobytes()
    return HiddenRows(
        seq_id, layer, first, list(rows.shape), str(rows.dtype).removeprefix("torch."), data
    )


def rows_of(h: HiddenRows) -> torch.Tensor:
    dtype = getattr(torch, h.dtype)
    if not h.data:
        return torch.empty(h.shape, dtype=dtype)
    return torch.frombuffer(bytearray(h.data), dtype=dtype).view(h.shape)


class Stop(msgspec.Struct, tag="stop", array_like=True):
    pass


ToWorker = StepWork | Stop


class StepDone(msgspec.Struct, tag="done", array_like=True):
    rank: int
    step: int
    logits: list[tuple[int, bytes]]  # (seq id, row bytes of dtype ``logits_dtype``)
    prompt_scores: list[tuple[int, list[TokenLogprob]]]
    error: str | None = None
    seconds: float = 0.0  # wall time of the step's forward on this rank
    logits_dtype: str = "float32"  # numpy's name (float64 in exact runs)
    pages: list[tuple[int, bytes]] = []  # the fetched pages' bytes (TP rank 0)
    comm_seconds: float = 0.0  # of ``seconds``, inside collectives (FLASHSERVE_TIME_COLLECTIVES=1)
    hidden: list[HiddenRows] = []  # the captured layers' input rows (TP rank 0)


FromWorker = Hello | StepDone

ENCODER = msgspec.msgpack.Encoder()
TO_WORKER = msgspec.msgpack.Decoder(ToWorker)
FROM_WORKER = msgspec.msgpack.Decoder(FromWorker)
SPEC = msgspec.msgpack.Decoder(WorkerSpec)
