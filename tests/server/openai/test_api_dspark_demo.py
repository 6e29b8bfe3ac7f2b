"""``flashserve serve --model demo --speculative-config`` with the demo's trained DSpark
drafter: a greedy chat reply over HTTP is the text the engine gives without
speculation, and the drafts the server counts were made (and mostly accepted: the
drafter is trained, docs/BENCHMARKS.md)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from api_helpers import API_KEY, served

from engine.api.request import Request
from engine.api.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.loader.builder import build_engine
from server.chat.chat_encoding import encode_chat
from server.openai.protocol import ChatMessage
from training.demo_config import demo_checkpoint_dir

DEMO = demo_checkpoint_dir()
MESSAGES = [{"role": "user", "content": "Who's there?"}]
MAX_TOKENS = 24
SPEC = json.dumps({"method": "dspark", "num_speculative_tokens": 4})

pytestmark = pytest.mark.skipif(
    json.loads((DEMO / "config.json").read_text(encoding="utf-8"))["text_config"].get(
        "num_nextn_predict_layers", 0
    )
    == 0,
    reason="models/demo has no DSpark drafter",
)


def _plain_reply() -> str:
    """The engine's greedy reply without speculation, in process (served defaults)."""
    engine = build_engine(EngineConfig(max_num_seqs=1, kv_cache_bytes=64 << 20), DEMO)
    messages = [ChatMessage(**m) for m in MESSAGES]
    prompt = encode_chat(messages, thinking=False, reasoning_effort=75)
    ids = engine.tokenizer.encode(prompt, add_special_tokens=False).ids
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    engine.add_request(Request("plain", ids, params))
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += [t for c in out.outputs for t in c.token_ids]
    engine.close()
    return engine.tokenizer.decode(tokens)


def test_speculative_demo_reply_is_the_plain_greedy_reply(tmp_path: Path) -> None:
    args = ["--model", "demo", "--api-key", API_KEY, "--max-num-seqs", "2"]
    args += ["--kv-cache-bytes", str(64 << 20), "--speculative-config", SPEC]
    with served(tmp_path / "cache", tmp_path, args) as server:
        body = {"model": "demo", "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0}
        response = server.post("/v1/chat/completions", body)
        assert response.status_code == 200, response.text
        text = response.json()["choices"][0]["message"]["content"]
        metrics = server.metrics()
    assert text == _plain_reply()
    drafts = metrics[("flashserve:spec_decode_num_drafts_total", ())]
    accepted = metrics[("flashserve:spec_decode_num_accepted_tokens_total", ())]
    assert drafts > 0 and accepted > 0
