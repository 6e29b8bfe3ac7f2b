"""The Messages API's reachability check: Claude Code's ``HEAD /anthropic/api/hello``
answers 2xx, with or without a key, and says nothing else."""

from __future__ import annotations

from stub_engine import stub_client


def test_hello_answers_without_a_key_and_holds_nothing() -> None:
    client = stub_client(api_keys=("sk-x",))
    assert client.head("/anthropic/api/hello").status_code == 200
    reply = client.get("/anthropic/api/hello")
    assert reply.status_code == 200 and reply.json() == {}
    # The API itself still wants the key, in Anthropic's error shape.
    refused = client.post("/anthropic/v1/messages", json={})
    assert refused.status_code == 401
    assert refused.json()["type"] == "error"
