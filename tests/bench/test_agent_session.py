"""bench/agent_session.py: the Anthropic form of a session, and a three-turn replay against
the real ``flashserve serve --model tiny`` (cache and no-cache runs, OpenAI API).

Oracles: the session's own structure (every tool call answered by a result of the same id,
roles alternating), and the KV store's page rule: a follow-up that extends the previous
prompt hits that prompt's whole pages (64 tokens, the default), a fresh tenant nothing.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from bench.agent_session import DATA, anthropic_messages, load_session, main

PAGE_TOKENS = 64


def test_the_recorded_session_has_ten_turns_and_converts_to_anthropic_blocks() -> None:
    session = load_session(DATA)
    turns = session.turns()
    assert len(turns) >= 10
    system, messages = anthropic_messages(turns[-1])
    assert system == session.messages[0]["content"]
    roles = [m["role"] for m in messages]
    assert roles[0] == "user" and all(a != b for a, b in itertools.pairwise(roles))
    uses = [b["id"] for m in messages for b in m["content"] if b["type"] == "tool_use"]
    results = [
        b["tool_use_id"] for m in messages for b in m["content"] if b["type"] == "tool_result"
    ]
    calls = [c["id"] for m in turns[-1] for c in m.get("tool_calls", [])]
    assert uses == results == calls and len(calls) >= 10


def _tiny_session(path: Path) -> Path:
    call = {"id": "call_1", "type": "function"}
    call["function"] = {"name": "read_file", "arguments": json.dumps({"path": "a.py"})}
    tool = {"type": "function", "function": {"name": "read_file", "description": "Read a file."}}
    tool["function"]["parameters"] = {"type": "object", "properties": {"path": {"type": "string"}}}
    messages = [
        {"role": "system", "content": "You are a coding agent. " * 30},
        {"role": "user", "content": "Fix a.py."},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "def f():\n    return 1\n" * 8},
        {"role": "assistant", "content": "f returns 1."},
        {"role": "user", "content": "Thanks."},
        {"role": "assistant", "content": "You're welcome."},
    ]
    path.write_text(json.dumps({"model": "deepseek-chat", "tools": [tool], "messages": messages}))
    return path


@pytest.mark.timeout(300)
def test_replay_reports_cache_hits_per_turn(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    argv = ["--model", "tiny", "--api", "openai", "--runs", "cache", "no-cache", "--quiet"]
    argv += ["--data", str(_tiny_session(tmp_path / "s.json")), "--output", str(out)]
    argv += ["--max-tokens", "1", "--server-args", "--quantization none --max-model-len 2048"]
    assert main(argv) == 0
    doc = json.loads(out.read_text())["apis"]["openai"]
    cache, fresh = doc["cache"]["turns"], doc["no-cache"]["turns"]
    assert [t["turn"] for t in cache] == [1, 2, 3]
    assert [t["prompt_tokens"] for t in cache] == [t["prompt_tokens"] for t in fresh]
    assert cache[0]["cached_tokens"] == 0 and all(t["cached_tokens"] == 0 for t in fresh)
    for prev, turn in itertools.pairwise(cache):
        assert turn["cached_tokens"] == prev["prompt_tokens"] // PAGE_TOKENS * PAGE_TOKENS > 0
        assert turn["new_tokens"] == turn["prompt_tokens"] - turn["cached_tokens"]
    assert all(t["ttft_ms"] > 0 for t in cache + fresh)
    summary = doc["cache"]["summary"]
    assert summary["hit_share_from_turn_2"]["min"] == min(
        t["cached_tokens"] / t["prompt_tokens"] for t in cache[1:]
    )
