"""The Messages API's reachability check: Claude Code's ``HEAD /anthropic/api/hello``
answers 2xx, with or without a key, and says nothing else."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi.testclient import TestClient

from engine.loader.tokenizer import load_tokenizer
from server.app import create_app
from server.settings import ServerSettings


@dataclass
class StubEngine:
    """What ``create_app`` reads of an engine; nothing here generates."""

    tokenizer: object
    vocab_size: int = 129280
    eos_token_id: int = 1
    max_model_len: int = 1024
    is_running: bool = True

    def stalled_for(self) -> float:
        return 0.0


def test_hello_answers_without_a_key_and_holds_nothing() -> None:
    app = create_app(StubEngine(load_tokenizer(None)), ServerSettings(api_keys=("sk-x",)))  # type: ignore[arg-type]
    client = TestClient(app)
    assert client.head("/anthropic/api/hello").status_code == 200
    reply = client.get("/anthropic/api/hello")
    assert reply.status_code == 200 and reply.json() == {}
    # The API itself still wants the key, in Anthropic's error shape.
    refused = client.post("/anthropic/v1/messages", json={})
    assert refused.status_code == 401
    assert refused.json()["type"] == "error"
