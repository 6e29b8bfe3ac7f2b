"""Every failure is ``{"error": {message, type, param, code}}`` with DeepSeek's status codes.

One table of bad bodies, each with the status and ``param`` a client should
see (400 wrong shape, 422 value out of range), written by hand from the API
reference; then authentication, size, path and method errors.
"""

from __future__ import annotations

import re

import httpx
import openai
import pytest
from api_helpers import API_KEY, MAX_BODY_BYTES, MAX_MODEL_LEN, LiveServer

CHAT = "/v1/chat/completions"
TEXT = "/v1/completions"
FIM = "/beta/completions"
HELLO = [{"role": "user", "content": "Hello"}]
CHAT_OK = {"model": "deepseek-chat", "messages": HELLO, "max_tokens": 2}
TEXT_OK = {"model": "deepseek-chat", "prompt": "x", "max_tokens": 2}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
TOO_LONG = "hello " * (MAX_MODEL_LEN + 50)
DROP = object()  # a field to remove from the valid body


def _body(base: dict, **changes: object) -> dict:
    out = dict(base)
    for key, value in changes.items():
        if value is DROP:
            out.pop(key)
        else:
            out[key] = value
    return out


# (id, path, body, status, param)
BAD_BODIES = [
    ("no-model", CHAT, _body(CHAT_OK, model=DROP), 400, "model"),
    ("unknown-model", CHAT, _body(CHAT_OK, model="gpt-4"), 400, "model"),
    ("no-messages", CHAT, _body(CHAT_OK, messages=DROP), 400, "messages"),
    ("empty-messages", CHAT, _body(CHAT_OK, messages=[]), 400, "messages"),
    ("messages-not-list", CHAT, _body(CHAT_OK, messages="hi"), 400, "messages"),
    (
        "unknown-role",
        CHAT,
        _body(CHAT_OK, messages=[{"role": "robot", "content": "x"}]),
        400,
        "messages[0].role",
    ),
    (
        "content-wrong-type",
        CHAT,
        _body(CHAT_OK, messages=[{"role": "user", "content": 5}]),
        400,
        "messages[0].content",
    ),
    (
        "image-part",
        CHAT,
        _body(
            CHAT_OK,
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ],
        ),
        400,
        "messages[0].content[0]",
    ),
    (
        "prefix-not-last",
        CHAT,
        _body(CHAT_OK, messages=[{"role": "assistant", "content": "a", "prefix": True}, *HELLO]),
        400,
        "messages",
    ),
    (
        "prompt-too-long",
        CHAT,
        _body(CHAT_OK, messages=[{"role": "user", "content": TOO_LONG}]),
        400,
        "messages",
    ),
    ("max-tokens-zero", CHAT, _body(CHAT_OK, max_tokens=0), 422, "max_tokens"),
    ("max-tokens-string", CHAT, _body(CHAT_OK, max_tokens="many"), 400, "max_tokens"),
    (
        "max-completion-tokens-zero",
        CHAT,
        _body(CHAT_OK, max_completion_tokens=0),
        422,
        "max_completion_tokens",
    ),
    ("temperature-high", CHAT, _body(CHAT_OK, temperature=2.5), 422, "temperature"),
    ("temperature-string", CHAT, _body(CHAT_OK, temperature="hot"), 400, "temperature"),
    ("top-p-zero", CHAT, _body(CHAT_OK, top_p=0), 422, "top_p"),
    ("top-p-high", CHAT, _body(CHAT_OK, top_p=1.5), 422, "top_p"),
    ("top-k-negative", CHAT, _body(CHAT_OK, top_k=-2), 422, "top_k"),
    ("min-p-high", CHAT, _body(CHAT_OK, min_p=1.5), 422, "min_p"),
    ("frequency-penalty", CHAT, _body(CHAT_OK, frequency_penalty=2.5), 422, "frequency_penalty"),
    ("presence-penalty", CHAT, _body(CHAT_OK, presence_penalty=-3), 422, "presence_penalty"),
    ("repetition-penalty", CHAT, _body(CHAT_OK, repetition_penalty=0), 422, "repetition_penalty"),
    ("n-zero", CHAT, _body(CHAT_OK, n=0), 422, "n"),
    ("n-too-many", CHAT, _body(CHAT_OK, n=129), 422, "n"),
    ("seed-string", CHAT, _body(CHAT_OK, seed="abc"), 400, "seed"),
    ("seed-huge", CHAT, _body(CHAT_OK, seed=2**64), 422, "seed"),
    ("stop-too-many", CHAT, _body(CHAT_OK, stop=[str(i) for i in range(17)]), 422, "stop"),
    ("stop-empty", CHAT, _body(CHAT_OK, stop=[""]), 422, "stop"),
    (
        "top-logprobs-high",
        CHAT,
        _body(CHAT_OK, logprobs=True, top_logprobs=21),
        422,
        "top_logprobs",
    ),
    ("top-logprobs-alone", CHAT, _body(CHAT_OK, top_logprobs=2), 422, "top_logprobs"),
    ("logit-bias-key", CHAT, _body(CHAT_OK, logit_bias={"abc": 1}), 422, "logit_bias"),
    ("logit-bias-value", CHAT, _body(CHAT_OK, logit_bias={"5": 200}), 422, "logit_bias"),
    ("logit-bias-vocab", CHAT, _body(CHAT_OK, logit_bias={"999999": 1}), 422, "logit_bias"),
    (
        "stream-options-alone",
        CHAT,
        _body(CHAT_OK, stream_options={"include_usage": True}),
        422,
        "stream_options",
    ),
    ("tool-choice-no-tools", CHAT, _body(CHAT_OK, tool_choice="required"), 422, "tool_choice"),
    (
        "tool-choice-unknown",
        CHAT,
        _body(CHAT_OK, tools=[TOOL], tool_choice={"type": "function", "function": {"name": "g"}}),
        422,
        "tool_choice",
    ),
    ("tools-too-many", CHAT, _body(CHAT_OK, tools=[TOOL] * 129), 422, "tools"),
    (
        "tool-bad-name",
        CHAT,
        _body(CHAT_OK, tools=[{"type": "function", "function": {"name": "bad name!"}}]),
        400,
        "tools[0].function.name",
    ),
    (
        "format-unknown",
        CHAT,
        _body(CHAT_OK, response_format={"type": "xml"}),
        400,
        "response_format.type",
    ),
    (
        "format-no-schema",
        CHAT,
        _body(CHAT_OK, response_format={"type": "json_schema"}),
        400,
        "response_format",
    ),
    ("thinking-type", CHAT, _body(CHAT_OK, thinking={"type": "maybe"}), 400, "thinking.type"),
    ("effort-unknown", CHAT, _body(CHAT_OK, reasoning_effort="ultra"), 422, "reasoning_effort"),
    ("effort-range", CHAT, _body(CHAT_OK, reasoning_effort=101), 422, "reasoning_effort"),
    ("effort-list", CHAT, _body(CHAT_OK, reasoning_effort=[]), 422, "reasoning_effort"),
    (
        "content-part-type",
        CHAT,
        _body(CHAT_OK, messages=[{"role": "user", "content": [{"type": "audio"}]}]),
        400,
        "messages[0].content[0]",
    ),
    ("stream-string", CHAT, _body(CHAT_OK, stream="maybe"), 400, "stream"),
    ("text-no-prompt", TEXT, _body(TEXT_OK, prompt=DROP), 400, "prompt"),
    ("text-empty-list", TEXT, _body(TEXT_OK, prompt=[]), 400, "prompt"),
    ("text-negative-id", TEXT, _body(TEXT_OK, prompt=[-1]), 422, "prompt"),
    ("text-id-outside-vocab", TEXT, _body(TEXT_OK, prompt=[999999]), 400, "prompt"),
    ("text-too-long", TEXT, _body(TEXT_OK, prompt=TOO_LONG), 400, "prompt"),
    # max_tokens past the room is clamped (test_api_context.py); a prompt that fills the
    # context exactly leaves none and is the refusal.
    ("text-fills-context", TEXT, _body(TEXT_OK, prompt=[100] * MAX_MODEL_LEN), 400, "prompt"),
    ("text-logprobs-high", TEXT, _body(TEXT_OK, logprobs=21), 422, "logprobs"),
    ("text-best-of", TEXT, _body(TEXT_OK, best_of=3), 422, "best_of"),
    ("text-echo-string", TEXT, _body(TEXT_OK, echo="maybe"), 400, "echo"),
    ("text-suffix-with-ids", TEXT, _body(TEXT_OK, prompt=[5, 6], suffix="x"), 400, "prompt"),
    ("fim-token-ids", FIM, _body(TEXT_OK, prompt=[5, 6]), 400, "prompt"),
    ("fim-unknown-model", FIM, _body(TEXT_OK, model="deepseek-coder"), 400, "model"),
]


def _check_error(response: httpx.Response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param, error
    assert isinstance(error["message"], str) and error["message"]
    assert re.search(r"\{\w+(![rsa])?\}", error["message"]) is None  # a template left unfilled
    expected_type = {401: "authentication_error", 429: "rate_limit_error"}.get(
        status, "invalid_request_error"
    )
    assert error["type"] == expected_type and error["code"] == expected_type
    return error


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [case[1:] for case in BAD_BODIES],
    ids=[case[0] for case in BAD_BODIES],
)
def test_bad_body(live_server: LiveServer, path: str, body: dict, status: int, param: str) -> None:
    error = _check_error(live_server.post(path, body), status, param)
    # The message names the field, except DeepSeek's and OpenAI's own wordings.
    message = error["message"]
    assert param in message or message == "Model Not Exist" or "context length" in message


def test_unknown_model_says_model_not_exist(live_server: LiveServer) -> None:
    error = live_server.post(CHAT, _body(CHAT_OK, model="gpt-4")).json()["error"]
    assert error["message"] == "Model Not Exist"


def test_malformed_and_non_object_bodies(live_server: LiveServer) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    for raw in (b'{"model": "deepseek-chat", "messages": [', b"[1, 2]", b"", b"null", b'"x"'):
        r = httpx.post(live_server.base_url + CHAT, content=raw, headers=headers, timeout=10)
        assert r.status_code == 400, (raw, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_body_over_the_limit_is_413(live_server: LiveServer) -> None:
    body = _body(CHAT_OK, messages=[{"role": "user", "content": "x" * MAX_BODY_BYTES}])
    _check_error(live_server.post(CHAT, body), 413, None)
    # A chunked upload (no Content-Length) is cut off the same way.
    chunks = iter([b"{" + b" " * (MAX_BODY_BYTES // 2)] * 3)
    r = httpx.post(
        live_server.base_url + CHAT,
        content=chunks,
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=10,
    )
    assert r.status_code == 413


@pytest.mark.parametrize(
    "authorization", [None, "Bearer sk-wrong-key-000000000", f"Basic {API_KEY}", "Bearer"]
)
def test_auth_failures_are_401(live_server: LiveServer, authorization: str | None) -> None:
    headers = {} if authorization is None else {"Authorization": authorization}
    for method, path in (("POST", CHAT), ("POST", TEXT), ("GET", "/v1/models")):
        r = httpx.request(
            method, live_server.base_url + path, json=CHAT_OK, headers=headers, timeout=10
        )
        _check_error(r, 401, None)


def test_openai_client_raises_typed_errors(live_server: LiveServer) -> None:
    with pytest.raises(openai.AuthenticationError) as auth:
        live_server.client(api_key="sk-wrong-key-000000000").models.list()
    assert auth.value.status_code == 401
    with pytest.raises(openai.BadRequestError) as bad:
        live_server.client().chat.completions.create(model="nope", messages=HELLO)
    assert bad.value.body["message"] == "Model Not Exist"
    with pytest.raises(openai.UnprocessableEntityError):
        live_server.client().chat.completions.create(
            model="deepseek-chat", messages=HELLO, temperature=9
        )


def test_unknown_path_method_and_model_card(live_server: LiveServer) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    base = live_server.base_url
    _check_error(httpx.get(base + "/v1/nothing", headers=headers, timeout=10), 404, None)
    _check_error(httpx.get(base + CHAT, headers=headers, timeout=10), 405, None)
    _check_error(httpx.get(base + "/v1/models/gpt-4", headers=headers, timeout=10), 404, "model")
    card = httpx.get(base + "/v1/models/deepseek-reasoner", headers=headers, timeout=10).json()
    assert card == {
        "id": "deepseek-reasoner",
        "object": "model",
        "created": 0,
        "owned_by": "deepseek",
        "max_model_len": MAX_MODEL_LEN,
        "input_modalities": ["text", "image"],  # the tiny checkpoint has a vision tower
    }
