"""An app without a model: what ``create_app`` and ``/health`` read of an ``AsyncEngine``,
for route tests that never generate."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi.testclient import TestClient

from engine.api.model_vision import ModelVision
from engine.loader.tokenizer import load_tokenizer
from server.app import create_app
from server.settings import ServerSettings


@dataclass
class StubEngine:
    tokenizer: object
    vocab_size: int = 129280
    eos_token_id: int = 1
    max_model_len: int = 1024
    is_running: bool = True
    stalled: float = 0.0
    vision: ModelVision | None = None

    def stalled_for(self) -> float:
        return self.stalled


def stub_client(engine: StubEngine | None = None, **settings: object) -> TestClient:
    """A client of ``create_app`` on ``engine`` (a fresh stub with the built-in tokenizer)."""
    engine = engine or StubEngine(load_tokenizer(None))
    return TestClient(create_app(engine, ServerSettings(**settings)))  # type: ignore[arg-type]
