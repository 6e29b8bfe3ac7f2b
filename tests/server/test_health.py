"""/health follows the engine's heartbeat (docs/design/hardening.md): 503 when requests are
pending and the engine has made no progress for ``health_stall_s``, else 200."""

from __future__ import annotations

from stub_engine import StubEngine, stub_client

from engine.loader.tokenizer import load_tokenizer


def test_health_is_503_once_the_engine_stalls_past_the_limit() -> None:
    engine = StubEngine(load_tokenizer(None))
    with stub_client(engine, health_stall_s=5.0) as client:
        assert client.get("/health").json() == {"status": "ok"}
        engine.stalled = 4.9  # a long step, still within the limit
        assert client.get("/health").status_code == 200
        engine.stalled = 7.0
        r = client.get("/health")
        assert r.status_code == 503
        assert r.json()["error"]["message"] == "The engine has made no progress for 7 s"
        engine.stalled, engine.is_running = 0.0, False
        assert client.get("/health").status_code == 503
