"""Images over HTTP: ``/v1/models`` says who takes them, bad images are 400s in the
API's error shape within a second and leave the server healthy, and a real tiny server
answers the openai SDK's and langchain's image messages with the spans counted."""

from __future__ import annotations

import base64
import time
from typing import Any

import httpx
import openai
import pytest
from api_helpers import API_KEY, PAGE_TOKENS, LiveServer
from fastapi.testclient import TestClient
from image_helpers import (
    TOKENS_640x480,
    bomb_png,
    data_url,
    image_part,
    png,
)
from stub_engine import StubEngine, stub_client
from tokenizers import Tokenizer

from engine.api.special_tokens import ASSISTANT, BOS, THINK_END, USER

RED = png(640, 480)
QUESTION = {"type": "text", "text": "What colour is it?"}


@pytest.fixture(scope="module")
def vision_stub(vision_tokenizer: tuple[Any, Any]) -> TestClient:
    tokenizer, facts = vision_tokenizer
    return stub_client(StubEngine(tokenizer, vision=facts), limit_mm_per_prompt="2")


@pytest.fixture(scope="module")
def text_stub(vision_tokenizer: tuple[Any, Any]) -> TestClient:
    """The same tokenizer, a model without a vision tower."""
    return stub_client(StubEngine(vision_tokenizer[0]))


def _chat(client: TestClient, *content: Any) -> Any:
    body = {"model": "deepseek-chat", "messages": [{"role": "user", "content": list(content)}]}
    return client.post("/v1/chat/completions", json=body)


def test_models_say_which_inputs_they_take(vision_stub: TestClient, text_stub: TestClient) -> None:
    (card, *_) = vision_stub.get("/v1/models").json()["data"]
    assert card["input_modalities"] == ["text", "image"]
    assert vision_stub.get(f"/v1/models/{card['id']}").json()["input_modalities"] == [
        "text",
        "image",
    ]
    (anthropic_card, *_) = vision_stub.get("/anthropic/v1/models").json()["data"]
    assert anthropic_card["input_modalities"] == ["text", "image"]
    cards = text_stub.get("/v1/models").json()["data"]
    assert all(c["input_modalities"] == ["text"] for c in cards)


BAD_IMAGES = pytest.mark.parametrize(
    ("part", "words"),
    [
        (image_part(data_url(b"not an image at all")), "not a PNG"),
        (image_part(data_url(RED[:500])), "corrupt"),
        (image_part(data_url(bomb_png())), "pixels"),
        (image_part(data_url(b"<svg></svg>", "image/svg+xml")), "SVG"),
        (image_part("https://images.example.com/cat.png"), "--allowed-media-domains"),
    ],
    ids=["not-an-image", "truncated", "bomb", "svg", "url-not-allowed"],
)


@BAD_IMAGES
def test_bad_images_are_quick_400s_and_the_server_stays_healthy(
    vision_stub: TestClient, part: dict[str, Any], words: str
) -> None:
    start = time.monotonic()
    reply = _chat(vision_stub, QUESTION, part)
    assert time.monotonic() - start < 1.0
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == "messages[0].content[1]" and words in error["message"]
    assert error["type"] == error["code"] == "invalid_request_error"
    assert vision_stub.get("/health").status_code == 200


def test_too_many_images_is_a_400(vision_stub: TestClient) -> None:
    one = image_part(data_url(png(20, 16)))
    reply = _chat(vision_stub, one, one, one)
    assert reply.status_code == 400 and "--limit-mm-per-prompt" in reply.json()["error"]["message"]


def test_a_text_model_names_why_it_refuses(text_stub: TestClient) -> None:
    reply = _chat(text_stub, QUESTION, image_part(data_url(RED)))
    assert reply.status_code == 400 and "no vision tower" in reply.json()["error"]["message"]


def test_messages_api_image_blocks_are_counted(vision_stub: TestClient) -> None:
    def count(content: list[dict[str, Any]]) -> int:
        body = {"model": "claude-x", "messages": [{"role": "user", "content": content}]}
        reply = vision_stub.post("/anthropic/v1/messages/count_tokens", json=body)
        assert reply.status_code == 200, reply.text
        return reply.json()["input_tokens"]

    b64 = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(RED).decode()}
    with_image = count([{"type": "image", "source": b64}, {"type": "text", "text": "hi"}])
    twice = count([{"type": "image", "source": b64}] * 2 + [{"type": "text", "text": "hi"}])
    # A second image adds its span and one blank-line separator (one token here).
    assert twice - with_image == TOKENS_640x480 + 1
    url = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    body = {"model": "claude-x", "messages": [{"role": "user", "content": [url]}]}
    reply = vision_stub.post("/anthropic/v1/messages/count_tokens", json=body)
    assert reply.status_code == 400 and "--allowed-media-domains" in reply.text


# ---------------------------------------------------------------- the real tiny server


def _expected_prompt_tokens(tokenizer: Tokenizer, text: str) -> int:
    """An image first, then ``text``: the template's pieces around a 640x480 span."""

    def enc(piece: str) -> int:
        return len(tokenizer.encode(piece, add_special_tokens=False).ids)

    return enc(BOS + USER) + TOKENS_640x480 + enc("\n\n" + text + ASSISTANT + THINK_END)


def test_openai_sdk_sends_a_base64_image(client: openai.OpenAI, served_tokenizer) -> None:
    messages = [
        {
            "role": "user",
            "content": [image_part(data_url(RED)), QUESTION],
        }
    ]
    done = client.chat.completions.create(
        model="deepseek-chat", messages=messages, max_tokens=3, temperature=0
    )
    expected = _expected_prompt_tokens(served_tokenizer, QUESTION["text"])
    assert done.usage.prompt_tokens == expected
    stream = client.chat.completions.create(
        model="deepseek-chat",
        messages=messages,
        max_tokens=3,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == done.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == expected


def test_langchain_image_message(live_server: LiveServer, served_tokenizer) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage

    llm = langchain_openai.ChatOpenAI(
        model="deepseek-chat",
        base_url=live_server.base_url + "/v1",
        api_key=API_KEY,
        temperature=0,
        max_tokens=3,
    )
    message = HumanMessage(
        content=[
            {"type": "image_url", "image_url": {"url": data_url(RED)}},
            {"type": "text", "text": QUESTION["text"]},
        ]
    )
    answer = llm.invoke([message])
    assert answer.usage_metadata["input_tokens"] == _expected_prompt_tokens(
        served_tokenizer, QUESTION["text"]
    )


def test_an_allowed_url_is_fetched(client: openai.OpenAI, served_tokenizer) -> None:
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Host(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(len(RED)))
            self.end_headers()
            self.wfile.write(RED)

        def log_message(self, *args: object) -> None:
            pass

    host = ThreadingHTTPServer(("127.0.0.1", 0), Host)
    threading.Thread(target=host.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{host.server_port}/red.png"
        done = client.chat.completions.create(
            model="deepseek-chat",
            messages=[{"role": "user", "content": [image_part(url), QUESTION]}],
            max_tokens=1,
        )
    finally:
        host.shutdown()
        host.server_close()
    assert done.usage.prompt_tokens == _expected_prompt_tokens(served_tokenizer, QUESTION["text"])


@BAD_IMAGES
def test_live_bad_images_are_quick_400s(
    live_server: LiveServer, part: dict[str, Any], words: str
) -> None:
    body = {"model": "deepseek-chat", "messages": [{"role": "user", "content": [QUESTION, part]}]}
    start = time.monotonic()
    reply = live_server.post("/v1/chat/completions", body)
    assert time.monotonic() - start < 1.0
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "messages[0].content[1]" and words in error["message"]
    (card, *_) = live_server.client().models.list().data
    assert card.model_extra["input_modalities"] == ["text", "image"]
    assert httpx.get(live_server.base_url + "/health").status_code == 200


def test_the_same_image_hits_the_cache_and_another_does_not(client: openai.OpenAI) -> None:
    """Pages over a span are keyed by the image's content: the same pixels hit, an image
    of the same size with one colour step more does not, from the span's first page on."""

    def hit(colour: tuple[int, int, int]) -> tuple[int, int]:
        content = [image_part(data_url(png(640, 480, colour))), QUESTION]
        done = client.chat.completions.create(
            model="deepseek-chat",
            messages=[{"role": "user", "content": content}],
            max_tokens=1,
        )
        return done.usage.model_extra["prompt_cache_hit_tokens"], done.usage.prompt_tokens

    first, prompt_tokens = hit((11, 22, 33))
    again, _ = hit((11, 22, 33))
    other, _ = hit((11, 22, 34))
    assert first == 0
    # Every full page of the prompt, each overlapping the span (it covers tokens 2-207).
    assert again == prompt_tokens // PAGE_TOKENS * PAGE_TOKENS >= 3 * PAGE_TOKENS
    assert other == 0
