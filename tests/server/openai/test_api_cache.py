"""Prefix-cache hits through the API, and tenant separation by ``user_id`` and API key.

Oracle: the KV store caches whole pages and leaves at least one prompt token
to compute, so a repeated prompt of ``P`` tokens hits ``(P - 1) // 64`` pages
(docs/design/kvstore.md); a different tenant hits nothing.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from api_helpers import (
    API_KEY,
    ENV_API_KEY,
    PAGE_TOKENS,
    LiveServer,
    served,
)


def _ask(server: LiveServer, system: str, *, api_key: str | None = None, **extra) -> dict:
    body = {
        "model": "deepseek-chat",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}],
        "max_tokens": 2,
        **extra,
    }
    kwargs = {} if api_key is None else {"api_key": api_key}
    r = server.post("/v1/chat/completions", body, **kwargs)
    assert r.status_code == 200, r.text
    return r.json()["usage"]


def test_repeated_long_prompt_hits_and_other_tenants_do_not(live_server: LiveServer) -> None:
    # A fresh text per run: nothing else in the session can have cached it.
    system = uuid.uuid4().hex + " " + "The quick brown fox jumps over the lazy dog. " * 30
    first = _ask(live_server, system, user_id="alice")
    prompt = first["prompt_tokens"]
    assert prompt > 2 * PAGE_TOKENS
    assert first["prompt_cache_hit_tokens"] == 0
    assert first["prompt_cache_miss_tokens"] == prompt

    expected = (prompt - 1) // PAGE_TOKENS * PAGE_TOKENS
    before = live_server.metrics()
    again = _ask(live_server, system, user_id="alice")
    assert again["prompt_cache_hit_tokens"] == expected >= 2 * PAGE_TOKENS
    assert again["prompt_tokens_details"]["cached_tokens"] == expected
    assert again["prompt_cache_miss_tokens"] == prompt - expected
    after = live_server.metrics()
    hits = ("flashserve:prefix_cache_hits_total", (("tier", "device"),))
    assert after[hits] - before[hits] == expected

    # OpenAI's `user` is the same tenant key as DeepSeek's `user_id`.
    assert _ask(live_server, system, user="alice")["prompt_cache_hit_tokens"] == expected
    # Another user, no user, or another API key: a different tenant, no hit.
    assert _ask(live_server, system, user_id="bob")["prompt_cache_hit_tokens"] == 0
    assert _ask(live_server, system)["prompt_cache_hit_tokens"] == 0
    other_key = _ask(live_server, system, api_key=ENV_API_KEY, user_id="alice")
    assert other_key["prompt_cache_hit_tokens"] == 0


@pytest.fixture(scope="module")
def float64_server(
    tiny_cache: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    """The tiny model in float64: restore and cold then agree to rounding, so a greedy
    answer cannot flip on an FP4 code that fp32 noise tips (docs/design/semantics.md)."""
    tmp = tmp_path_factory.mktemp("float64-server")
    args = ["--model", "tiny", "--dtype", "float64", "--api-key", API_KEY]
    args += ["--page-tokens", str(PAGE_TOKENS), "--max-model-len", "4096"]
    with served(tiny_cache, tmp, args) as server:
        yield server


def test_a_cache_hit_never_changes_the_greedy_answer(float64_server: LiveServer) -> None:
    """The same prompt twice at temperature 0: the second restores its prefix and answers
    exactly as the cold first did (under the retired replay rule of
    docs/design/architecture.md §2.1, 3 of 3 prompts differed)."""
    for i in range(3):
        system = f"{uuid.uuid4().hex} rule {i}: " + "Agents re-send long contexts. " * (20 + 7 * i)
        body = {
            "model": "deepseek-chat",
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "Go"}],
            "max_tokens": 8,
            "temperature": 0,
        }
        answers = []
        for _ in range(2):
            r = float64_server.post("/v1/chat/completions", body)
            assert r.status_code == 200, r.text
            answers.append(r.json())
        cold, warm = answers
        assert cold["usage"]["prompt_cache_hit_tokens"] == 0
        assert warm["usage"]["prompt_cache_hit_tokens"] >= 2 * PAGE_TOKENS
        assert warm["choices"][0]["message"] == cold["choices"][0]["message"]
