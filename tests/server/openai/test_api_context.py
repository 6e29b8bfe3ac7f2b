"""The context through the API: ``/v1/models`` reports it (``max_model_len``), and
``max_tokens`` beyond the room the prompt leaves is clamped to it, finish reason "length".

Oracle: the server's context is ``MAX_MODEL_LEN`` tokens (the live server's
``--max-model-len``), so a prompt of ``P`` tokens leaves exactly
``MAX_MODEL_LEN - P`` to generate, whatever the request asked; EOS is banned
(``logit_bias``) so the random tiny model cannot stop early. A prompt that
fills the context is the only 400 (tests/server/openai/test_api_errors.py).
"""

from __future__ import annotations

import uuid

import httpx
from api_helpers import API_KEY, EOS_ID, MAX_MODEL_LEN, LiveServer, stream_raw

AGENT_MAX_TOKENS = 32000  # what Claude Code asks on every turn, far past this context
NO_EOS = {str(EOS_ID): -100}
ROOM = 5


def _get(server: LiveServer, path: str) -> dict:
    r = httpx.get(
        server.base_url + path, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_models_report_max_model_len_for_every_name(live_server: LiveServer) -> None:
    listed = _get(live_server, "/v1/models")["data"]
    assert len(listed) == 5  # the served name and DeepSeek's four aliases
    assert {card["max_model_len"] for card in listed} == {MAX_MODEL_LEN}
    for card in listed:
        assert _get(live_server, f"/v1/models/{card['id']}") == card
    # The openai SDK keeps the field (an extra on its Model type).
    model = live_server.client().models.retrieve("deepseek-chat")
    assert model.model_extra == {
        "max_model_len": MAX_MODEL_LEN,
        "input_modalities": ["text", "image"],
    }


def _chat_body(text: str, **extra: object) -> dict:
    return {
        "model": "deepseek-chat",
        "messages": [{"role": "user", "content": text}],
        "temperature": 0,
        "logit_bias": NO_EOS,
        **extra,
    }


def _chat_text_leaving(server: LiveServer, room: int) -> tuple[str, int]:
    """A user message whose chat prompt leaves ``room`` tokens: measured, not guessed
    (one call with max_tokens 1 reports the prompt's length; words are one token each)."""
    words = MAX_MODEL_LEN - 40
    text = uuid.uuid4().hex + " hello" * words
    r = server.post("/v1/chat/completions", _chat_body(text, max_tokens=1))
    assert r.status_code == 200, r.text
    prompt = r.json()["usage"]["prompt_tokens"]
    text += " hello" * (MAX_MODEL_LEN - room - prompt)
    return text, MAX_MODEL_LEN - room


def test_completions_clamp_max_tokens_to_the_room_left(live_server: LiveServer) -> None:
    prompt = [100] * (MAX_MODEL_LEN - ROOM)
    body = {
        "model": "deepseek-chat",
        "prompt": prompt,
        "max_tokens": AGENT_MAX_TOKENS,
        "temperature": 0,
        "logit_bias": NO_EOS,
    }
    r = live_server.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["choices"][0]["finish_reason"] == "length"
    usage = data["usage"]
    assert usage["prompt_tokens"] == MAX_MODEL_LEN - ROOM
    assert usage["completion_tokens"] == ROOM
    assert usage["total_tokens"] == MAX_MODEL_LEN


def test_completions_prompt_one_short_of_the_context_gets_one_token(
    live_server: LiveServer,
) -> None:
    body = {"model": "deepseek-chat", "prompt": [100] * (MAX_MODEL_LEN - 1), "max_tokens": 2}
    r = live_server.post("/v1/completions", body)
    assert r.status_code == 200, r.text
    data = r.json()
    assert data["usage"]["completion_tokens"] == 1
    assert data["choices"][0]["finish_reason"] == "length"


def test_chat_clamps_max_tokens_and_max_completion_tokens(live_server: LiveServer) -> None:
    text, prompt_tokens = _chat_text_leaving(live_server, ROOM)
    for field in ("max_tokens", "max_completion_tokens"):
        r = live_server.post("/v1/chat/completions", _chat_body(text, **{field: AGENT_MAX_TOKENS}))
        assert r.status_code == 200, r.text
        data = r.json()
        assert data["choices"][0]["finish_reason"] == "length", field
        assert data["usage"]["prompt_tokens"] == prompt_tokens
        assert data["usage"]["completion_tokens"] == ROOM, field


def test_streamed_chat_clamps_and_ends_with_length(live_server: LiveServer) -> None:
    text, prompt_tokens = _chat_text_leaving(live_server, ROOM)
    body = _chat_body(
        text,
        max_tokens=AGENT_MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
    )
    events, raw = stream_raw(live_server, "/v1/chat/completions", body)
    assert raw[-1] == "[DONE]"
    finishes = [c["choices"][0]["finish_reason"] for c in events if c["choices"]]
    assert [f for f in finishes if f is not None] == ["length"]
    usage = events[-1]["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (prompt_tokens, ROOM)
