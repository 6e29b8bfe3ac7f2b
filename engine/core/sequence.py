"""One generated stream: its tokens, its pages and the plan of its current admission.

A request with ``n`` choices owns ``n`` sequences. A sequence is admitted (its
prefix looked up in the KV store, its plan fixed), prefilled in chunks, then
decoded one token per step. Preemption drops its pages and runner state; the
next admission plans again over prompt plus outputs so far, which makes the
resume a restore (docs/design/semantics.md, docs/design/engine.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from enum import StrEnum

from engine.api.request import ImageInput, TokenLogprob
from engine.model.semantics.replay import ReplayPlan
from kvstore.device.page_hash import Salt, SpanKey


class TokenSlice(SequenceABC[int]):
    """A read-only window ``ids[start:stop]`` of a growing token list, without a copy.

    The sampler's histories and the page commits read a sequence's tokens every
    step; copying 32K-token lists per sequence per step would be engine overhead.
    """

    __slots__ = ("_ids", "_start", "_stop")

    def __init__(self, ids: list[int], start: int, stop: int) -> None:
        self._ids, self._start, self._stop = ids, start, stop

    def __len__(self) -> int:
        return self._stop - self._start

    def __getitem__(self, i: int | slice) -> int | list[int]:  # type: ignore[override]
        if isinstance(i, slice):
            return [self._ids[self._start + k] for k in range(*i.indices(len(self)))]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        return self._ids[self._start + (i % len(self))]

    def __iter__(self) -> Iterator[int]:
        ids = self._ids
        return (ids[k] for k in range(self._start, self._stop))


class SequenceStatus(StrEnum):
    WAITING = "waiting"  # not admitted, or preempted and waiting to be admitted again
    RUNNING = "running"  # admitted: holds pages, prefilling or decoding
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """State of one choice of a request, as the scheduler and the runner see it.

    Compared by identity: two choices with equal tokens are still two sequences.

    Plan of the current admission (docs/design/semantics.md): ``stored_tokens``
    (H) tokens of global KV came from the store; layer ``l`` runs rows from
    ``layer_starts[l]`` on (``engine.model.semantics.replay.ReplayPlan``): the pass starts at
    ``encoder_start`` (e0), the decoder at ``decoder_start`` (d0).
    ``num_computed`` counts rows the runner has processed: it starts at e0 and
    reaches ``prefill_end`` when the prefill's last chunk runs; each decode step
    then adds one.
    """

    seq_id: int
    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int
    salt: Salt = b""
    priority: int = 0
    arrival: float = 0.0
    index: int = 0  # choice index within the request (0 .. n-1)
    prefill_only: bool = False  # encoder path only: no decoder rows, no token
    # The prompt's images (spans in order, inside the prompt); the runner feeds their
    # encoder rows at the span positions, and every page hash over a span includes its
    # image (``span_keys``). Both outlive preemption: the spans are prompt positions.
    images: tuple[ImageInput, ...] = ()
    # Score the prompt (top k alternatives): every prompt row runs at full depth and
    # yields logits, until the prompt is scored once (a resume does not score again).
    prompt_logprobs: int | None = None
    prompt_scored: bool = False
    prompt_scores: list[TokenLogprob] = field(default_factory=list)  # tokens 1 .. so far
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    # Plan of the current admission.
    stored_tokens: int = 0
    layer_starts: tuple[int, ...] = ()
    encoder_start: int = 0
    decoder_start: int = 0
    prefill_end: int = 0
    num_computed: int = 0
    # Timing marks (time.monotonic()); first_* are set once and survive preemption.
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    # Counters. The cache hit of the first admission is what the API reports.
    num_admissions: int = 0
    num_preemptions: int = 0
    prompt_hit_tokens: int = 0
    prompt_device_hit_tokens: int = 0
    prompt_ssd_hit_tokens: int = 0
    replay_tokens: int = 0  # rows below H re-run through the encoder, over all admissions
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    # ------------------------------------------------------------ views
    @property
    def span_keys(self) -> tuple[SpanKey, ...]:
        """The image spans as the page hashes key them (``kvstore/device/page_hash.py``)."""
        return tuple(SpanKey(i.offset, i.image.tokens, i.image.content_hash) for i in self.images)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_view(self) -> TokenSlice:
        return TokenSlice(self.token_ids, 0, self.num_prompt_tokens)

    @property
    def output_view(self) -> TokenSlice:
        return TokenSlice(self.token_ids, self.num_prompt_tokens, self.num_tokens)

    @property
    def computed_view(self) -> TokenSlice:
        """Tokens whose KV the runner has written (what page commits hash)."""
        return TokenSlice(self.token_ids, 0, self.num_computed)

    @property
    def scores_prompt(self) -> bool:
        """This admission's prefill yields the logits of every prompt row."""
        return self.prompt_logprobs is not None and not self.prompt_scored

    @property
    def in_prefill(self) -> bool:
        """Admitted and still running its prefill chunks."""
        return self.num_computed < self.prefill_end

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def sort_key(self) -> tuple[int, float, int]:
        """Scheduling order: lower priority value first, then arrival, then id."""
        return (self.priority, self.arrival, self.seq_id)

    # ------------------------------------------------------------ transitions
    def admit(self, plan: ReplayPlan, decoder_start: int) -> None:
        """Fix this admission's plan: the one prefill rule of docs/design/semantics.md."""
        self.stored_tokens = plan.stored_tokens
        self.layer_starts = plan.starts
        self.encoder_start = plan.encoder_start
        self.decoder_start = decoder_start
        self.prefill_end = self.num_tokens
        self.num_computed = plan.encoder_start
        self.status = SequenceStatus.RUNNING
        self.num_admissions += 1
        self.replay_tokens += max(0, plan.stored_tokens - plan.encoder_start)

    def reset_for_preemption(self) -> None:
        """Back to waiting; outputs so far are kept and become part of the next prompt."""
        self.status = SequenceStatus.WAITING
        self.block_table = []
        self.stored_tokens = self.encoder_start = self.decoder_start = 0
        self.layer_starts = ()
        if not self.prompt_scored:  # the next admission scores the prompt from row 0 again
            self.prompt_scores = []
        self.prefill_end = self.num_computed = 0
        self.num_preemptions += 1
