"""The raw event stream of ``/v1/messages``, event by event, against Anthropic's documented
order (``messages_helpers.check_event_order``), over plain HTTP with ``event:`` lines.

Oracles: the non-streamed answer of the same greedy request (the stream's blocks
must fold into it) and a thinking block's signature computed here. A streamed
tool call's events are checked in test_api_message_tools.py (one forced call
serves both tests: each costs ~90 tokens of the random model).
"""

from __future__ import annotations

from api_helpers import LiveServer
from messages_helpers import (
    GREEDY,
    HELLO,
    blocks,
    check_event_order,
    post,
    raw_events,
    signature_of,
)


def test_a_text_stream_event_by_event(live_server: LiveServer) -> None:
    body = {"model": "claude-sonnet-4-5", "max_tokens": 4, "messages": HELLO, **GREEDY}
    whole = post(live_server, "/anthropic/v1/messages", body).json()
    events = raw_events(live_server, body)
    check_event_order(events)
    names = [n for n, _ in events]
    # Exactly the documented example's shape: start, block start, ping, deltas, stops.
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[3:-3] == ["content_block_delta"] * (len(names) - 6)
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["id"].startswith("msg_") and start["content"] == []
    assert start["model"] == "claude-sonnet-4-5" and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == whole["usage"]["input_tokens"]
    assert events[1][1]["content_block"] == {"type": "text", "text": ""}
    built = blocks(events)
    assert [b["text"] for b in built] == [b["text"] for b in whole["content"]]
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 4


def test_a_thinking_stream_ends_its_block_with_the_signature(live_server: LiveServer) -> None:
    body = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 5,
        "messages": HELLO,
        "thinking": {"type": "enabled", "budget_tokens": 2000},
        **GREEDY,
    }
    events = raw_events(live_server, body)
    check_event_order(events)
    assert events[1][1]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    deltas = [d["delta"]["type"] for n, d in events if n == "content_block_delta"]
    assert deltas[-1] == "signature_delta" and deltas.count("signature_delta") == 1
    assert set(deltas[:-1]) == {"thinking_delta"}
    (block,) = blocks(events)
    assert block["signature"] == signature_of(block["thinking"])
    whole = post(live_server, "/v1/messages", body).json()
    assert whole["content"] == [
        {"type": "thinking", "thinking": block["thinking"], "signature": block["signature"]}
    ]
