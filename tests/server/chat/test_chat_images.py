"""Images through the chat planner: where the spans go, what the engine request holds,
and every refusal as a 400 naming the part (on a planning context, no engine)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from image_helpers import (
    TOKENS_20x16,
    TOKENS_640x480,
    bomb_png,
    data_url,
    image_part,
    png,
)

from engine.api.model_vision import ModelVision
from engine.api.special_tokens import ASSISTANT, BOS, THINK_END, USER
from server.chat import chat_images
from server.chat.chat_plan import ChatPlan, plan_chat
from server.http.errors import APIError
from server.metrics.metrics import ServerMetrics
from server.openai.generation import ServingContext
from server.openai.protocol import ChatCompletionRequest
from server.settings import ServerSettings


@pytest.fixture(scope="module")
def planning(vision_tokenizer: tuple[Any, ModelVision]) -> tuple[Any, ModelVision, int]:
    tokenizer, facts = vision_tokenizer
    # ServingContext's bound on bytes per token, computed once for every context here.
    most = max(len(t.encode()) for t in tokenizer.get_vocab(with_added_tokens=True))
    return tokenizer, facts, most


class _Engine:
    vocab_size = 129280
    max_model_len = 1024


def _ctx(
    planning: tuple[Any, ModelVision],
    *,
    vision: bool = True,
    max_model_len: int = 1024,
    **settings: Any,
) -> ServingContext:
    tokenizer, facts, most = planning
    engine = _Engine()
    engine.max_model_len = max_model_len
    return ServingContext(
        engine=engine,  # type: ignore[arg-type]
        settings=ServerSettings(**settings),
        metrics=ServerMetrics("m"),
        tokenizer=tokenizer,
        token_texts=None,  # type: ignore[arg-type]
        vision=facts if vision else None,
        max_token_bytes=most,
    )


def _body(*content: Any, **extra: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {
            "model": "deepseek-chat",
            "messages": [{"role": "user", "content": list(content)}],
            "max_tokens": 4,
            **extra,
        }
    )


def _plan(ctx: ServingContext, body: ChatCompletionRequest) -> ChatPlan:
    return plan_chat(ctx, body, None, {})


def _refused(ctx: ServingContext, body: ChatCompletionRequest) -> APIError:
    with pytest.raises(APIError) as info:
        _plan(ctx, body)
    assert info.value.status == 400
    return info.value


def test_spans_replace_each_image_part_in_order(planning) -> None:
    tokenizer, facts, _ = planning
    img = facts.image_token_id
    red, small = png(640, 480), png(20, 16, (0, 90, 200))
    body = _body(
        {"type": "text", "text": "look:"},
        image_part(data_url(red)),
        {"type": "text", "text": "and"},
        image_part(data_url(small)),
    )
    (call,) = _plan(_ctx(planning), body).calls
    request = call.request

    def enc(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False).ids

    # The oracle, by hand: the template's text pieces (parts joined by a blank line)
    # around spans of the token counts the public ports give for these sizes.
    first = enc(BOS + USER + "look:\n\n")
    middle = enc("\n\nand\n\n")
    expected = (
        first + [img] * TOKENS_640x480 + middle + [img] * TOKENS_20x16 + enc(ASSISTANT + THINK_END)
    )
    assert request.prompt_token_ids == expected
    a, b = request.images
    assert (a.offset, a.image.tokens) == (len(first), TOKENS_640x480)
    assert (b.offset, b.image.tokens) == (a.end + len(middle), TOKENS_20x16)
    assert request.prompt_token_ids[a.offset - 1] != img and request.prompt_token_ids[a.end] != img
    # What usage.prompt_tokens will count: the text's tokens plus every span.
    text_tokens = len(first) + len(middle) + len(enc(ASSISTANT + THINK_END))
    assert len(request.prompt_token_ids) == text_tokens + TOKENS_640x480 + TOKENS_20x16
    assert a.image.content_hash != b.image.content_hash


def test_the_same_pixels_in_other_containers_hash_alike(planning) -> None:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (640, 480), (200, 30, 30)).save(buf, format="WEBP", lossless=True)
    body = _body(
        image_part(data_url(png(640, 480))), image_part(data_url(buf.getvalue(), "image/webp"))
    )
    a, b = _plan(_ctx(planning), body).calls[0].request.images
    assert a.image.content_hash == b.image.content_hash
    other = _body(image_part(data_url(png(640, 480, (200, 30, 31)))))
    (c,) = _plan(_ctx(planning), other).calls[0].request.images
    assert c.image.content_hash != a.image.content_hash


def test_text_only_requests_carry_no_images(planning) -> None:
    (call,) = _plan(_ctx(planning), _body({"type": "text", "text": "hi"})).calls
    assert call.request.images == []


def test_tool_results_may_hold_images(planning) -> None:
    body = ChatCompletionRequest.model_validate(
        {
            "model": "deepseek-chat",
            "messages": [
                {"role": "user", "content": "shoot"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"id": "c1", "function": {"name": "shot", "arguments": "{}"}}],
                },
                {
                    "role": "tool",
                    "tool_call_id": "c1",
                    "content": [image_part(data_url(png(20, 16)))],
                },
            ],
        }
    )
    (image,) = _plan(_ctx(planning), body).calls[0].request.images
    assert image.image.tokens == TOKENS_20x16


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (b"hello, not an image", "not a PNG, JPEG, WebP or GIF image"),
        (b"<svg xmlns='http://www.w3.org/2000/svg'></svg>", "SVG images are not supported"),
        (png(640, 480)[:300], "image data is corrupt"),
        (bomb_png(), "decompression bomb"),
    ],
    ids=["not-an-image", "svg", "truncated", "decompression-bomb"],
)
def test_bad_images_are_400s_naming_the_part(planning, data, words) -> None:
    body = _body({"type": "text", "text": "what"}, image_part(data_url(data)))
    error = _refused(_ctx(planning), body)
    assert error.param == "messages[0].content[1]" and error.code == "invalid_request_error"
    assert error.message.startswith("messages[0].content[1]: ") and words in error.message


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("data:image/png,rawbytes", "base64"),
        ("data:text/plain;base64,aGk=", "not an image"),
        ("data:image/png;base64,@@@@", "base64 is invalid"),
        ("ftp://example.com/a.png", "data: or http(s)"),
        ("https://example.com/a.png", "--allowed-media-domains"),
    ],
)
def test_bad_urls_are_400s(planning, url, words) -> None:
    error = _refused(_ctx(planning), _body(image_part(url)))
    assert error.param == "messages[0].content[0]" and words in error.message


def test_limits_are_400s(planning) -> None:
    one = image_part(data_url(png(640, 480)))
    error = _refused(_ctx(planning, limit_mm_per_prompt='{"image": 1}'), _body(one, one))
    assert error.param == "messages" and "2 images" in error.message
    assert "--limit-mm-per-prompt" in error.message
    error = _refused(_ctx(planning, max_image_bytes=1000), _body(one))
    assert "larger than 1000 bytes" in error.message and error.param == "messages[0].content[0]"
    error = _refused(_ctx(planning, max_image_pixels=640 * 480 - 1), _body(one))
    assert "over the limit of 307199" in error.message
    # Image tokens count against the context like any prompt token: 2 x 206 > 400.
    error = _refused(_ctx(planning, max_model_len=400), _body(one, one))
    assert error.param == "messages" and "400" in error.message
    # One fits.
    assert _plan(_ctx(planning, max_model_len=400), _body(one)).calls


def test_a_model_without_a_vision_tower_refuses_images(planning) -> None:
    body = _body({"type": "text", "text": "what"}, image_part(data_url(png(20, 16))))
    error = _refused(_ctx(planning, vision=False), body)
    assert error.param == "messages[0].content[1]"
    assert "no vision tower" in error.message


def test_text_spelling_the_placeholder_cannot_pose_as_an_image(planning) -> None:
    body = _body({"type": "text", "text": "<｜deepseek_image｜>"})
    assert "placeholder" in _refused(_ctx(planning), body).message


def test_images_in_system_or_assistant_turns_are_refused() -> None:
    from pydantic import ValidationError

    for role in ("system", "assistant", "developer"):
        with pytest.raises(ValidationError, match="cannot hold images"):
            ChatCompletionRequest.model_validate(
                {
                    "model": "deepseek-chat",
                    "messages": [
                        {"role": role, "content": [image_part("data:image/png;base64,AA==")]},
                        {"role": "user", "content": "hi"},
                    ],
                }
            )


def test_images_decode_in_the_planning_thread(planning, monkeypatch) -> None:
    """Through ``ctx.offload``, as the routes plan: never on the event loop's thread."""
    import asyncio

    seen: list[str] = []
    real = chat_images.process_image

    def spy(*args: Any) -> Any:
        seen.append(threading.current_thread().name)
        return real(*args)

    monkeypatch.setattr(chat_images, "process_image", spy)
    ctx = _ctx(planning)
    body = _body(image_part(data_url(png(20, 16))))
    asyncio.run(ctx.offload(plan_chat, ctx, body, None, {}))
    assert seen and all(name.startswith("preprocess") for name in seen)
    ctx.pool.shutdown()


def test_openai_image_url_as_a_plain_string_is_read_as_the_object(planning) -> None:
    body = _body({"type": "image_url", "image_url": data_url(png(20, 16))})
    (image,) = _plan(_ctx(planning), body).calls[0].request.images
    assert image.image.tokens == TOKENS_20x16
