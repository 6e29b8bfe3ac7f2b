"""Follow-up turns of an agent conversation hit the prefix cache over the whole shared prefix:
plain, after the previous turn was preempted, and across a restart with ``--kv-dir``.

Oracle, apart from the cache: each request's prompt is rendered by the server's chat
template (``encode_chat``) and tokenised by the served tokenizer here, in the test. The
KV store caches whole pages and leaves at least one token to compute
(docs/design/kvstore.md), so a turn whose prompt ``P`` shares ``c`` leading tokens with
an earlier prompt of the same tenant hits exactly ``min(c, len(P) - 1) // 64`` pages.
Follow-ups ask for one token: a sampled token's KV is written only when the next one is
decoded, so what such a turn leaves cached is its prompt's pages and nothing else (the
preempted turn's 70 generated tokens differ from the history sent after it, so its
pages past the prompt do not match it either).
"""

from __future__ import annotations

import json
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from api_helpers import API_KEY, EOS_ID, PAGE_TOKENS, LiveServer, served, stream_raw
from tokenizers import Tokenizer

from server.chat.chat_encoding import encode_chat
from server.openai.model_names import resolve_model, thinking_enabled
from server.openai.protocol import ChatCompletionRequest, reasoning_budget

SYSTEM = (
    "You are a coding agent working in a Python repository. Read files before editing "
    "them, make the smallest change that fixes the problem, run the tests after every "
    "edit and report what you changed."
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {k: {"type": "string"} for k in params},
                "required": list(params),
            },
        },
    }
    for name, description, params in (
        ("read_file", "Read a file of the repository.", ("path",)),
        ("edit_file", "Replace old text by new text in a file.", ("path", "old", "new")),
        ("run_tests", "Run pytest on a path and return its output.", ("path",)),
    )
]
CALC = "def add(a, b):\n    return a - b\n\n\ndef sub(a, b):\n    return a - b\n"
TEST_OUTPUT = "tests/test_calc.py::test_add FAILED\nE   assert -1 == 3\n1 failed, 1 passed in 0.02s"


def _call(n: int, name: str, **args: str) -> dict[str, Any]:
    return {
        "id": f"call_{n}",
        "type": "function",
        "function": {"name": name, "arguments": json.dumps(args)},
    }


def _step(
    n: int, reasoning: str, call: dict[str, Any] | None, result: str | None, text: str = ""
) -> list[dict[str, Any]]:
    """One agent step: the assistant's message, then its tool result or the user's next word."""
    assistant: dict[str, Any] = {"role": "assistant", "content": text}
    if call is not None:
        assistant["tool_calls"] = [call]
    if reasoning:
        assistant["reasoning_content"] = reasoning
    reply = {"role": "tool", "tool_call_id": call["id"], "content": result} if call else None
    return [assistant, reply or {"role": "user", "content": result}]


def agent_turns(thinking: bool) -> list[list[dict[str, Any]]]:
    """Messages of each turn: the history grows by the assistant's answer and a tool result
    (or a user message); with ``thinking`` every assistant turn carries its reasoning."""
    why = (lambda s: s) if thinking else (lambda s: "")
    history: list[dict[str, Any]] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "tests/test_calc.py fails; fix calc.py."},
    ]
    turns = [list(history)]
    steps = [
        _step(1, why("Read the module first."), _call(1, "read_file", path="calc.py"), CALC),
        _step(
            2,
            why("add subtracts."),
            _call(2, "edit_file", path="calc.py", old="return a - b", new="return a + b"),
            "Edited calc.py: 1 replacement.",
        ),
        _step(3, why("Check it."), _call(3, "run_tests", path="tests"), TEST_OUTPUT),
        _step(4, why("Done."), None, "Also add a docstring to add.", text="Fixed add."),
    ]
    for step in steps:
        history += step
        turns.append(list(history))
    return turns


def prompt_ids(tokenizer: Tokenizer, body: dict[str, Any]) -> list[int]:
    """The prompt the server builds for ``body``: its chat template, the served tokenizer."""
    req = ChatCompletionRequest.model_validate(body)
    thinking = thinking_enabled(
        resolve_model(req.model), req.thinking.type if req.thinking else None, None
    )
    text = encode_chat(
        req.messages,
        tools=req.tools,
        thinking=thinking,
        reasoning_effort=reasoning_budget(req.reasoning_effort),
    )
    return tokenizer.encode(text, add_special_tokens=False).ids


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


@dataclass(slots=True)
class Tenant:
    """One conversation's tenant and the prompts it has sent (what the cache can hold)."""

    tokenizer: Tokenizer
    model: str = "deepseek-chat"
    tools: bool = True
    user: str = field(default_factory=lambda: uuid.uuid4().hex)
    sent: list[list[int]] = field(default_factory=list)

    def body(self, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        body = {"model": self.model, "messages": messages, "user": self.user, **extra}
        return {**body, "tools": TOOLS} if self.tools else body

    def expected_hit(self, ids: list[int]) -> tuple[int, int]:
        """(shared prefix with the longest earlier prompt, tokens the cache must hit)."""
        shared = max((common_prefix(p, ids) for p in self.sent), default=0)
        return shared, min(shared, len(ids) - 1) // PAGE_TOKENS * PAGE_TOKENS

    def ask(self, server: LiveServer, messages: list[dict[str, Any]], *, stream: bool = False):
        """Send one turn (one output token); returns (usage, shared prefix, expected hit)."""
        body = self.body(messages, max_tokens=1, temperature=0)
        ids = prompt_ids(self.tokenizer, body)
        shared, expected = self.expected_hit(ids)
        if stream:
            events, _ = stream_raw(
                server,
                "/v1/chat/completions",
                {**body, "stream": True, "stream_options": {"include_usage": True}},
            )
            usage = events[-1]["usage"]
        else:
            r = server.post("/v1/chat/completions", body)
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
        assert usage["prompt_tokens"] == len(ids)  # the oracle renders the server's prompt
        self.sent.append(ids)
        return usage, shared, expected


def _cached(usage: dict[str, Any]) -> int:
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert usage["prompt_cache_hit_tokens"] == cached
    assert usage["prompt_cache_miss_tokens"] == usage["prompt_tokens"] - cached
    return cached


@pytest.mark.parametrize(
    ("model", "tools"),
    [("deepseek-chat", True), ("deepseek-reasoner", True)],
    ids=["non-thinking", "thinking"],
)
def test_each_follow_up_turn_hits_the_whole_previous_prompt(
    live_server: LiveServer, served_tokenizer: Tokenizer, model: str, tools: bool
) -> None:
    """With tools, both modes re-render the history exactly as the last prompt ended: the
    shared prefix is the whole previous prompt, and the cache hits all of it but its last
    partial page. The last turn streams (agents do): its usage chunk says the same."""
    tenant = Tenant(served_tokenizer, model=model, tools=tools)
    turns = agent_turns(thinking=model == "deepseek-reasoner")
    first, _, _ = tenant.ask(live_server, turns[0])
    assert _cached(first) == 0
    for i, messages in enumerate(turns[1:], start=1):
        previous = len(tenant.sent[-1])
        usage, shared, expected = tenant.ask(live_server, messages, stream=i == len(turns) - 1)
        assert shared == previous, f"turn {i} re-rendered its history"
        assert _cached(usage) == expected == previous // PAGE_TOKENS * PAGE_TOKENS
    assert expected >= 4 * PAGE_TOKENS  # the conversation outgrew a few pages


def test_thinking_without_tools_shares_all_but_the_last_header_token(
    live_server: LiveServer, served_tokenizer: Tokenizer
) -> None:
    """DeepSeek's template drops reasoning from assistant turns before the last user turn
    when the request has no tools. The previous prompt ended in ``<｜Assistant｜><think>``;
    re-rendered, that turn opens with ``</think>`` and shows only its answer. So the
    shared prefix is the previous prompt less its last token, and the hit follows it."""
    tenant = Tenant(served_tokenizer, model="deepseek-reasoner", tools=False)
    long_question = "Explain what a prefix cache is. " * 40
    turns = [
        [{"role": "user", "content": long_question}],
        [
            {"role": "user", "content": long_question},
            {"role": "assistant", "content": "It caches KV pages.", "reasoning_content": "Hm."},
            {"role": "user", "content": "And why pages?"},
        ],
    ]
    tenant.ask(live_server, turns[0])
    usage, shared, expected = tenant.ask(live_server, turns[1])
    previous = len(tenant.sent[0])
    assert shared == previous - 1
    assert _cached(usage) == expected == (previous - 1) // PAGE_TOKENS * PAGE_TOKENS > 0


# ---------------------------------------------------------------- preemption and restart

# The tiny model's global KV is 534 B/token (kvstore.md).
TINY_TOKEN_BYTES = 534


def _pages(tokens: int) -> int:
    return -(-tokens // PAGE_TOKENS)


def _small_pool_args(kv_dir: Path, pool_pages: int) -> list[str]:
    """A device pool of ``pool_pages`` pages (half a page of slack against rounding)."""
    pool_bytes = int((pool_pages + 0.5) * TINY_TOKEN_BYTES * PAGE_TOKENS)
    args = ["--model", "tiny", "--api-key", API_KEY, "--quantization", "none"]
    args += ["--page-tokens", str(PAGE_TOKENS), "--max-model-len", str(pool_pages * PAGE_TOKENS)]
    args += ["--kv-cache-bytes", str(pool_bytes), "--max-num-seqs", "2"]
    return [*args, "--kv-dir", str(kv_dir)]


def _just_past_a_page(tokenizer: Tokenizer, **extra: Any) -> tuple[dict[str, Any], int]:
    """Another tenant's request whose prompt fills a page and a few tokens of the next."""
    for n in range(10, 80):
        body = {"model": "deepseek-chat", "user": "other", **extra}
        body["messages"] = [{"role": "user", "content": "Count sheep. " * n}]
        length = len(prompt_ids(tokenizer, body))
        if length > PAGE_TOKENS and 1 <= length % PAGE_TOKENS <= 8:
            return body, length
    raise AssertionError("no prompt length just past a page boundary")


def _counter(server: LiveServer, name: str, labels: tuple[tuple[str, str], ...] = ()) -> float:
    return server.metrics().get((name, labels), 0.0)


def _long_stream(server: LiveServer, body: dict[str, Any], started: threading.Event) -> None:
    """A request that keeps decoding (EOS banned); sets ``started`` once tokens stream (the
    role chunk comes before the engine has admitted it)."""
    with httpx.stream(
        "POST",
        server.base_url + "/v1/chat/completions",
        json={**body, "stream": True},
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=120,
    ) as response:
        assert response.status_code == 200
        chunks = 0
        for line in response.iter_lines():
            chunks += line.startswith("data: ")
            if chunks >= 3:
                started.set()
    started.set()


def test_follow_ups_hit_after_preemption_and_after_a_restart(
    tiny_cache: Path, tmp_path: Path, served_tokenizer: Tokenizer
) -> None:
    """Turn 1 is preempted mid-answer by another tenant's request; turn 2 still hits
    its whole shared prefix. The server is restarted on the same ``--kv-dir``; turn 3 hits
    its whole shared prefix again, every page from the SSD tier.

    The pool holds exactly both prompts, and the other request's prompt ends just past a
    page boundary, so turn 1 is admitted before that request needs another page; then the
    first of the two to grow by a page preempts turn 1 (admitted second, the scheduler's
    victim), within the 70 tokens it asks for."""
    tenant = Tenant(served_tokenizer)
    turns = agent_turns(thinking=False)
    followed, third = turns[1], turns[2]
    no_eos = {"logit_bias": {str(EOS_ID): -100}, "temperature": 0}
    body1 = tenant.body(turns[0], max_tokens=70, **no_eos)
    ids1 = prompt_ids(served_tokenizer, body1)
    other, other_len = _just_past_a_page(served_tokenizer, max_tokens=70, **no_eos)
    pool = _pages(len(ids1)) + _pages(other_len)
    args = _small_pool_args(tmp_path / "kv", pool)

    with served(tiny_cache, tmp_path, args) as server:
        preempted = _counter(server, "flashserve:preemptions_total")
        started = threading.Event()
        noise = threading.Thread(target=_long_stream, args=(server, other, started))
        noise.start()
        assert started.wait(60)
        r = server.post("/v1/chat/completions", body1)
        noise.join(120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 70
        assert _counter(server, "flashserve:preemptions_total") > preempted, server.log_tail()
        tenant.sent.append(ids1)

        usage, shared, expected = tenant.ask(server, followed)
        assert shared == len(ids1)
        assert _cached(usage) == expected == len(ids1) // PAGE_TOKENS * PAGE_TOKENS

    # The restarted server's pool holds the longer third turn; its page layout (what the
    # SSD tier's files are keyed by) is the same.
    with served(tiny_cache, tmp_path, _small_pool_args(tmp_path / "kv", 2 * pool)) as server:
        ssd = ("flashserve:prefix_cache_hits_total", (("tier", "ssd"),))
        usage, shared, expected = tenant.ask(server, third)
        assert shared == len(tenant.sent[-2])
        assert _cached(usage) == expected == shared // PAGE_TOKENS * PAGE_TOKENS
        assert server.metrics()[ssd] == expected  # a fresh device pool: all from the SSD tier
