"""One streamed request over HTTP, timed chunk by chunk (vLLM's benchmark client rules).

- TTFT: from sending the request to the first ``data:`` chunk whose choice carries
  text (chat: ``delta.content`` or ``delta.reasoning_content``/``reasoning``;
  completions: ``text``). A role-only or empty chunk is not a token.
- ITL: the gap between consecutive chunks that carry text.
- E2EL: from sending to the last ``data:`` chunk before ``[DONE]`` (the usage
  chunk when ``include_usage`` is on), as vLLM measures it.
- Output tokens: ``usage.completion_tokens`` of the stream, else the tokenizer's
  count of the text received.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

from bench.serving.workloads import Message, completion_prompt

Endpoint = Literal["chat", "completions"]
PATHS: dict[str, str] = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass(slots=True)
class ClientConfig:
    """What every request of a run sends."""

    base_url: str
    model: str
    endpoint: Endpoint = "chat"
    temperature: float = 0.0
    ignore_eos: bool = False  # vLLM-style extension: generate exactly max_tokens
    thinking: str | None = "disabled"  # DeepSeek's thinking.type; None = leave to the server
    api_key: str | None = None
    timeout_s: float = 600.0


@dataclass(slots=True)
class RequestRecord:
    """Everything measured about one request; times in seconds."""

    session_id: int
    turn: int
    group: int
    prompt_len: int  # client-side tokens of the message contents (no chat template)
    max_tokens: int
    start: float = 0.0  # when it was sent, from the benchmark start
    success: bool = False
    error: str = ""
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0  # E2EL
    text: str = ""
    reasoning: str = ""
    prompt_tokens: int | None = None  # usage.prompt_tokens (chat template included)
    completion_tokens: int | None = None  # usage.completion_tokens
    cache_hit_tokens: int | None = None  # usage.prompt_cache_hit_tokens
    output_tokens: int = 0  # completion_tokens, else counted from the text

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


def request_body(
    cfg: ClientConfig, history: list[Message], max_tokens: int
) -> tuple[str, dict[str, Any]]:
    """The path and JSON body of one streamed request."""
    body: dict[str, Any] = {
        "model": cfg.model,
        "max_tokens": max_tokens,
        "temperature": cfg.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if cfg.endpoint == "chat":
        body["messages"] = history
        if cfg.thinking is not None:
            body["thinking"] = {"type": cfg.thinking}
    else:
        body["prompt"] = completion_prompt(history)
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    return PATHS[cfg.endpoint], body


def chunk_text(chunk: dict[str, Any], endpoint: Endpoint) -> tuple[str, str]:
    """(content, reasoning) carried by the first choice of a stream chunk."""
    choices = chunk.get("choices") or []
    if not choices:
        return "", ""
    choice = choices[0]
    if endpoint == "completions":
        return choice.get("text") or "", ""
    delta = choice.get("delta") or {}
    reasoning = delta.get("reasoning_content") or delta.get("reasoning") or ""
    return delta.get("content") or "", reasoning


def cache_hit_tokens(usage: dict[str, Any]) -> int | None:
    """DeepSeek's ``prompt_cache_hit_tokens``, else OpenAI's ``cached_tokens``."""
    if usage.get("prompt_cache_hit_tokens") is not None:
        return int(usage["prompt_cache_hit_tokens"])
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        return int(details["cached_tokens"])
    return None


class StreamTimer:
    """Folds the ``data:`` payloads of one stream into a record, one call per line."""

    def __init__(self, record: RequestRecord, endpoint: Endpoint, sent: float) -> None:
        self.record = record
        self.endpoint = endpoint
        self.sent = sent
        self.last_text: float | None = None
        self.last_data = sent
        self.done = False

    def feed(self, line: str, now: float) -> None:
        """One line of the SSE stream, received at ``now`` (perf_counter seconds)."""
        if not line.startswith("data:"):
            return  # blank separators, ": ping" comments, event names
        payload = line[5:].strip()
        if payload == "[DONE]":
            self.done = True
            return
        chunk = json.loads(payload)
        if "error" in chunk:
            raise RuntimeError(f"error in stream: {json.dumps(chunk['error'])[:300]}")
        self.last_data = now
        content, reasoning = chunk_text(chunk, self.endpoint)
        rec = self.record
        if content or reasoning:
            if self.last_text is None:
                rec.ttft = now - self.sent
            else:
                rec.itl.append(now - self.last_text)
            self.last_text = now
            rec.text += content
            rec.reasoning += reasoning
        usage = chunk.get("usage")
        if usage:
            rec.prompt_tokens = usage.get("prompt_tokens")
            rec.completion_tokens = usage.get("completion_tokens")
            rec.cache_hit_tokens = cache_hit_tokens(usage)

    def finish(self) -> None:
        """Close the record after the stream ended; raises if it was not a valid stream."""
        if not self.done:
            raise RuntimeError("stream ended without data: [DONE]")
        if self.last_text is None:
            raise RuntimeError("stream carried no text")
        self.record.latency = self.last_data - self.sent


async def stream_request(
    client: httpx.AsyncClient,
    cfg: ClientConfig,
    history: list[Message],
    record: RequestRecord,
    clock_zero: float,
) -> None:
    """Send one request and fill ``record``; failures are recorded, never raised."""
    path, body = request_body(cfg, history, record.max_tokens)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    sent = time.perf_counter()
    record.start = sent - clock_zero
    timer = StreamTimer(record, cfg.endpoint, sent)
    try:
        async with client.stream(
            "POST", cfg.base_url + path, json=body, headers=headers, timeout=cfg.timeout_s
        ) as response:
            if response.status_code != 200:
                detail = (await response.aread()).decode(errors="replace")[:300]
                raise RuntimeError(f"HTTP {response.status_code}: {detail}")
            async for line in response.aiter_lines():
                timer.feed(line, time.perf_counter())
                if timer.done:
                    break
        timer.finish()
        record.success = True
    except (httpx.HTTPError, RuntimeError, ValueError) as exc:
        record.success = False
        record.error = f"{type(exc).__name__}: {exc}"


async def served_model(client: httpx.AsyncClient, base_url: str) -> str:
    """The first model ``/v1/models`` lists (the served name on flashserve)."""
    response = await client.get(base_url + "/v1/models", timeout=30)
    if response.status_code != 200:
        raise RuntimeError(
            f"GET /v1/models answered {response.status_code}: {response.text[:300]} "
            "(name the model with --model)"
        )
    return response.json()["data"][0]["id"]


async def scrape_metrics(client: httpx.AsyncClient, base_url: str) -> str | None:
    """The Prometheus text of ``/metrics``, or None when the server has none."""
    try:
        response = await client.get(base_url + "/metrics", timeout=30)
    except httpx.HTTPError:
        return None
    return response.text if response.status_code == 200 else None
