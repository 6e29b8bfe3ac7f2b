"""A Messages request -> the chat request the OpenAI path plans (one internal request type).

Nothing here samples, renders a prompt or builds a grammar: the Messages API is
a second spelling of a chat request, and ``plan_chat`` (server/chat/chat_plan.py)
plans both, so sampling, tool calls, reasoning and forced-call grammars are one
code path. What each Anthropic field becomes:

- ``system`` (string or text blocks) -> a system message; ``messages`` -> chat
  messages in order: a ``tool_result`` block -> a ``tool`` message (``is_error``
  prefixes its text with ``TOOL_ERROR_PREFIX``: the chat format has no error flag),
  a ``tool_use`` block -> a call of the assistant message, ``thinking`` blocks ->
  its ``reasoning_content``; a last ``assistant`` message is a prefill, which is
  DeepSeek's chat prefix completion;
- ``tools`` -> functions (``input_schema`` is the ``parameters`` schema);
  ``tool_choice`` ``auto`` / ``any`` / ``tool`` / ``none`` -> ``auto`` /
  ``required`` / the named function / ``none``, ``disable_parallel_tool_use`` ->
  ``parallel_tool_calls: false``;
- ``thinking`` -> DeepSeek's thinking mode (absent: off, Anthropic's default);
- ``metadata.user_id`` -> ``user_id`` (the prefix-cache tenant, with the API key);
- ``model``: ``claude-opus*`` -> ``deepseek-v4-pro``, any other ``claude*`` -> the
  served model; other names as the chat path takes them (else its 400).

A value the chat request refuses is reported with the chat path's message; the
field names of the two APIs agree where it matters (``messages``, ``tools``).
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from server.anthropic.protocol import (
    CountTokensRequest,
    ImageBlock,
    MessagesRequest,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from server.anthropic.protocol import Message as AnthropicMessage
from server.http.errors import APIError, from_validation_errors
from server.openai.protocol import ChatCompletionRequest

TOOL_ERROR_PREFIX = "Error: "
OPUS_PREFIX = "claude-opus"
CLAUDE_PREFIX = "claude"
OPUS_MODEL = "deepseek-v4-pro"


def chat_model_name(name: str, served_name: str) -> str:
    """The chat path's name for a Messages ``model`` (DeepSeek's mapping of Claude names)."""
    if name.startswith(OPUS_PREFIX):
        return OPUS_MODEL
    if name.startswith(CLAUDE_PREFIX):
        return served_name
    return name


def to_chat_request(
    body: CountTokensRequest, served_name: str, *, for_counting: bool = False
) -> ChatCompletionRequest:
    """The chat request ``body`` stands for; a 400 ``APIError`` for what it refuses.

    ``for_counting``: a ``count_tokens`` body, which has no ``max_tokens`` and no
    sampling fields (the prompt does not depend on them)."""
    chat: dict[str, Any] = {
        "model": chat_model_name(body.model, served_name),
        "messages": _messages(body),
        "thinking": {"type": "enabled" if body.thinking_on else "disabled"},
    }
    if body.tools:
        chat["tools"] = [
            {
                "type": "function",
                "function": _drop_none(
                    {"name": t.name, "description": t.description, "parameters": t.input_schema}
                ),
            }
            for t in body.tools
        ]
    choice = body.tool_choice
    if choice is not None:
        chat["tool_choice"] = _tool_choice(choice.type, choice.name)
        chat["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    if isinstance(body, MessagesRequest) and not for_counting:
        chat.update(
            _drop_none(
                {
                    "max_tokens": body.max_tokens,
                    "stop": body.stop_sequences,
                    "temperature": body.temperature,
                    "top_p": body.top_p,
                    "top_k": body.top_k,
                    "user_id": body.user_id,
                }
            )
        )
        chat["stream"] = body.stream
    try:
        return ChatCompletionRequest.model_validate(chat)
    except ValidationError as exc:
        error = from_validation_errors(exc.errors())
        raise APIError(400, error.message, param=error.param) from None


def _tool_choice(kind: str, name: str | None) -> Any:
    if kind == "any":
        return "required"
    if kind == "tool":
        return {"type": "function", "function": {"name": name}}
    return kind  # "auto" | "none"


def _messages(body: CountTokensRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    system = body.system_text
    if system is not None:
        out.append({"role": "system", "content": system})
    for i, message in enumerate(body.messages):
        last = i == len(body.messages) - 1
        if message.role == "user":
            out += _user(message)
        elif message.role == "system":
            out.append({"role": "system", "content": _text(message)})
        else:
            out.append(_assistant(message, prefill=last, thinking=body.thinking_on))
    return out


def _user(message: AnthropicMessage) -> list[dict[str, Any]]:
    """Text blocks -> user messages, tool results -> tool messages, in their order
    (the chat template folds them back into one user turn)."""
    if isinstance(message.content, str):
        return [{"role": "user", "content": message.content}]
    out: list[dict[str, Any]] = []
    for block in message.content:
        if isinstance(block, ToolResultBlock):
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": block.tool_use_id,
                    "content": _tool_result_content(block),
                }
            )
        elif isinstance(block, TextBlock | ImageBlock):
            part = _part(block)
            if out and out[-1]["role"] == "user":  # adjacent blocks: one message's parts
                out[-1]["content"].append(part)
            else:
                out.append({"role": "user", "content": [part]})
    if not out:  # every block dropped: still a user turn
        out.append({"role": "user", "content": ""})
    return out


def _part(block: TextBlock | ImageBlock) -> dict[str, Any]:
    """One block as the chat path's content part."""
    if isinstance(block, TextBlock):
        return {"type": "text", "text": block.text}
    return {"type": "image_url", "image_url": {"url": block.url()}}


def _tool_result_content(block: ToolResultBlock) -> str | list[dict[str, Any]]:
    """A tool message's content: its text, or its text and image parts in order when it
    holds an image (the chat path places each image's span where its part is).
    ``is_error`` prefixes the first text (or stands as its own first part)."""
    if not block.has_images():
        text = block.text()
        return TOOL_ERROR_PREFIX + text if block.is_error else text
    assert isinstance(block.content, list)
    parts = [_part(b) for b in block.content]
    if block.is_error:
        if parts[0]["type"] == "text":
            parts[0] = {"type": "text", "text": TOOL_ERROR_PREFIX + parts[0]["text"]}
        else:
            parts.insert(0, {"type": "text", "text": TOOL_ERROR_PREFIX.rstrip()})
    return parts


def _text(message: AnthropicMessage) -> str:
    if isinstance(message.content, str):
        return message.content
    return "".join(b.text for b in message.content if isinstance(b, TextBlock))


def _assistant(message: AnthropicMessage, *, prefill: bool, thinking: bool) -> dict[str, Any]:
    """One assistant message: text, calls and the reasoning of its thinking blocks. The
    last message of a request, an assistant one, is a prefill the model continues.

    With thinking on, a tool-use turn without a thinking block is rendered with empty
    reasoning, not refused as the chat path refuses a missing ``reasoning_content``:
    Anthropic's clients drop thinking blocks they were not shown (an empty reasoning
    streams none) and may drop earlier turns' thinking, which Anthropic's API allows."""
    out: dict[str, Any] = {"role": "assistant"}
    if isinstance(message.content, str):
        out["content"] = message.content
    else:
        texts: list[str] = []
        reasoning: list[str] = []
        calls: list[dict[str, Any]] = []
        for block in message.content:
            if isinstance(block, TextBlock):
                texts.append(block.text)
            elif isinstance(block, ThinkingBlock):
                reasoning.append(block.thinking)
            elif isinstance(block, ToolUseBlock):
                calls.append(
                    {
                        "id": block.id,
                        "type": "function",
                        "function": {"name": block.name, "arguments": block.input},
                    }
                )
            else:
                assert isinstance(block, RedactedThinkingBlock)
        out["content"] = [{"type": "text", "text": t} for t in texts] if texts else None
        if reasoning or (calls and thinking):
            out["reasoning_content"] = "".join(reasoning)
        if calls:
            out["tool_calls"] = calls
    if prefill and not out.get("tool_calls"):
        out["prefix"] = True
    return out


def _drop_none(data: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in data.items() if v is not None}
