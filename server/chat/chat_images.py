"""A chat request's images -> the engine's ``Request.images`` and the prompt's spans.

Where an image goes (docs/design/api.md, "Images"): the chat template writes
one placeholder (``<｜deepseek_image｜>``) at the image part's place, with the
blank line the encoder puts between any two parts; the planner then expands
that one id into the image's whole span, ``plan.tokens`` copies of it, as the
public ports' processors do (transformers' ``replace_image_token``, vLLM's
prompt replacement). Nothing is added around the span: its start, newline and
end positions are inside it.

Decoding and the resize plan run here, in the planning thread, never on the
event loop; a refused image is a 400 naming its part (``messages[i].content[j]``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from engine.api.model_vision import (
    ImageError,
    ImageLimits,
    ModelVision,
    ProcessedImage,
    process_image,
)
from engine.api.request import ImageInput
from server.chat.image_sources import ImageSource, check_host, decode_data_url, image_error
from server.http.errors import APIError
from server.openai.protocol import ChatMessage, image_parts
from server.settings import ServerSettings


def image_sources(messages: Sequence[ChatMessage]) -> list[ImageSource]:
    """Every image part of ``messages``, in prompt order (the order ``content_text`` writes)."""
    return [
        ImageSource(f"messages[{i}].content[{j}]", part.url)
        for i, m in enumerate(messages)
        for j, part in image_parts(m.content)
    ]


def check_images_allowed(
    sources: Sequence[ImageSource], vision: ModelVision | None, settings: ServerSettings
) -> None:
    """400 when the model takes no images or the request holds more than the limit."""
    if not sources:
        return
    if vision is None:
        raise image_error(
            sources[0].param,
            "this model has no vision tower (its config has no vision_config): it takes text only",
        )
    if len(sources) > settings.max_images:
        raise APIError(
            400,
            f"messages: {len(sources)} images, over this server's limit of "
            f"{settings.max_images} per request (--limit-mm-per-prompt)",
            param="messages",
        )


@dataclass(frozen=True, slots=True)
class PlacedImages:
    prompt_token_ids: list[int]
    images: list[ImageInput]


def process_images(
    sources: Sequence[ImageSource],
    fetched: Mapping[str, bytes],
    vision: ModelVision,
    settings: ServerSettings,
) -> list[ProcessedImage]:
    """Decode, plan and cut each image (``fetched``: remote bodies by part)."""
    limits = ImageLimits(settings.max_image_bytes, settings.max_image_pixels)
    out = []
    for source in sources:
        if source.is_data:
            data = decode_data_url(source, settings.max_image_bytes)
        elif source.param in fetched:
            data = fetched[source.param]
        else:  # a caller that did not fetch: the same refusal a fetch would have given
            check_host(source, source.url, settings.allowed_media_domains)
            raise image_error(source.param, "the image URL was not fetched")
        try:
            out.append(process_image(data, vision.config, limits))
        except ImageError as exc:
            raise image_error(source.param, str(exc)) from None
    return out


def place_images(
    ids: list[int], images: Sequence[ProcessedImage], image_token_id: int
) -> PlacedImages:
    """Expand each placeholder id of ``ids`` into its image's span, in order.

    The prompt must hold exactly one placeholder per image: a text that spells the
    placeholder itself would otherwise pose as an image (a 400)."""
    where = [k for k, t in enumerate(ids) if t == image_token_id]
    if len(where) != len(images):
        raise APIError(
            400,
            f"messages: the text holds the image placeholder token; {len(where)} "
            f"placeholders for {len(images)} images",
            param="messages",
        )
    out: list[int] = []
    placed: list[ImageInput] = []
    start = 0
    for k, image in zip(where, images, strict=True):
        out += ids[start:k]
        placed.append(ImageInput(len(out), image))
        out += [image_token_id] * image.tokens
        start = k + 1
    out += ids[start:]
    return PlacedImages(out, placed)
