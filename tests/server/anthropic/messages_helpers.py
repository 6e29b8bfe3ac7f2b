"""Shared pieces of the Messages API tests: clients, raw SSE, Anthropic's event order."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import anthropic
import httpx
from api_helpers import API_KEY, LiveServer

# Short prompts (under one 64-token page): nothing is cached, so greedy answers repeat.
HELLO = [{"role": "user", "content": "Say hello"}]
GREEDY = {"temperature": 0.0}  # as extra_body: newer SDKs dropped the keyword


def sdk(server: LiveServer, api_key: str = API_KEY) -> anthropic.Anthropic:
    """The official SDK at DeepSeek's base URL shape (``<server>/anthropic``)."""
    return anthropic.Anthropic(base_url=server.base_url + "/anthropic", api_key=api_key)


def post(server: LiveServer, path: str, body: Any, **headers: str) -> httpx.Response:
    headers = {"x-api-key": API_KEY, **headers}
    return httpx.post(server.base_url + path, json=body, headers=headers, timeout=120)


def raw_events(server: LiveServer, body: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """(event name, data) of every event of a streamed ``/v1/messages``, in order;
    comment lines (keep-alives) are skipped, as SSE clients skip them."""
    events: list[tuple[str, dict[str, Any]]] = []
    name = None
    with httpx.stream(
        "POST",
        server.base_url + "/v1/messages",
        json={**body, "stream": True},
        headers={"Authorization": f"Bearer {API_KEY}"},  # Claude Code's way
        timeout=120,
    ) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("event: "):
                assert name is None, "two event lines for one event"
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                assert name is not None, f"data without an event line: {line}"
                events.append((name, json.loads(line[len("data: ") :])))
                name = None
    return events


def check_event_order(events: list[tuple[str, dict[str, Any]]]) -> None:
    """Anthropic's documented stream: message_start; per content block (indices 0, 1, ...)
    content_block_start, content_block_delta..., content_block_stop; message_delta;
    message_stop. ``ping`` may come anywhere after message_start; each event's name is
    its data's ``type``."""
    names = [n for n, _ in events]
    for name, data in events:
        assert data["type"] == name
    assert names[0] == "message_start" and names[-1] == "message_stop", names
    assert names[-2] == "message_delta", names
    assert names.count("message_start") == names.count("message_delta") == 1
    open_index = None
    next_index = 0
    for name, data in events[1:-2]:
        if name == "ping":
            continue
        if name == "content_block_start":
            assert open_index is None and data["index"] == next_index, names
            open_index = next_index
        elif name == "content_block_delta":
            assert data["index"] == open_index, names
        elif name == "content_block_stop":
            assert data["index"] == open_index, names
            open_index, next_index = None, next_index + 1
        else:
            raise AssertionError(f"unexpected {name} between message_start and message_delta")
    assert open_index is None, "a block was never stopped"


def blocks(events: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """The content blocks a stream builds: each start's block, its deltas folded in."""
    out: list[dict[str, Any]] = []
    for name, data in events:
        if name == "content_block_start":
            out.append({**data["content_block"], "partial_json": ""})
        elif name == "content_block_delta":
            delta, block = data["delta"], out[data["index"]]
            kind = delta["type"]
            if kind == "text_delta":
                block["text"] += delta["text"]
            elif kind == "thinking_delta":
                block["thinking"] += delta["thinking"]
            elif kind == "signature_delta":
                block["signature"] += delta["signature"]
            else:
                assert kind == "input_json_delta", delta
                block["partial_json"] += delta["partial_json"]
    return out


def signature_of(thinking: str) -> str:
    """What the server signs a thinking block with (a keyless digest of its text)."""
    return hashlib.blake2b(thinking.encode(), digest_size=24, person=b"fs-thinking-v1").hexdigest()
