"""A bounded corpus of hostile inputs (docs/design/hardening.md): every leaf of a valid chat,
completions and FIM body replaced by each value of ``NASTY``, plus the inputs that once
broke the server.
No answer may be a 5xx or leave the error shape, and the server must keep serving.

Complements test_schemathesis.py (schema-driven generation) with the values that
broke the server before: lone surrogates, strings for numbers and booleans, deep
nesting, empty-language and unsatisfiable schemas.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Iterator
from typing import Any

import httpx
from api_helpers import API_KEY, LiveServer

HEADERS = {"Authorization": f"Bearer {API_KEY}", "content-type": "application/json"}


def _nested(depth: int) -> Any:
    value: Any = []
    for _ in range(depth):
        value = [value]
    return value


NASTY: list[Any] = [
    "\ud800",
    "a\udfffb",
    "yes",
    "2",
    "",
    -1,
    2**70,
    1e308,
    True,
    None,
    [],
    {},
    {"\ud800": 1},
    _nested(300),
    "[" * 5000,
    {"type": "string", "pattern": "^[^\\s\\S]$"},
    {"anyOf": []},
]

CHAT = {
    "model": "deepseek-chat",
    "messages": [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "u"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "c", "content": "r"},
    ],
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "f",
                "description": "d",
                "parameters": {"type": "object", "properties": {"a": {"type": "string"}}},
            },
        }
    ],
    "response_format": {
        "type": "json_schema",
        "json_schema": {"name": "o", "schema": {"type": "object"}},
    },
    "max_tokens": 2,
    "temperature": 0.5,
    "user": "u",
    "user_id": "id",
    "stream": False,
    "logit_bias": {"5": 1},
    "n": 1,
}
COMPLETION = {
    "model": "deepseek-chat",
    "prompt": ["a", "b"],
    "suffix": "s",
    "max_tokens": 2,
    "echo": False,
    "stream": False,
}


def _chat(**fields: Any) -> dict:
    body: dict = {"model": "deepseek-chat", "messages": [{"role": "user", "content": "hi"}]}
    return {**body, "max_tokens": 3, **fields}


def _tool(parameters: Any) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


def _required_string(name: str, **extra: Any) -> dict:
    return {
        "type": "object",
        "properties": {name: {"type": "string", **extra}},
        "required": [name],
    }


HEAVY_PATTERN = "^(a|b|c|d|e|f|g|h){1,50}(x|y|z){2,40}[0-9]{3,30}$"
FORCED = {"tool_choice": "required", "parallel_tool_calls": False}
# The request bodies of the findings of docs/design/hardening.md's third round: each was
# a stall, a 500, a cut stream or a schema-invalid answer. (The price and flag findings
# are settings, refused at start-up: tests/flashserve/test_serve_cmd.py.)
ONCE_BROKE: list[tuple[str, str, dict]] = [
    (
        "61 heavy patterns (a 14 s stall)",
        "/v1/chat/completions",
        _chat(
            response_format={
                "type": "json_schema",
                "json_schema": {
                    "name": "o",
                    "schema": {
                        "type": "object",
                        "properties": {
                            f"p{i}": {"type": "string", "pattern": HEAVY_PATTERN} for i in range(61)
                        },
                        "required": [f"p{i}" for i in range(61)],
                    },
                },
            }
        ),
    ),
    (
        'a property named a"b',
        "/v1/chat/completions",
        _chat(tools=_tool(_required_string('a"b')), **FORCED),
    ),
    (
        "a property named c>d",
        "/v1/chat/completions",
        _chat(tools=_tool(_required_string("c>d")), **FORCED),
    ),
    (
        "the close tag as an enum value",
        "/v1/chat/completions",
        _chat(tools=_tool(_required_string("q", enum=["</｜DSML｜ parameter>"])), **FORCED),
    ),
    (
        "non-object parameters",
        "/v1/chat/completions",
        _chat(tools=_tool({"type": "string"}), **FORCED),
    ),
    ("a 5,000-digit logit_bias key", "/v1/chat/completions", _chat(logit_bias={"9" * 5000: 1})),
    (
        "a 5,000-digit logit_bias key",
        "/v1/completions",
        {"model": "deepseek-chat", "prompt": "a", "logit_bias": {"9" * 5000: 1}},
    ),
    (
        "a forced call cut by max_tokens",
        "/v1/chat/completions",
        _chat(tools=_tool(_required_string("q")), max_tokens=4, **FORCED),
    ),
    (
        "a streamed forced call cut by max_tokens",
        "/v1/chat/completions",
        _chat(tools=_tool(_required_string("q")), max_tokens=4, stream=True, **FORCED),
    ),
    (
        "streamed chat with prompt_logprobs",
        "/v1/chat/completions",
        _chat(stream=True, prompt_logprobs=1),
    ),
    (
        "a tool_result whose content is a boolean",
        "/anthropic/v1/messages/count_tokens",
        {
            "model": "deepseek-chat",
            "max_tokens": 3,
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "", "content": True}],
                }
            ],
        },
    ),
]


def test_the_bodies_that_once_broke_the_server_are_answered_whole(live_server: LiveServer) -> None:
    """Each is a 200 or a 4xx in the error shape; a stream ends with ``[DONE]``."""
    with httpx.Client(base_url=live_server.base_url, headers=HEADERS, timeout=120) as client:
        for name, route, body in ONCE_BROKE:
            r = client.post(route, content=json.dumps(body))
            assert r.status_code < 500, (name, r.text, live_server.log_tail())
            if r.status_code >= 400 and route.startswith("/anthropic/"):
                assert r.json()["type"] == "error", name  # Anthropic's shape on its paths
            elif r.status_code >= 400:
                error = r.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}, name
            elif body.get("stream"):
                events = [line for line in r.text.splitlines() if line.startswith("data: ")]
                assert events[-1] == "data: [DONE]", (name, events[-3:])
            else:
                assert r.json()["choices"], name
        assert client.get("/health").status_code == 200


def leaves(value: Any, path: tuple = ()) -> Iterator[tuple]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield from leaves(item, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from leaves(item, (*path, i))
    if path:
        yield path


def replaced(body: dict, path: tuple, new: Any) -> dict:
    out = copy.deepcopy(body)
    target = out
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = new
    return out


def corpus() -> Iterator[tuple[str, dict]]:
    for route, base in (
        ("/v1/chat/completions", CHAT),
        ("/v1/completions", COMPLETION),
        ("/beta/completions", COMPLETION),
    ):
        for path in leaves(base):
            for value in NASTY:
                yield route, replaced(base, path, value)


# Bodies sent per run, drawn with a fixed seed from the ~1,000 of the full corpus
# (every run sends the same ones; raise it to fuzz longer).
SAMPLE = 300


def test_hostile_corpus_gets_4xx_or_200_never_5xx(live_server: LiveServer) -> None:
    bodies = list(corpus())
    assert len(bodies) > 1000
    bodies = random.Random(0).sample(bodies, SAMPLE)
    statuses: dict[int, int] = {}
    with httpx.Client(base_url=live_server.base_url, headers=HEADERS, timeout=60) as client:
        for route, body in bodies:
            r = client.post(route, content=json.dumps(body))
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code < 500, (route, body, r.text, live_server.log_tail())
            if r.status_code >= 400:
                error = r.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}
                assert "/project/" not in error["message"] and ".py" not in error["message"]
        assert client.get("/health").status_code == 200
        ok = client.post("/v1/chat/completions", content=json.dumps(CHAT))
        assert ok.status_code == 200, ok.text
    assert statuses.get(400, 0) > SAMPLE // 3  # the corpus does reach the checks
