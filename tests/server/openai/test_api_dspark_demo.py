"""The API over the demo with ``--speculative-config`` dspark (its trained drafter): a
greedy chat reply over HTTP is the one the API gives without speculation, and the
drafts were made and accepted (the drafter is trained, docs/BENCHMARKS.md). The
committed demo carries its drafter: a demo without one fails here, as it should.

The app runs in process over a real engine (``create_app`` on an ``AsyncEngine``,
requests through the ASGI client): a served subprocess would start torch twice
for the same routes and cost most of this test's time budget.
"""

from __future__ import annotations

import json

from fastapi.testclient import TestClient

from engine.api.async_engine import AsyncEngine
from engine.config import EngineConfig
from server.app import create_app
from server.settings import ServerSettings
from training.demo_config import demo_checkpoint_dir

DEMO = demo_checkpoint_dir()
SPEC = json.dumps({"method": "dspark", "num_speculative_tokens": 4})
BODY = {
    "model": "deepseek-chat",
    "messages": [{"role": "user", "content": "Who's there?"}],
    "max_tokens": 24,
    "temperature": 0,
}


def _reply(speculative_config: str | None) -> tuple[str, int, int]:
    """(reply text, drafts, accepted draft tokens) of one greedy chat over the API."""
    config = EngineConfig(
        max_num_seqs=2, kv_cache_bytes=64 << 20, speculative_config=speculative_config
    )
    engine = AsyncEngine(config, DEMO)
    try:
        with TestClient(create_app(engine, ServerSettings())) as client:
            response = client.post("/v1/chat/completions", json=BODY)
        assert response.status_code == 200, response.text
        counters = engine.engine.stats().counters
        text = response.json()["choices"][0]["message"]["content"]
        return text, counters.spec_drafts, counters.spec_accepted_tokens
    finally:
        engine.shutdown()


def test_speculative_demo_reply_is_the_plain_greedy_reply() -> None:
    plain, plain_drafts, _ = _reply(None)
    fast, drafts, accepted = _reply(SPEC)
    assert fast == plain and len(plain.split()) >= 3
    assert plain_drafts == 0 and drafts > 0 and accepted > 0
