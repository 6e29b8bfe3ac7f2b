"""Which worker of a pool serves a request (the router's choice, server/disagg/router.py).

A conversation's turns should land on the same worker: its device tier still
holds the pages of the earlier turns, so the next turn restores them from HBM
instead of reading them back from the shared SSD tier (and a prefill worker
finds them without recomputing). The router cannot tokenize, so a
conversation is recognised by what stays fixed across its turns: the tenant
(API key and ``user``/``user_id``, the prefix-cache salt's inputs) and the
start of the prompt (the first two chat messages, or the first characters of
a completion prompt). Rendezvous hashing maps that key to a worker, so adding
or losing a worker moves only the conversations that were on it. A worker
that is busier than the least busy by more than ``slack`` requests is passed
over for the least busy one (affinity must not pile a hot session's load on
one worker), and with no key the choice is the least busy, ties in turn.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from typing import Any

from server.disagg.settings import Routing

# Characters of a completion prompt that name its conversation.
PROMPT_HEAD_CHARS = 2048


def session_key(body: bytes, authorization: str | None) -> bytes | None:
    """What stays fixed across a conversation's requests, or None when the body says
    nothing usable (the router then balances by load alone)."""
    try:
        data: Any = json.loads(body)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    messages = data.get("messages")
    if isinstance(messages, list) and messages:
        head: Any = messages[:2]
    elif isinstance(data.get("prompt"), str):
        head = data["prompt"][:PROMPT_HEAD_CHARS]
    else:
        return None
    tenant = [authorization, data.get("user"), data.get("user_id")]
    text = json.dumps([tenant, head], sort_keys=True, ensure_ascii=False)
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


class WorkerPool:
    """Workers of one role with the requests each has in flight."""

    def __init__(self, urls: tuple[str, ...], routing: Routing = "affinity", slack: int = 4):
        self.urls = [u.rstrip("/") for u in urls]
        self.routing = routing
        self.slack = slack
        self.in_flight = dict.fromkeys(self.urls, 0)
        self._turn = itertools.count()

    def order(self, key: bytes | None = None) -> list[str]:
        """Every worker, best first: the session's own worker unless it is ``slack``
        requests busier than the least busy, then the rest by load."""
        turn = next(self._turn)
        n = len(self.urls)
        by_load = sorted(
            (self.urls[(turn + k) % n] for k in range(n)), key=lambda u: self.in_flight[u]
        )
        if key is None or self.routing != "affinity":
            return by_load
        home = max(self.urls, key=lambda u: _score(key, u))
        if self.in_flight[home] > self.in_flight[by_load[0]] + self.slack:
            return by_load
        return [home, *(u for u in by_load if u != home)]

    def acquire(self, url: str) -> None:
        self.in_flight[url] += 1

    def release(self, url: str) -> None:
        self.in_flight[url] -= 1


def _score(key: bytes, url: str) -> int:
    """Rendezvous (highest random weight) score of ``url`` for ``key``."""
    digest = hashlib.blake2b(key + url.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")
