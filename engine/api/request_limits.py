"""What makes a request impossible to run, as plain numbers (``RequestLimits``).

``LLMEngine.validate`` checks a request against its own limits; the engine
core's client (``engine/api/core_client.py``) receives the same limits from the
core process once, at start-up, so a server can check a request in the API
process (a 400 before any response starts) without a round trip. Every refusal
is a ``RequestError`` naming the field (``engine/api/errors.py``).

``output_budget`` is the one rule for how many tokens a request may generate
(docs/design/api.md, "Output length and the context"): every front end sizes
``max_tokens`` with it, so a client asking for more than the context holds gets
what fits and a "length" finish, never a refusal, unless its prompt alone fills
the context.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.api.errors import RequestError
from engine.api.request import Request


def check_room(prompt_tokens: int, max_model_len: int) -> int:
    """Tokens the context has left after the prompt; ``RequestError`` naming the prompt
    when it leaves none."""
    room = max_model_len - prompt_tokens
    if room < 1:
        raise RequestError(
            "prompt_token_ids",
            f"{prompt_tokens} tokens leave no room under max_model_len={max_model_len}",
        )
    return room


def output_budget(
    requested: int | None, prompt_tokens: int, max_model_len: int, default: int | None = None
) -> int:
    """``max_tokens`` for the engine: ``requested`` (else ``default``, else unbounded)
    clamped to the room the prompt leaves, so that generation ends with finish reason
    "length" where the context does. Agents ask a fixed large budget whatever their
    prompt (32,000 tokens on every turn), and refusing it would fail a turn that
    fits. Raises ``RequestError`` naming the prompt only when it leaves no room."""
    room = check_room(prompt_tokens, max_model_len)
    wanted = requested if requested is not None else default
    return room if wanted is None else min(wanted, room)


@dataclass(frozen=True, slots=True)
class RequestLimits:
    vocab_size: int
    max_model_len: int
    page_tokens: int
    num_pages: int
    has_tokenizer: bool
    encoder_only: bool = False
    # A model with a vision tower: the placeholder id of image positions and the
    # processor settings an image's plan must be made with (None: text only).
    image_token_id: int | None = None
    image_patch_size: int | None = None
    image_downsample_ratio: int | None = None

    @property
    def takes_images(self) -> bool:
        return self.image_token_id is not None

    def pages_needed(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_tokens)

    def validate(self, request: Request) -> None:
        """Raise ``RequestError`` (naming the field) if ``request`` can never run."""
        params = request.sampling_params
        if self.encoder_only and not request.prefill_only:
            raise RequestError(
                None,
                "this engine holds the encoder layers only (a prefill worker): "
                "it runs prefill-only requests",
            )
        params.validate(self.vocab_size)
        self._check_prompt(request.prompt_token_ids)
        self._check_images(request)
        if params.stop and not self.has_tokenizer:
            raise RequestError("stop", "stop strings need a tokenizer")
        if params.n > 1 and params.structured is not None:
            # The server asks one engine request per choice under a grammar.
            raise RequestError("n", "a structured output serves one sequence (n = 1)")

    def _check_prompt(self, prompt: list[int]) -> None:
        field = "prompt_token_ids"
        if not prompt:
            raise RequestError(field, "the prompt is empty")
        if any(not 0 <= t < self.vocab_size for t in prompt):
            raise RequestError(field, f"ids must lie in [0, {self.vocab_size})")
        check_room(len(prompt), self.max_model_len)
        if self.pages_needed(len(prompt)) > self.num_pages:
            raise RequestError(
                field,
                f"{len(prompt)} tokens need more KV pages than the cache holds "
                f"({self.num_pages} pages of {self.page_tokens} tokens)",
            )

    def _check_images(self, request: Request) -> None:
        """Spans in order, inside the prompt, apart, all placeholders and the only ones;
        each image planned with this model's processor settings, its patches its plan's."""
        prompt = request.prompt_token_ids
        image_id = self.image_token_id
        if image_id is None:
            if request.images:
                raise RequestError("images", "this model has no vision tower")
            return
        end = 0
        for i, item in enumerate(request.images):
            image, plan = item.image, item.image.plan
            if item.offset < end:
                raise RequestError("images", "image spans must be in prompt order, not overlapping")
            if item.offset < 0 or item.end > len(prompt):
                raise RequestError(
                    "images",
                    f"image {i}'s span [{item.offset}, {item.end}) lies outside the prompt "
                    f"of {len(prompt)} tokens",
                )
            if prompt[item.offset : item.end].count(image_id) != item.image.tokens:
                raise RequestError(
                    "images",
                    f"image {i}'s span [{item.offset}, {item.end}) must hold the image "
                    f"placeholder id {image_id} at every position",
                )
            if (plan.patch_size, plan.downsample_ratio) != (
                self.image_patch_size,
                self.image_downsample_ratio,
            ):
                raise RequestError(
                    "images",
                    f"image {i} was planned for patch {plan.patch_size} / downsample "
                    f"{plan.downsample_ratio}; this model takes {self.image_patch_size} / "
                    f"{self.image_downsample_ratio}",
                )
            shape = (plan.n_patches, 3 * plan.patch_size**2)
            if tuple(image.patches.shape) != shape:
                raise RequestError(
                    "images",
                    f"image {i}'s patches are {tuple(image.patches.shape)}, its plan needs {shape}",
                )
            if len(image.content_hash) != 32:
                raise RequestError("images", f"image {i}'s content hash is not 32 bytes")
            end = item.end
        in_spans = sum(item.image.tokens for item in request.images)
        if prompt.count(image_id) != in_spans:
            raise RequestError(
                "prompt_token_ids",
                f"the image placeholder id {image_id} appears outside the images' spans",
            )
