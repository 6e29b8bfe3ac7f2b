"""Worker choice: rendezvous affinity per conversation, spill-over by load, keys by hand."""

from __future__ import annotations

import json
from collections import Counter

from server.disagg.worker_pool import WorkerPool, session_key

URLS = tuple(f"http://w{i}:8000" for i in range(4))


def _key(n: int) -> bytes:
    return session_key(
        json.dumps({"messages": [{"role": "user", "content": f"s{n}"}]}).encode(), None
    )


def test_the_least_busy_worker_goes_first_and_ties_take_turns() -> None:
    pool = WorkerPool(("http://a", "http://b/"))
    assert {pool.order()[0] for _ in range(4)} == {"http://a", "http://b"}
    pool.acquire("http://a")
    assert [pool.order()[0] for _ in range(3)] == ["http://b"] * 3
    pool.release("http://a")
    assert pool.in_flight == {"http://a": 0, "http://b": 0}


def test_a_session_keeps_its_worker_and_sessions_spread() -> None:
    pool = WorkerPool(URLS)
    homes = {n: pool.order(_key(n))[0] for n in range(200)}
    assert all(pool.order(_key(n))[0] == homes[n] for n in range(200))
    spread = Counter(homes.values())
    assert set(spread) == set(URLS) and min(spread.values()) > 200 / 4 / 2
    # Every worker appears once in the order.
    assert sorted(pool.order(_key(0))) == sorted(URLS)


def test_losing_a_worker_moves_only_its_sessions() -> None:
    full, smaller = WorkerPool(URLS), WorkerPool(URLS[:3])
    for n in range(200):
        before, after = full.order(_key(n))[0], smaller.order(_key(n))[0]
        assert before == after or before == URLS[3]


def test_a_busy_home_spills_to_the_least_busy_worker() -> None:
    pool = WorkerPool(URLS, slack=2)
    key = _key(7)
    home = pool.order(key)[0]
    for _ in range(2):
        pool.acquire(home)
    assert pool.order(key)[0] == home  # 2 more than the idle ones: within the slack
    pool.acquire(home)
    assert pool.order(key)[0] != home and pool.in_flight[pool.order(key)[0]] == 0


def test_least_loaded_routing_ignores_sessions() -> None:
    pool = WorkerPool(URLS, routing="least-loaded")
    assert len({pool.order(_key(1))[0] for _ in range(8)}) == 4  # ties take turns


def test_session_key_is_tenant_and_prompt_head() -> None:
    chat = {"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": "y"}]}
    later = {**chat, "messages": [*chat["messages"], {"role": "assistant", "content": "z"}]}
    k = session_key(json.dumps(chat).encode(), "Bearer a")
    assert k == session_key(json.dumps(later).encode(), "Bearer a")  # a later turn
    assert k != session_key(json.dumps(chat).encode(), "Bearer b")  # another tenant
    assert k != session_key(json.dumps({**chat, "user": "u"}).encode(), "Bearer a")
    prompt = {"prompt": "p" * 5000}
    assert session_key(json.dumps(prompt).encode(), None) == session_key(
        json.dumps({"prompt": "p" * 4000}).encode(), None
    )
    for bad in (b"not json", b"[1]", b"{}", b'{"messages": []}', b'{"prompt": [1, 2]}'):
        assert session_key(bad, None) is None
