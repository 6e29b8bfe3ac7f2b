"""/health follows the engine's heartbeat (docs/design/hardening.md): 503 when requests are
pending and the engine has made no progress for ``health_stall_s``, else 200."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi.testclient import TestClient

from engine.loader.tokenizer import load_tokenizer
from server.app import create_app
from server.settings import ServerSettings


@dataclass
class StubEngine:
    """What ``create_app`` and ``/health`` read of an ``AsyncEngine``."""

    tokenizer: object
    vocab_size: int = 129280
    eos_token_id: int = 1
    max_model_len: int = 1024
    is_running: bool = True
    stalled: float = 0.0

    def stalled_for(self) -> float:
        return self.stalled


def test_health_is_503_once_the_engine_stalls_past_the_limit() -> None:
    engine = StubEngine(load_tokenizer(None))
    app = create_app(engine, ServerSettings(health_stall_s=5.0))  # type: ignore[arg-type]
    with TestClient(app) as client:
        assert client.get("/health").json() == {"status": "ok"}
        engine.stalled = 4.9  # a long step, still within the limit
        assert client.get("/health").status_code == 200
        engine.stalled = 7.0
        r = client.get("/health")
        assert r.status_code == 503
        assert r.json()["error"]["message"] == "The engine has made no progress for 7 s"
        engine.stalled, engine.is_running = 0.0, False
        assert client.get("/health").status_code == 503
