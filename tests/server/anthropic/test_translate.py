"""A Messages request -> the chat request: each field against a hand-written chat equivalent.

Oracle: the chat request a client of the OpenAI path would send for the same
conversation, written out by hand; both must render the same V4.1 prompt
(``encode_chat``) and the same sampling fields, since one planner serves both.
"""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from server.anthropic.protocol import CountTokensRequest, MessagesRequest
from server.anthropic.translate import TOOL_ERROR_PREFIX, chat_model_name, to_chat_request
from server.chat.chat_encoding import encode_chat
from server.http.errors import APIError
from server.openai.protocol import ChatCompletionRequest

SERVED = "deepseek-flash"
SCHEMA = {
    "type": "object",
    "properties": {"path": {"type": "string"}},
    "required": ["path"],
}


def _prompt(chat: ChatCompletionRequest) -> str:
    thinking = chat.thinking is not None and chat.thinking.type == "enabled"
    return encode_chat(
        chat.messages,
        tools=chat.tools,
        thinking=thinking,
        reasoning_effort=75,
        prefix_completion=chat.prefix_completion,
    )


def _translate(body: dict[str, Any]) -> ChatCompletionRequest:
    return to_chat_request(MessagesRequest.model_validate({"max_tokens": 64, **body}), SERVED)


def _chat(body: dict[str, Any]) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": SERVED, **body})


def test_model_names_map_as_deepseek_maps_claude() -> None:
    assert chat_model_name("claude-opus-4-1", SERVED) == "deepseek-v4-pro"
    assert chat_model_name("claude-sonnet-4-5", SERVED) == SERVED
    assert chat_model_name("claude-3-5-haiku-latest", "my-model") == "my-model"
    assert chat_model_name("deepseek-chat", SERVED) == "deepseek-chat"
    assert chat_model_name("gpt-4o", SERVED) == "gpt-4o"  # the planner's 400, not ours


def test_a_tool_round_trip_renders_as_the_chat_conversation() -> None:
    anthropic = _translate(
        {
            "model": "claude-sonnet-4-5",
            "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "x"}}],
            "tools": [{"name": "read", "description": "Read a file", "input_schema": SCHEMA}],
            "messages": [
                {"role": "user", "content": "Open a.txt"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "Reading."},
                        {
                            "type": "tool_use",
                            "id": "toolu_1",
                            "name": "read",
                            "input": {"path": "a"},
                        },
                        {
                            "type": "tool_use",
                            "id": "toolu_2",
                            "name": "read",
                            "input": {"path": "b"},
                        },
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "hello"},
                        {
                            "type": "tool_result",
                            "tool_use_id": "toolu_2",
                            "content": [{"type": "text", "text": "no such file"}],
                            "is_error": True,
                        },
                        {"type": "text", "text": "Summarise."},
                    ],
                },
            ],
        }
    )
    chat = _chat(
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Open a.txt"},
                {
                    "role": "assistant",
                    "content": "Reading.",
                    "tool_calls": [
                        {
                            "id": "toolu_1",
                            "function": {"name": "read", "arguments": '{"path": "a"}'},
                        },
                        {
                            "id": "toolu_2",
                            "function": {"name": "read", "arguments": '{"path": "b"}'},
                        },
                    ],
                },
                {"role": "tool", "tool_call_id": "toolu_1", "content": "hello"},
                {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: no such file"},
                {"role": "user", "content": "Summarise."},
            ],
            "tools": [
                {"function": {"name": "read", "description": "Read a file", "parameters": SCHEMA}}
            ],
            "thinking": {"type": "disabled"},
        }
    )
    assert TOOL_ERROR_PREFIX == "Error: "
    assert _prompt(anthropic) == _prompt(chat)
    assert "<tool_result>Error: no such file</tool_result>" in _prompt(anthropic)
    assert anthropic.effective_tool_choice == "auto"


def test_thinking_blocks_are_the_reasoning_passed_back() -> None:
    body = {
        "model": "claude-opus-4",
        "thinking": {"type": "enabled", "budget_tokens": 2048},
        "tools": [{"name": "read", "input_schema": SCHEMA}],
        "messages": [
            {"role": "user", "content": "Open a"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "I should read.", "signature": "sig"},
                    {"type": "redacted_thinking", "data": "opaque"},
                    {"type": "tool_use", "id": "t1", "name": "read", "input": {"path": "a"}},
                ],
            },
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]},
        ],
    }
    anthropic = _translate(body)
    assert anthropic.model == "deepseek-v4-pro"
    assert anthropic.thinking is not None and anthropic.thinking.type == "enabled"
    assert anthropic.messages[1].reasoning_content == "I should read."
    chat = _chat(
        {
            "messages": [
                {"role": "user", "content": "Open a"},
                {
                    "role": "assistant",
                    "reasoning_content": "I should read.",
                    "tool_calls": [
                        {"id": "t1", "function": {"name": "read", "arguments": {"path": "a"}}}
                    ],
                },
                {"role": "tool", "tool_call_id": "t1", "content": ""},
            ],
            "tools": [{"function": {"name": "read", "parameters": SCHEMA}}],
            "thinking": {"type": "enabled"},
        }
    )
    assert _prompt(anthropic) == _prompt(chat)
    # Without a thinking field: Anthropic's default, thinking off.
    del body["thinking"]
    off = _translate(body)
    assert off.thinking is not None and off.thinking.type == "disabled"


def test_a_tool_use_turn_without_its_thinking_renders_empty_reasoning() -> None:
    """Claude Code does not pass back a thinking block it was never shown (an empty
    reasoning streams none): the turn renders as the chat path's empty reasoning, where
    the chat path itself refuses a missing ``reasoning_content`` (DeepSeek's rule)."""
    turn = {
        "role": "assistant",
        "content": [{"type": "tool_use", "id": "t1", "name": "read", "input": {"path": "a"}}],
    }
    body = {
        "thinking": {"type": "adaptive"},
        "tools": [{"name": "read", "input_schema": SCHEMA}],
        "messages": [
            {"role": "user", "content": "Open a"},
            turn,
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]},
        ],
    }
    anthropic = _translate({"model": SERVED, **body})
    chat_messages: list[dict[str, Any]] = [
        {"role": "user", "content": "Open a"},
        {
            "role": "assistant",
            "reasoning_content": "",
            "tool_calls": [{"id": "t1", "function": {"name": "read", "arguments": {"path": "a"}}}],
        },
        {"role": "tool", "tool_call_id": "t1", "content": ""},
    ]
    tools = [{"function": {"name": "read", "parameters": SCHEMA}}]
    chat = _chat({"messages": chat_messages, "tools": tools, "thinking": {"type": "enabled"}})
    assert _prompt(anthropic) == _prompt(chat)
    with pytest.raises(APIError, match="must be passed back"):
        del chat_messages[1]["reasoning_content"]
        _prompt(_chat({"messages": chat_messages, "tools": tools, "thinking": {"type": "enabled"}}))
    # Thinking off: no reasoning is invented.
    off = _translate({"model": SERVED, **body, "thinking": {"type": "disabled"}})
    assert off.messages[1].reasoning_content is None


def test_a_system_message_inside_messages_is_a_system_turn_in_place() -> None:
    """Claude Code sends ``role: system`` inside ``messages``: it renders as the chat
    path's system message at the same place."""
    anthropic = _translate(
        {
            "model": SERVED,
            "system": "Be brief.",
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "system", "content": [{"type": "text", "text": "Reminder."}]},
                {"role": "user", "content": "Again"},
            ],
        }
    )
    chat = _chat(
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"},
                {"role": "system", "content": "Reminder."},
                {"role": "user", "content": "Again"},
            ]
        }
    )
    assert _prompt(anthropic) == _prompt(chat)
    assert "cannot hold a 'tool_result' block" in _refusal(
        {
            "messages": [
                {"role": "system", "content": [{"type": "tool_result", "tool_use_id": "t"}]},
                {"role": "user", "content": "x"},
            ]
        }
    )


@pytest.mark.parametrize(
    ("choice", "expected", "parallel"),
    [
        ({"type": "auto"}, "auto", True),
        ({"type": "any"}, "required", True),
        ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
        ({"type": "none"}, "none", True),
        (
            {"type": "tool", "name": "read"},
            {"type": "function", "function": {"name": "read"}},
            True,
        ),
    ],
)
def test_tool_choice(choice: dict, expected: Any, parallel: bool) -> None:
    chat = _translate(
        {
            "model": "claude-x",
            "tools": [{"name": "read", "input_schema": SCHEMA}],
            "tool_choice": choice,
            "messages": [{"role": "user", "content": "go"}],
        }
    )
    got = chat.effective_tool_choice
    assert (got if isinstance(got, str) else got.model_dump()) == expected
    assert chat.parallel_tool_calls is parallel


def test_sampling_fields_and_the_tenant() -> None:
    chat = _translate(
        {
            "model": "claude-x",
            "max_tokens": 77,
            "stop_sequences": ["END", "\n\n"],
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 40,
            "stream": True,
            "metadata": {"user_id": "alice"},
            "service_tier": "auto",  # ignored, as DeepSeek does
            "messages": [{"role": "user", "content": "go"}],
        }
    )
    assert (chat.max_tokens, chat.stop_list, chat.temperature) == (77, ["END", "\n\n"], 0.5)
    assert (chat.top_p, chat.top_k, chat.stream, chat.cache_salt) == (0.9, 40, True, "alice")


def test_a_last_assistant_message_is_a_prefill() -> None:
    chat = _translate(
        {
            "model": "claude-x",
            "messages": [
                {"role": "user", "content": "Count"},
                {"role": "assistant", "content": "1, 2,"},
            ],
        }
    )
    assert chat.prefix_completion
    assert _prompt(chat).endswith("<｜Assistant｜></think>1, 2,")


def test_count_tokens_bodies_need_no_max_tokens() -> None:
    body = CountTokensRequest.model_validate(
        {"model": "claude-x", "messages": [{"role": "user", "content": "Hi"}]}
    )
    chat = to_chat_request(body, SERVED, for_counting=True)
    assert chat.max_tokens is None and _prompt(chat).endswith("Hi<｜Assistant｜></think>")


def _refusal(body: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as info:
        MessagesRequest.model_validate({"model": "claude-x", "max_tokens": 8, **body})
    return str(info.value)


def test_refused_shapes_say_what_is_wrong() -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    nested = {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "document"}]}
    assert "'document' blocks inside a tool_result are not served" in _refusal(
        {"messages": [{"role": "user", "content": [nested]}]}
    )
    assert "cannot hold a 'image' block" in _refusal(
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": [image]}]}
    )
    document = {"type": "document", "source": {}}
    assert "'document' blocks are not served" in _refusal(
        {"messages": [{"role": "user", "content": [document]}]}
    )
    assert "unsupported content block type 'video'" in _refusal(
        {"messages": [{"role": "user", "content": [{"type": "video"}]}]}
    )
    assert "must not be empty" in _refusal({"messages": []})
    assert "cannot hold a 'tool_use' block" in _refusal(
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "tool_use", "id": "a", "name": "b", "input": {}}],
                }
            ]
        }
    )
    assert "server tool 'web_search_20250305'" in _refusal(
        {
            "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            "messages": [{"role": "user", "content": "x"}],
        }
    )
    assert "unknown tool 'nope'" in _refusal(
        {
            "tools": [{"name": "read", "input_schema": SCHEMA}],
            "tool_choice": {"type": "tool", "name": "nope"},
            "messages": [{"role": "user", "content": "x"}],
        }
    )


def test_input_schemas_get_the_tool_schema_check_under_their_own_field() -> None:
    quoted = {"type": "object", "properties": {'a"b': {"type": "string"}}}
    with pytest.raises(APIError) as info:
        MessagesRequest.model_validate(
            {
                "model": "claude-x",
                "max_tokens": 8,
                "tools": [
                    {"name": "ok", "input_schema": SCHEMA},
                    {"name": "bad", "input_schema": quoted},
                ],
                "messages": [{"role": "user", "content": "x"}],
            }
        )
    assert info.value.status == 400 and info.value.param is not None
    assert info.value.param.startswith("tools[1].input_schema")


def test_what_the_chat_request_refuses_is_a_400() -> None:
    with pytest.raises(APIError) as info:
        _translate(
            {
                "model": "claude-x",
                "temperature": 3.0,  # the chat path's range is [0, 2]: a 422 there
                "messages": [{"role": "user", "content": "x"}],
            }
        )
    assert info.value.status == 400 and info.value.param == "temperature"


def test_an_image_in_a_tool_result_is_an_image_part_of_the_tool_message() -> None:
    """A screenshot tool's answer: the tool message holds the text and image parts in
    their order (the chat path gives each image its span there), ``is_error`` still
    prefixes the text, and the prompt is the chat request's with the same parts."""
    png = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}
    call = {"type": "tool_use", "id": "t1", "name": "shot", "input": {}}
    result = {
        "type": "tool_result",
        "tool_use_id": "t1",
        "is_error": True,
        "content": [
            {"type": "text", "text": "partial screen"},
            {"type": "image", "source": png},
            {"type": "text", "text": "end"},
        ],
    }
    anthropic = _translate(
        {
            "model": "claude-x",
            "messages": [
                {"role": "user", "content": "Look"},
                {"role": "assistant", "content": [call]},
                {"role": "user", "content": [result]},
            ],
        }
    )
    url = "data:image/png;base64,iVBORw0KGgo="
    chat = _chat(
        {
            "messages": [
                {"role": "user", "content": "Look"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "t1",
                            "type": "function",
                            "function": {"name": "shot", "arguments": {}},
                        }
                    ],
                },
                {
                    "role": "tool",
                    "tool_call_id": "t1",
                    "content": [
                        {"type": "text", "text": TOOL_ERROR_PREFIX + "partial screen"},
                        {"type": "image_url", "image_url": {"url": url}},
                        {"type": "text", "text": "end"},
                    ],
                },
            ]
        }
    )
    tool = anthropic.messages[-1]
    assert tool.role == "tool" and tool.model_dump(exclude_none=True)["content"] == [
        p.model_dump(exclude_none=True) for p in chat.messages[-1].content
    ]
    assert _prompt(anthropic) == _prompt(chat)
    assert "<tool_result>Error: partial screen\n\n<｜deepseek_image｜>\n\nend</tool_result>" in (
        _prompt(anthropic)
    )
    # Only images: the error prefix stands as its own first part.
    result["content"] = [{"type": "image", "source": png}]
    body = {
        "model": "claude-x",
        "messages": [
            {"role": "user", "content": "Look"},
            {"role": "assistant", "content": [call]},
            {"role": "user", "content": [result]},
        ],
    }
    parts = _translate(body).messages[-1].content
    assert [p.type for p in parts] == ["text", "image_url"] and parts[0].text == "Error:"
