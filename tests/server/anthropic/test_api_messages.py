"""The Messages API through the official ``anthropic`` SDK against the tiny server.

Oracles: the OpenAI path on the same conversation (one planner serves both, so a
greedy answer, its reasoning and its prompt length must agree), the SDK's own
parsing of every body and event, hand-computed cache hits (whole 64-token
pages, at least one prompt token left to compute: docs/design/kvstore.md) and
a greedy answer's own text for the stop sequence.
"""

from __future__ import annotations

import uuid

import anthropic
import httpx
import pytest
from api_helpers import MAX_BODY_BYTES, PAGE_TOKENS, LiveServer
from messages_helpers import GREEDY, HELLO, post, sdk, signature_of


def _greedy_chat(live_server: LiveServer, *, thinking: bool, max_tokens: int):
    return live_server.client().chat.completions.create(
        model="deepseek-flash",
        messages=HELLO,
        max_tokens=max_tokens,
        temperature=0.0,
        extra_body={"thinking": {"type": "enabled" if thinking else "disabled"}},
    )


def test_create_answers_as_the_chat_path(live_server: LiveServer) -> None:
    message = sdk(live_server).messages.create(
        model="claude-sonnet-4-5",
        max_tokens=5,
        messages=HELLO,
        extra_body=GREEDY,
        extra_headers={"anthropic-beta": "prompt-caching-2024-07-31"},  # ignored
    )
    chat = _greedy_chat(live_server, thinking=False, max_tokens=5)
    assert message.id.startswith("msg_") and message.type == "message"
    assert (message.role, message.model) == ("assistant", "claude-sonnet-4-5")
    assert [b.type for b in message.content] == ["text"]
    assert message.content[0].text == chat.choices[0].message.content
    assert message.stop_reason == "max_tokens" and message.stop_sequence is None
    assert message.usage.output_tokens == chat.usage.completion_tokens == 5
    assert message.usage.input_tokens == chat.usage.prompt_tokens
    assert message.usage.cache_read_input_tokens == 0
    assert message.usage.cache_creation_input_tokens == 0


def test_stream_builds_the_same_message(live_server: LiveServer) -> None:
    client = sdk(live_server)
    whole = client.messages.create(
        model="claude-sonnet-4-5", max_tokens=5, messages=HELLO, extra_body=GREEDY
    )
    with client.messages.stream(
        model="claude-sonnet-4-5", max_tokens=5, messages=HELLO, extra_body=GREEDY
    ) as stream:
        text = "".join(stream.text_stream)
        streamed = stream.get_final_message()
    assert text == whole.content[0].text == streamed.content[0].text
    assert streamed.stop_reason == "max_tokens"
    assert streamed.usage.output_tokens == 5
    assert streamed.usage.input_tokens == whole.usage.input_tokens


def test_thinking_blocks_hold_the_chat_paths_reasoning(live_server: LiveServer) -> None:
    client = sdk(live_server)
    kwargs = {
        "model": "claude-opus-4-1",  # -> deepseek-v4-pro, the served model
        "max_tokens": 6,
        "messages": HELLO,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "extra_body": GREEDY,
    }
    message = client.messages.create(**kwargs)
    chat = _greedy_chat(live_server, thinking=True, max_tokens=6)
    reasoning = chat.choices[0].message.reasoning_content
    assert reasoning and chat.choices[0].finish_reason == "length"
    # The random model does not close its reasoning in 6 tokens: one thinking block.
    assert [b.type for b in message.content] == ["thinking"]
    block = message.content[0]
    assert block.thinking == reasoning
    assert block.signature == signature_of(reasoning)
    assert message.model == "claude-opus-4-1" and message.stop_reason == "max_tokens"
    with client.messages.stream(**kwargs) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[0].thinking == reasoning
    assert streamed.content[0].signature == block.signature


def test_a_stop_sequence_from_the_greedy_answer_stops_there(live_server: LiveServer) -> None:
    client = sdk(live_server)
    text = (
        client.messages.create(
            model="deepseek-chat", max_tokens=8, messages=HELLO, extra_body=GREEDY
        )
        .content[0]
        .text
    )
    # A piece of the answer that first occurs after its start.
    k = next(i for i in range(1, len(text) - 1) if text.find(text[i : i + 2]) == i)
    stop = text[k : k + 2]
    message = client.messages.create(
        model="deepseek-chat",
        max_tokens=8,
        messages=HELLO,
        stop_sequences=["never-in-this-answer", stop],
        extra_body=GREEDY,
    )
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert "".join(b.text for b in message.content) == text[:k]


def test_count_tokens_is_the_created_messages_input(live_server: LiveServer) -> None:
    client = sdk(live_server)
    body = {
        "model": "claude-sonnet-4-5",
        "system": f"Session {uuid.uuid4().hex}. You are terse.",  # nothing cached it before
        "messages": [{"role": "user", "content": "Hi"}],
        "tools": [
            {
                "name": "read",
                "description": "Read a file",
                "input_schema": {"type": "object", "properties": {"p": {"type": "string"}}},
            }
        ],
    }
    counted = client.messages.count_tokens(**body).input_tokens
    created = client.messages.create(max_tokens=1, **body, extra_body=GREEDY)
    assert created.usage.cache_read_input_tokens == 0
    assert counted == created.usage.input_tokens > 100  # the tool block is in the prompt
    # Thinking changes the prompt (the effort line, the open think tag): counted too.
    thinking = client.messages.count_tokens(
        **body, thinking={"type": "enabled", "budget_tokens": 1024}
    )
    assert thinking.input_tokens > counted
    # At vLLM's path as well.
    r = post(live_server, "/v1/messages/count_tokens", body)
    assert r.status_code == 200 and r.json() == {"input_tokens": counted}


@pytest.mark.parametrize(
    "model", ["claude-3-5-haiku-latest", "deepseek-flash", "deepseek-reasoner"]
)
def test_model_names_served(live_server: LiveServer, model: str) -> None:
    message = sdk(live_server).messages.create(model=model, max_tokens=1, messages=HELLO)
    assert message.model == model


def test_unknown_model_is_a_400(live_server: LiveServer) -> None:
    with pytest.raises(anthropic.BadRequestError) as info:
        sdk(live_server).messages.create(model="gpt-4o", max_tokens=1, messages=HELLO)
    assert info.value.status_code == 400
    assert info.value.body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "Model Not Exist"},
    }


def _error(response: httpx.Response, status: int, kind: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
    assert body["error"]["type"] == kind
    return body["error"]["message"]


def test_errors_in_anthropics_shape(live_server: LiveServer) -> None:
    ok = {"model": "claude-x", "max_tokens": 1, "messages": HELLO}
    for base in ("/anthropic", ""):
        path = base + "/v1/messages"
        missing = {"model": "claude-x", "messages": HELLO}
        assert "max_tokens" in _error(
            post(live_server, path, missing), 400, "invalid_request_error"
        )
        empty = {**ok, "messages": []}
        assert "must not be empty" in _error(
            post(live_server, path, empty), 400, "invalid_request_error"
        )
        bad_json = httpx.post(
            live_server.base_url + path,
            content=b'{"model": "claude-x",',
            headers={
                "x-api-key": "sk-flashserve-test-0123456789",
                "content-type": "application/json",
            },
        )
        assert "JSON" in _error(bad_json, 400, "invalid_request_error")
        bad_key = post(live_server, path, ok, **{"x-api-key": "sk-wrong-key-000000"})
        _error(bad_key, 401, "authentication_error")
        no_key = httpx.post(live_server.base_url + path, json=ok)
        _error(no_key, 401, "authentication_error")
        huge = {**ok, "system": "x" * (MAX_BODY_BYTES + 1)}
        _error(post(live_server, path, huge), 413, "request_too_large")
    _error(httpx.get(live_server.base_url + "/anthropic/v1/nothing"), 404, "not_found_error")
    # The OpenAI path keeps its own shape.
    r = httpx.post(live_server.base_url + "/v1/chat/completions", json={})
    assert r.status_code == 401 and set(r.json()) == {"error"}


def test_sdk_errors(live_server: LiveServer) -> None:
    with pytest.raises(anthropic.AuthenticationError):
        sdk(live_server, api_key="sk-wrong-key-000000").messages.create(
            model="claude-x", max_tokens=1, messages=HELLO
        )
    with pytest.raises(anthropic.BadRequestError) as info:
        sdk(live_server).messages.create(model="claude-x", max_tokens=1, messages=[])
    assert info.value.body["error"]["type"] == "invalid_request_error"
    image = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": "AA=="},
    }
    with pytest.raises(anthropic.BadRequestError) as info:
        sdk(live_server).messages.create(
            model="claude-x", max_tokens=1, messages=[{"role": "user", "content": [image]}]
        )
    # Served, and refused for what it holds: two bytes are no image.
    assert "not a PNG, JPEG, WebP or GIF image" in info.value.body["error"]["message"]


def test_models_list(live_server: LiveServer) -> None:
    page = sdk(live_server).models.list()
    ids = [m.id for m in page.data]
    assert ids[0] == "deepseek-flash" and "deepseek-v4-pro" in ids
    assert all(m.type == "model" for m in page.data)


def test_a_repeated_long_prompt_reads_the_cache_per_user(live_server: LiveServer) -> None:
    client = sdk(live_server)
    system = uuid.uuid4().hex + " " + "The quick brown fox jumps over the lazy dog. " * 30

    def ask(user: str) -> anthropic.types.Usage:
        return client.messages.create(
            model="claude-sonnet-4-5",
            max_tokens=1,
            system=[{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
            messages=HELLO,
            metadata={"user_id": user},
        ).usage

    prompt = client.messages.count_tokens(
        model="claude-sonnet-4-5", system=system, messages=HELLO
    ).input_tokens
    first = ask("alice")
    assert (first.input_tokens, first.cache_read_input_tokens) == (prompt, 0)
    hit = (prompt - 1) // PAGE_TOKENS * PAGE_TOKENS
    again = ask("alice")
    assert again.cache_read_input_tokens == hit >= 2 * PAGE_TOKENS
    assert again.input_tokens == prompt - hit  # Anthropic's: input excludes cache reads
    assert again.cache_creation_input_tokens == 0
    other = ask("bob")  # another tenant
    assert (other.input_tokens, other.cache_read_input_tokens) == (prompt, 0)
