"""Fuzz every operation of the server's own OpenAPI schema: no input may cause a 5xx.

Schemathesis generates requests from the schema the live server publishes
(valid bodies and bodies that break it) and Hypothesis drives them. Budgets are
clamped before sending (output tokens, choices, prompts) so valid requests stay
cheap on a CPU; the property under test, "never a server error", does not
depend on them.

The operations are listed here (pytest needs them at collection, before the
server runs); a test checks the list against the published schema.
"""

from __future__ import annotations

from typing import Any

import pytest
import schemathesis
from api_helpers import API_KEY, LiveServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

OPERATIONS = [
    ("POST", "/v1/chat/completions"),
    ("POST", "/beta/chat/completions"),
    ("POST", "/v1/completions"),
    ("POST", "/beta/completions"),
    ("GET", "/v1/models"),
    ("GET", "/v1/models/{model}"),
    ("POST", "/anthropic/v1/messages"),
    ("POST", "/anthropic/v1/messages/count_tokens"),
    ("GET", "/anthropic/v1/models"),
    ("GET", "/health"),
    ("GET", "/metrics"),
]
MAX_EXAMPLES = 25
# Chat bodies rarely pass the cross-field rules (roles, content), so they fail fast: more of them.
CHAT_EXAMPLES = 80
# Caps applied to generated bodies: field -> largest value sent.
CAPS = {"max_tokens": 3, "max_completion_tokens": 3, "n": 2}
MAX_PROMPTS = 3
MAX_TEXT = 64  # characters of a text, ids of a token prompt


@pytest.fixture(scope="module")
def api_schema(live_server: LiveServer) -> Any:
    # The schema follows the API keys (docs/design/hardening.md): fetched with one.
    return schemathesis.openapi.from_url(
        live_server.base_url + "/openapi.json", headers={"Authorization": f"Bearer {API_KEY}"}
    )


def test_operation_list_matches_the_schema(api_schema: Any) -> None:
    published = {
        (method.upper(), path)
        for path, item in api_schema.raw_schema["paths"].items()
        for method in item
    }
    assert published == set(OPERATIONS)


def _cap(body: Any) -> None:
    """Bound what a valid body would cost: output tokens, choices, prompt sizes."""
    if not isinstance(body, dict):
        return
    # A random model name is a 400 at once; a served one lets the rest of the body go deeper.
    if isinstance(body.get("model"), str):
        body["model"] = "deepseek-chat"
    body.setdefault("max_tokens", CAPS["max_tokens"])  # completions default to 16
    for field, cap in CAPS.items():
        value = body.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[field] = cap
    for field in ("prompt", "suffix"):
        if field in body:
            body[field] = _shorten(body[field])
    for message in body.get("messages") or []:
        if isinstance(message, dict) and isinstance(message.get("content"), str):
            message["content"] = message["content"][:MAX_TEXT]


def _shorten(value: Any) -> Any:
    """A text or token-id prompt cut to MAX_TEXT; a list of prompts cut to MAX_PROMPTS."""
    if isinstance(value, str):
        return value[:MAX_TEXT]
    if isinstance(value, list) and value and isinstance(value[0], str | list):
        return [_shorten(v) for v in value[:MAX_PROMPTS]]
    if isinstance(value, list):
        return value[:MAX_TEXT]
    return value


@pytest.mark.parametrize(("method", "path"), OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_no_server_errors(api_schema: Any, live_server: LiveServer, method: str, path: str) -> None:
    operation = api_schema[path][method]

    # Bodies that fit the schema and bodies that break it.
    cases = st.one_of(
        operation.as_strategy(GenerationMode.POSITIVE),
        operation.as_strategy(GenerationMode.NEGATIVE),
    )

    @given(case=cases)
    @settings(
        max_examples=CHAT_EXAMPLES if path.endswith("chat/completions") else MAX_EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    def check(case: Any) -> None:
        _cap(case.body)
        response = case.call(
            base_url=live_server.base_url,
            headers={"Authorization": f"Bearer {API_KEY}"},
            timeout=60,
        )
        assert response.status_code < 500, (
            f"{case.method} {case.formatted_path} -> {response.status_code}: "
            f"{response.text[:500]}\nbody: {case.body!r}\nserver log:\n{live_server.log_tail()}"
        )
        if response.status_code >= 400 and path.startswith("/anthropic/"):
            body = response.json()  # Anthropic's shape on its paths
            assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
        elif response.status_code >= 400:
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}

    check()
