"""The router of a split deployment against scripted workers (``httpx.MockTransport``).

What the router must do with each worker answer: pass the handover to the
decode worker, relay its answer byte for byte, count a fallback for a prefill
worker that times out or fails (and still answer), never count one for a bad
request, and answer in the API's error shape when no decode worker can be
reached. The three-process test (test_split_serving.py) runs real workers.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from server.disagg.handover import ARRIVAL_HEADER, HANDOVER_HEADER, Handover
from server.disagg.router import create_router_app
from server.disagg.settings import RouterSettings
from server.settings import ServerSettings

PREFILL = "http://prefill.test"
DECODE = "http://decode.test"
KEY = "sk-router-test"
CHAT = {"model": "deepseek-flash", "messages": [{"role": "user", "content": "hi"}]}
PUBLISHED = {
    "prompts": [{"prompt_tokens": 300, "published_pages": 4, "hit_tokens": 0}],
    "page_tokens": 64,
    "page_file_bytes": 34272,
    "published_at": 1234.5,
}
SSE_BODY = b'data: {"x":1}\n\ndata: [DONE]\n\n'


class Workers:
    """Scripted prefill and decode workers; records every call."""

    def __init__(self, prefill=None, decode=None) -> None:
        self.calls: list[httpx.Request] = []
        self.prefill = prefill or (lambda r: httpx.Response(200, json=PUBLISHED))
        self.decode = decode or (lambda r: httpx.Response(200, json={"ok": True}))

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.calls.append(request)
        if request.url.host == "prefill.test":
            return self.prefill(request)
        return self.decode(request)


def _client(workers: Workers, **router_kw) -> TestClient:
    router = RouterSettings((PREFILL,), (DECODE,), **router_kw)
    app = create_router_app(
        ServerSettings(api_keys=(KEY,)), router, transport=httpx.MockTransport(workers)
    )
    return TestClient(app, headers={"Authorization": f"Bearer {KEY}"})


def _fallbacks(client: TestClient) -> dict[str, float]:
    text = client.get("/metrics").text
    out = {}
    for family in text_string_to_metric_families(text):
        if family.name == "flashserve:disagg_fallbacks":
            for s in family.samples:
                if s.name.endswith("_total"):
                    out[s.labels["reason"]] = s.value
    return out


def test_prefill_then_decode_with_the_handover_and_the_same_body() -> None:
    workers = Workers()
    with _client(workers) as client:
        reply = client.post("/v1/chat/completions", json=CHAT)
        assert reply.status_code == 200 and reply.json() == {"ok": True}
        assert _fallbacks(client) == dict.fromkeys(_fallbacks(client), 0.0)
    prefill, decode = workers.calls
    assert prefill.url == PREFILL + "/internal/prefill/chat"
    assert decode.url == DECODE + "/v1/chat/completions"
    assert json.loads(prefill.content) == json.loads(decode.content) == CHAT
    for call in (prefill, decode):  # the workers authenticate and salt by the same key
        assert call.headers["authorization"] == f"Bearer {KEY}"
    assert Handover.parse(decode.headers[HANDOVER_HEADER]) == Handover((4,), 1234.5, (0,))
    assert abs(float(decode.headers[ARRIVAL_HEADER]) - time.time()) < 60


@pytest.mark.parametrize(
    ("path", "internal"),
    [
        ("/chat/completions", "/internal/prefill/chat"),
        ("/beta/chat/completions", "/internal/prefill/chat"),
        ("/v1/completions", "/internal/prefill/completions"),
        ("/completions", "/internal/prefill/completions"),
        ("/beta/completions", "/internal/prefill/fim"),
    ],
)
def test_every_public_route_has_its_prefill_route(path: str, internal: str) -> None:
    workers = Workers()
    with _client(workers) as client:
        assert client.post(path, json={"prompt": "x"}).status_code == 200
    assert [c.url.path for c in workers.calls] == [internal, path]


def test_a_client_cannot_send_its_own_handover_or_arrival() -> None:
    workers = Workers(prefill=lambda r: httpx.Response(500))
    forged = {HANDOVER_HEADER: Handover((9,), 1.0).header(), ARRIVAL_HEADER: "1.0"}
    with _client(workers) as client:
        client.post("/v1/completions", json={}, headers=forged)
    sent = workers.calls[-1].headers
    assert HANDOVER_HEADER not in sent and float(sent[ARRIVAL_HEADER]) > 1.0


def _raise(exc: Exception):
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc

    return handler


@pytest.mark.parametrize(
    ("prefill", "reason"),
    [
        (_raise(httpx.ReadTimeout("slow")), "prefill_timeout"),
        (_raise(httpx.ConnectError("refused")), "prefill_error"),
        (_raise(httpx.RemoteProtocolError("peer closed connection")), "prefill_error"),
        (lambda r: httpx.Response(503, json={"error": {}}), "prefill_error"),
        (lambda r: httpx.Response(429, json={"error": {}}), "prefill_error"),
        (lambda r: httpx.Response(200, content=b"not json"), "prefill_error"),
    ],
)
def test_a_failed_prefill_falls_back_to_the_decode_worker(prefill, reason: str) -> None:
    workers = Workers(prefill=prefill)
    with _client(workers) as client:
        reply = client.post("/v1/chat/completions", json=CHAT)
        assert reply.status_code == 200 and reply.json() == {"ok": True}
        counts = _fallbacks(client)
    assert counts.pop(reason) == 1 and set(counts.values()) == {0}
    decode = workers.calls[-1]
    assert decode.url.host == "decode.test" and HANDOVER_HEADER not in decode.headers


def test_a_bad_request_is_no_fallback_and_gets_the_decode_workers_error() -> None:
    error = {"error": {"message": "bad", "type": "invalid_request_error", "param": "messages"}}
    workers = Workers(
        prefill=lambda r: httpx.Response(400, json=error),
        decode=lambda r: httpx.Response(400, json=error),
    )
    with _client(workers) as client:
        reply = client.post("/v1/chat/completions", json={"messages": "x"})
        assert (reply.status_code, reply.json()) == (400, error)
        assert set(_fallbacks(client).values()) == {0}


def test_the_stream_is_relayed_byte_for_byte() -> None:
    sse = {"content-type": "text/event-stream; charset=utf-8", "cache-control": "no-cache"}
    workers = Workers(decode=lambda r: httpx.Response(200, content=SSE_BODY, headers=sse))
    with _client(workers) as client:
        reply = client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    assert reply.content == SSE_BODY
    assert reply.headers["content-type"].startswith("text/event-stream")
    assert reply.headers["cache-control"] == "no-cache"


def test_a_stream_cut_mid_answer_ends_with_an_error_event() -> None:
    class Broken(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield b'data: {"x":1}\n\n'
            raise httpx.RemoteProtocolError("peer closed connection")

    sse = {"content-type": "text/event-stream"}
    workers = Workers(decode=lambda r: httpx.Response(200, stream=Broken(), headers=sse))
    with _client(workers) as client:
        reply = client.post("/v1/chat/completions", json={**CHAT, "stream": True})
    events = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
    assert events[0] == '{"x":1}' and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["type"] == "server_error"


def test_no_decode_worker_is_a_503_in_the_error_shape() -> None:
    workers = Workers(decode=_raise(httpx.ConnectError("refused")))
    with _client(workers) as client:
        reply = client.post("/v1/chat/completions", json=CHAT)
        health = client.get("/health")
    assert reply.status_code == 503
    assert set(reply.json()["error"]) == {"message", "type", "param", "code"}
    assert health.status_code == 503


def test_the_router_authenticates_before_any_worker_is_called() -> None:
    workers = Workers()
    with _client(workers) as client:
        reply = client.post(
            "/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer no"}
        )
        models = client.get("/v1/models").json()
    assert reply.status_code == 401 and reply.json()["error"]["type"] == "authentication_error"
    assert workers.calls == []
    assert "deepseek-flash" in {m["id"] for m in models["data"]}
    # The router has no engine: it does not claim a context length it does not know.
    assert {m["max_model_len"] for m in models["data"]} == {None}


def test_a_conversation_stays_on_its_workers_while_another_may_move() -> None:
    urls = tuple(f"http://w{i}.test" for i in range(4))
    seen: dict[str, list[str]] = {"a": [], "b": []}

    def worker(request: httpx.Request) -> httpx.Response:
        if request.url.path.startswith("/internal"):
            return httpx.Response(200, json=PUBLISHED)
        who = json.loads(request.content)["messages"][1]["content"]
        seen[who].append(str(request.url.host))
        return httpx.Response(200, json={"ok": True})

    router = RouterSettings(urls, urls)
    app = create_router_app(ServerSettings(), router, transport=httpx.MockTransport(worker))
    with TestClient(app) as client:
        for turn in range(5):  # each turn appends to the conversation
            for who in ("a", "b"):
                history = [{"role": "user", "content": f"turn {k}"} for k in range(turn)]
                messages = [
                    {"role": "system", "content": "tools"},
                    {"role": "user", "content": who},
                ]
                client.post("/v1/chat/completions", json={"messages": messages + history})
    assert len(set(seen["a"])) == 1 and len(set(seen["b"])) == 1


def test_router_settings_refuse_an_empty_pool() -> None:
    with pytest.raises(ValueError, match="at least one"):
        RouterSettings((), (DECODE,))
    with pytest.raises(ValueError, match="prefill_timeout_s"):
        RouterSettings((PREFILL,), (DECODE,), prefill_timeout_s=0)


@pytest.mark.parametrize("path", ["/v1/messages", "/anthropic/v1/messages/count_tokens"])
def test_a_messages_request_goes_straight_to_a_decode_worker(path: str) -> None:
    workers = Workers()
    body = {
        "model": "deepseek-flash",
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "hi"}],
    }
    router = RouterSettings((PREFILL,), (DECODE,))
    app = create_router_app(
        ServerSettings(api_keys=(KEY,)), router, transport=httpx.MockTransport(workers)
    )
    with TestClient(app) as client:
        refused = client.post(path, json=body)  # no key: no worker called
        assert refused.status_code == 401 and refused.json()["type"] == "error"  # its shape
        assert client.head("/anthropic/api/hello").status_code == 200
        reply = client.post(path, json=body, headers={"x-api-key": KEY})
        assert reply.status_code == 200 and reply.json() == {"ok": True}
    (decode,) = workers.calls  # no prefill call: no prefill route plans a Messages body
    assert decode.url == DECODE + path and HANDOVER_HEADER not in decode.headers
    assert decode.headers["x-api-key"] == KEY and json.loads(decode.content) == body
