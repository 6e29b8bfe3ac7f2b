"""What goes into the engine (``Request``) and what comes out each step (``RequestOutput``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.api.sampling_params import SamplingParams
from engine.model.deepseek_v41.vision.image_processor import ProcessedImage
from kvstore.device.page_hash import Salt

FINISH_REASONS = ("stop", "length", "abort", "error")


@dataclass(frozen=True, slots=True)
class ImageInput:
    """One image of a prompt: its span starts at ``offset`` of ``prompt_token_ids`` and
    takes ``image.tokens`` positions, each holding the model's image placeholder id.

    The server decodes and plans the image (``process_image``) and writes the
    placeholders; the engine runs the vision tower over ``image.patches`` and keys
    the pages over the span by ``image.content_hash``.
    """

    offset: int
    image: ProcessedImage

    @property
    def end(self) -> int:
        return self.offset + self.image.tokens


@dataclass(slots=True)
class Request:
    """A prompt (token ids) and how to continue it.

    ``cache_salt`` separates tenants in the prefix cache (user id, API key);
    ``priority``: lower runs first, ties by arrival.

    ``prefill_only`` (a disaggregated prefill worker, docs/design/disaggregation.md):
    run the encoder path over the prompt's full pages, commit and publish
    them, and finish without a token; the sampling parameters are not used.

    ``images``: the prompt's images (``ImageInput``); empty for a text prompt.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    cache_salt: Salt = b""
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    prefill_only: bool = False
    # The prompt's images, in prompt order, spans not overlapping (empty: text only).
    images: list[ImageInput] = field(default_factory=list)


@dataclass(slots=True)
class TokenLogprob:
    """Logprob of a sampled token, and the best alternatives (best first)."""

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None  # 1 = the most likely token; set for prompt scores


@dataclass(slots=True)
class CompletionOutput:
    """The new part of one choice since the previous ``RequestOutput``."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None  # None unless the request asked for logprobs
    finish_reason: str | None = None  # one of FINISH_REASONS once the choice ends
    stop_reason: int | str | None = None  # the stop token id or stop string that matched

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class Usage:
    """Token counts of a request (all choices), as the API reports them.

    The cache hit is measured at the first admission of choice 0, in whole
    pages from either tier. ``replay_tokens`` counts rows below a hit re-run to
    rebuild sliding windows, over every choice and admission (preemption
    resumes included).
    """

    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_cache_hit_tokens: int = 0
    prompt_cache_miss_tokens: int = 0
    prompt_device_hit_tokens: int = 0
    prompt_ssd_hit_tokens: int = 0
    replay_tokens: int = 0


@dataclass(slots=True)
class RequestMetrics:
    """Timing marks (``time.monotonic()`` seconds) for queue time, TTFT and ITL."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    """One step's news about a request: a delta per choice that changed."""

    request_id: str
    outputs: list[CompletionOutput]
    finished: bool
    usage: Usage
    metrics: RequestMetrics
    # With ``prompt_logprobs``: the logprob of prompt tokens 1 .. L-1 under the model's
    # raw distribution (entry i scores token i + 1), in the first output after the
    # prefill; None otherwise.
    prompt_logprobs: list[TokenLogprob] | None = None
    # A finished prefill-only request: the hash chain of its prompt's full pages,
    # queued for the SSD tier (``AsyncEngine.prefill`` waits for them).
    published_pages: list[bytes] | None = None
    # Set on the final output of a request that failed (finish reason "error"): a
    # ``RequestError`` (the request's fault, ``engine/api/errors.py``) or any other
    # exception (a server bug).
    error: BaseException | None = None
