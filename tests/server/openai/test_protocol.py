"""Request validation (status, field, message), response shapes, model names and errors."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from server.http.errors import (
    APIError,
    authentication_failed,
    from_validation_errors,
    overloaded,
    request_too_large,
    server_error,
    unavailable,
)
from server.openai.model_names import model_ids, resolve_model, thinking_enabled
from server.openai.protocol import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChunkChoice,
    CompletionRequest,
    DeltaFunction,
    DeltaToolCall,
    ErrorResponse,
    FunctionCallOut,
    ModelCard,
    ModelList,
    ResponseMessage,
    ToolCallOut,
    Usage,
    resolve_max_tokens,
)

USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def chat(**body: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "deepseek-flash", "messages": USER, **body}
    )


def chat_error(**body: Any) -> APIError:
    payload = {"model": "deepseek-flash", "messages": USER, **body}
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(payload)
    return from_validation_errors(info.value.errors())


def completion_error(**body: Any) -> APIError:
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate({"model": "deepseek-flash", "prompt": "a", **body})
    return from_validation_errors(info.value.errors())


def test_minimal_request_defaults_and_ignored_extras() -> None:
    r = chat(metadata={"k": "v"}, store=True, service_tier="auto")
    assert (r.n, r.stream, r.logprobs, r.top_logprobs, r.temperature) == (
        1,
        False,
        False,
        None,
        None,
    )
    assert r.effective_tool_choice == "none" and r.max_output_tokens is None
    assert not r.prefix_completion and not r.include_usage and r.stop_list == []
    assert not hasattr(r, "metadata")


def test_developer_is_read_as_system_and_text_parts_join() -> None:
    r = chat(
        messages=[
            {"role": "developer", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
        ]
    )
    assert r.messages[0].role == "system"
    assert r.messages[1].text() == "a\n\nb"


def test_accessors() -> None:
    r = chat(
        stop="END",
        user="u1",
        user_id="tenant",
        stream=True,
        stream_options={"include_usage": True},
        logit_bias={"42": -100, "7": 2.5},
        max_tokens=10,
        max_completion_tokens=20,
        tools=[TOOL],
    )
    assert r.stop_list == ["END"] and r.cache_salt == "tenant" and r.include_usage
    assert r.logit_bias_ids() == {42: -100.0, 7: 2.5}
    assert r.max_output_tokens == 20
    assert r.effective_tool_choice == "auto" and r.tool_names == ["f"]
    assert chat(user="u1").cache_salt == "u1"
    prefix = chat(messages=[*USER, {"role": "assistant", "content": "```", "prefix": True}])
    assert prefix.prefix_completion


@pytest.mark.parametrize(
    ("body", "status", "param", "words"),
    [
        (
            {
                "messages": [
                    {"role": "user", "content": "a"},
                    {
                        "role": "assistant",
                        "content": [{"type": "image_url", "image_url": {"url": "data:x"}}],
                    },
                ]
            },
            400,
            "messages[1]",
            "assistant message cannot hold images",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}
                ]
            },
            400,
            "messages[0].content[0]",
            "images go in 'image_url' parts",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            400,
            "messages[0].content[0]",
            "needs an 'image_url' object",
        ),
        ({"messages": [{"role": "bot", "content": "x"}]}, 400, "messages[0].role", "'system'"),
        ({"messages": []}, 400, "messages", "must not be empty"),
        ({"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content", "valid"),
        ({"messages": [{"role": "user"}]}, 400, "messages[0]", "needs 'content'"),
        ({"messages": [{"role": "tool", "content": "x"}]}, 400, "messages[0]", "tool_call_id"),
        ({"temperature": "hot"}, 400, "temperature", "valid number"),
        ({"temperature": 2.5}, 422, "temperature", "less than or equal to 2"),
        ({"temperature": -0.1}, 422, "temperature", "greater than or equal to 0"),
        ({"top_p": 0}, 422, "top_p", "greater than 0"),
        ({"top_p": 1.1}, 422, "top_p", "less than or equal to 1"),
        ({"top_k": -2}, 422, "top_k", "greater than or equal to -1"),
        ({"min_p": 1.5}, 422, "min_p", "less than or equal to 1"),
        ({"frequency_penalty": -2.5}, 422, "frequency_penalty", "greater than or equal to -2"),
        ({"presence_penalty": 2.1}, 422, "presence_penalty", "less than or equal to 2"),
        ({"repetition_penalty": 0}, 422, "repetition_penalty", "greater than 0"),
        ({"max_tokens": 0}, 422, "max_tokens", "greater than or equal to 1"),
        ({"max_completion_tokens": 0}, 422, "max_completion_tokens", "greater than or equal to 1"),
        ({"n": 0}, 422, "n", "greater than or equal to 1"),
        ({"n": 129}, 422, "n", "less than or equal to 128"),
        ({"stop": [str(i) for i in range(17)]}, 422, "stop", "at most 16"),
        ({"stop": ["a", ""]}, 422, "stop", "must not be empty"),
        ({"logprobs": True, "top_logprobs": 21}, 422, "top_logprobs", "less than or equal to 20"),
        ({"top_logprobs": 2}, 422, "top_logprobs", "top_logprobs requires logprobs"),
        (
            {"stream_options": {"include_usage": True}},
            422,
            "stream_options",
            "only allowed when stream",
        ),
        ({"logit_bias": {"abc": 1}}, 422, "logit_bias", "token ids"),
        ({"logit_bias": {"²": 1}}, 422, "logit_bias", "token ids"),
        # 5,000 digits: past Python's int-string limit (a 500 before).
        ({"logit_bias": {"9" * 5000: 1}}, 422, "logit_bias", "at most 9 digits"),
        ({"seed": 2**64}, 422, "seed", "less than"),
        ({"logit_bias": {"5": 101}}, 422, "logit_bias", "[-100, 100]"),
        ({"tools": [TOOL] * 129}, 422, "tools", "at most 128"),
        ({"tool_choice": "required"}, 422, "tool_choice", "needs tools"),
        (
            {"tool_choice": {"type": "function", "function": {"name": "g"}}, "tools": [TOOL]},
            422,
            "tool_choice",
            "unknown function",
        ),
        ({"tool_choice": "sometimes", "tools": [TOOL]}, 400, "tool_choice", "'none'"),
        ({"tools": [TOOL, TOOL]}, 400, "tools", "unique"),
        (
            {"tools": [{"type": "function", "function": {"name": 'a"b'}}]},
            400,
            "tools[0].function.name",
            "pattern",
        ),
        ({"reasoning_effort": True}, 422, "reasoning_effort", "integer in [1, 100]"),
        ({"reasoning_effort": "7"}, 422, "reasoning_effort", "integer in [1, 100]"),
        ({"reasoning_effort": 0}, 422, "reasoning_effort", "integer in [1, 100]"),
        ({"reasoning_effort": 101}, 422, "reasoning_effort", "integer in [1, 100]"),
        ({"reasoning_effort": "ultra"}, 422, "reasoning_effort", "one of none, minimal, low"),
        ({"thinking": {"type": "maybe"}}, 400, "thinking.type", "'enabled'"),
        ({"response_format": {"type": "xml"}}, 400, "response_format.type", "'text'"),
        (
            {"response_format": {"type": "json_schema"}},
            400,
            "response_format",
            "needs a 'json_schema'",
        ),
        (
            {"messages": [{"role": "assistant", "content": "a", "prefix": True}, *USER]},
            400,
            "messages",
            "only the last message",
        ),
        (
            {"messages": [{"role": "user", "content": "a", "prefix": True}]},
            400,
            "messages[0]",
            "only assistant",
        ),
    ],
)
def test_invalid_chat_requests(body: dict, status: int, param: str | None, words: str) -> None:
    error = chat_error(**body)
    assert error.status == status
    assert error.param == param
    assert words in error.message
    if param:
        assert error.message.startswith(param + ":")
    assert error.body()["error"]["type"] == "invalid_request_error"


def test_past_tool_call_arguments_are_checked_at_their_field() -> None:
    """The JSON a past call's ``arguments`` holds: a problem at its top is the field's,
    one inside it keeps its path after the field's."""
    field = "messages[1].tool_calls[0].function.arguments"

    def error(arguments: str) -> APIError:
        call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
        messages = [*USER, {"role": "assistant", "content": None, "tool_calls": [call]}]
        return chat_error(messages=messages)

    deep = error("[" * 5000)
    assert (deep.status, deep.param) == (400, field)
    assert deep.message == f"{field}: nested more than 64 levels deep"
    surrogate = error('{"k": "\\ud800"}')
    assert surrogate.param == field
    assert surrogate.message.startswith(f"{field}: arguments.k: the text holds a lone UTF-16")
    assert error(json.dumps('"\\ud800"')).message.startswith(f"{field}: the text holds")


@pytest.mark.parametrize(
    "effort", ["none", "minimal", "low", "medium", "high", "xhigh", "max", 1, 100]
)
def test_valid_reasoning_efforts(effort: str | int) -> None:
    assert chat(reasoning_effort=effort).reasoning_effort == effort


def test_completion_prompts() -> None:
    def prompts(prompt: Any) -> list:
        return CompletionRequest.model_validate({"model": "m", "prompt": prompt}).prompts()

    assert prompts("a") == ["a"]
    assert prompts(["a", "b"]) == ["a", "b"]
    assert prompts([1, 2, 3]) == [[1, 2, 3]]
    assert prompts([[1], [2, 3]]) == [[1], [2, 3]]
    r = CompletionRequest.model_validate({"model": "m", "prompt": "x", "suffix": "y", "echo": True})
    assert (r.max_tokens, r.suffix, r.echo, r.logprobs) == (16, "y", True, None)
    assert (
        CompletionRequest.model_validate({"model": "m", "prompt": "x", "best_of": 1}).best_of == 1
    )


@pytest.mark.parametrize(
    ("body", "status", "param", "words"),
    [
        ({"prompt": []}, 400, "prompt", "empty list"),
        ({"prompt": [[1], []]}, 400, "prompt", "must not be empty"),
        ({"prompt": [1, -2]}, 422, "prompt", ">= 0"),
        ({"prompt": 5}, 400, "prompt", "valid"),
        ({"best_of": 2}, 422, "best_of", "best_of"),
        ({"logprobs": 21}, 422, "logprobs", "less than or equal to 20"),
        ({"stream_options": {"include_usage": True}}, 422, "stream_options", "stream"),
    ],
)
def test_invalid_completion_requests(
    body: dict, status: int, param: str | None, words: str
) -> None:
    error = completion_error(**body)
    assert (error.status, error.param) == (status, param)
    assert words in error.message


def test_fastapi_style_errors() -> None:
    # FastAPI prefixes locations with "body"; a body that is not JSON is json_invalid.
    error = from_validation_errors(
        [
            {
                "type": "literal_error",
                "loc": ("body", "messages", 2, "role"),
                "msg": "Input should be 'user'",
            }
        ]
    )
    assert (error.status, error.param) == (400, "messages[2].role")
    assert error.message == "messages[2].role: Input should be 'user'"
    error = from_validation_errors(
        [{"type": "json_invalid", "loc": ("body", 7), "msg": "JSON decode error"}]
    )
    assert error.status == 400 and error.param is None and "JSON" in error.message
    error = from_validation_errors(
        [{"type": "missing", "loc": ("body", "model"), "msg": "Field required"}]
    )
    assert (error.status, error.param, error.message) == (400, "model", "model: field required")


def test_error_bodies_and_statuses() -> None:
    for error, status, kind in [
        (authentication_failed("sk-1234567890abcd"), 401, "authentication_error"),
        (request_too_large(1024), 413, "invalid_request_error"),
        (overloaded(), 429, "rate_limit_error"),
        (server_error(), 500, "server_error"),
        (unavailable(), 503, "service_unavailable_error"),
    ]:
        body = error.body()
        assert error.status == status
        assert body == {
            "error": {"message": error.message, "type": kind, "param": None, "code": kind}
        }
        ErrorResponse.model_validate(body)
    message = authentication_failed("sk-1234567890abcd").message
    assert message == "Authentication Fails, Your api key: ****abcd is invalid"
    assert "****" in authentication_failed(None).message


def test_model_names() -> None:
    for name, thinking in [
        ("deepseek-flash", True),
        ("deepseek-v4-flash", True),
        ("deepseek-v4-pro", True),
        ("deepseek-chat", False),
        ("deepseek-reasoner", True),
    ]:
        route = resolve_model(name)
        assert (route.name, route.served, route.default_thinking) == (
            name,
            "deepseek-flash",
            thinking,
        )
    with pytest.raises(APIError) as info:
        resolve_model("gpt-4o")
    assert info.value.status == 400
    assert info.value.body() == {
        "error": {
            "message": "Model Not Exist",
            "type": "invalid_request_error",
            "param": "model",
            "code": "invalid_request_error",
        }
    }
    assert resolve_model("mine", served_name="mine").served == "mine"
    assert model_ids() == [
        "deepseek-flash",
        "deepseek-v4-flash",
        "deepseek-v4-pro",
        "deepseek-chat",
        "deepseek-reasoner",
    ]


def test_thinking_resolution() -> None:
    flash, chat_alias = resolve_model("deepseek-flash"), resolve_model("deepseek-chat")
    assert thinking_enabled(flash, None, None)
    assert not thinking_enabled(chat_alias, None, None)
    assert thinking_enabled(chat_alias, "enabled", None)
    assert not thinking_enabled(flash, "disabled", "max")
    assert not thinking_enabled(flash, None, "none")
    assert thinking_enabled(flash, None, "low")


def test_usage_always_carries_every_field() -> None:
    usage = Usage.build(
        prompt_tokens=100, completion_tokens=30, cached_tokens=64, reasoning_tokens=12
    )
    assert json.loads(usage.model_dump_json()) == {
        "prompt_tokens": 100,
        "completion_tokens": 30,
        "total_tokens": 130,
        "prompt_cache_hit_tokens": 64,
        "prompt_cache_miss_tokens": 36,
        "prompt_tokens_details": {"cached_tokens": 64},
        "completion_tokens_details": {"reasoning_tokens": 12},
    }


def test_chunk_json_leaves_absent_delta_fields_out() -> None:
    def chunk(delta: ChatDelta, usage: Usage | None = None, finish=None) -> dict:
        choice = ChunkChoice(index=0, delta=delta, finish_reason=finish)
        c = ChatCompletionChunk(
            id="x", created=1, model="deepseek-flash", choices=[choice], usage=usage
        )
        return json.loads(c.model_dump_json())

    first = chunk(ChatDelta(role="assistant", content=""))
    assert first == {
        "id": "x",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "deepseek-flash",
        "system_fingerprint": None,
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
        "usage": None,
    }
    assert chunk(ChatDelta(reasoning_content="hm"))["choices"][0]["delta"] == {
        "reasoning_content": "hm"
    }
    header = DeltaToolCall(
        index=0, id="call_1", type="function", function=DeltaFunction(name="f", arguments="")
    )
    fragment = DeltaToolCall(index=0, function=DeltaFunction(arguments='{"a"'))
    assert chunk(ChatDelta(tool_calls=[header]))["choices"][0]["delta"] == {
        "tool_calls": [
            {
                "index": 0,
                "id": "call_1",
                "type": "function",
                "function": {"name": "f", "arguments": ""},
            }
        ]
    }
    assert chunk(ChatDelta(tool_calls=[fragment]))["choices"][0]["delta"] == {
        "tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]
    }
    last = ChatCompletionChunk(id="x", created=1, model="m", choices=[], usage=Usage.build(1, 2))
    assert json.loads(last.model_dump_json())["choices"] == []


def test_completion_message_shapes() -> None:
    call = ToolCallOut(id="call_1", function=FunctionCallOut(name="f", arguments="{}"))
    message = ResponseMessage(content=None, reasoning_content="r", tool_calls=[call])
    done = ChatCompletion(
        id="c",
        created=2,
        model="deepseek-chat",
        choices=[ChatChoice(index=0, message=message, finish_reason="tool_calls")],
        usage=Usage.build(5, 3),
    )
    body = json.loads(done.model_dump_json())
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {
        "role": "assistant",
        "content": None,
        "reasoning_content": "r",
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
    }
    plain = json.loads(ResponseMessage(content="hi").model_dump_json())
    assert plain == {"role": "assistant", "content": "hi"}
    models = ModelList(
        data=[
            ModelCard(id=i, max_model_len=65536, input_modalities=["text", "image"])
            for i in model_ids()
        ]
    )
    assert json.loads(models.model_dump_json())["data"][0] == {
        "id": "deepseek-flash",
        "object": "model",
        "created": 0,
        "owned_by": "deepseek",
        "max_model_len": 65536,
        "input_modalities": ["text", "image"],
    }
    # Where no engine is known (the split deployment's router) the field is null.
    assert json.loads(ModelCard(id="deepseek-flash").model_dump_json())["max_model_len"] is None


def test_response_schemas_keep_their_fields_for_openapi() -> None:
    schema = ChatCompletionChunk.model_json_schema(mode="serialization")
    delta = schema["$defs"]["ChatDelta"]["properties"]
    assert set(delta) == {"role", "content", "reasoning_content", "tool_calls"}


def test_max_tokens_against_the_context() -> None:
    assert resolve_max_tokens(None, prompt_tokens=100, max_model_len=1000) == 900
    assert resolve_max_tokens(None, prompt_tokens=100, max_model_len=1000, default=64) == 64
    assert resolve_max_tokens(900, prompt_tokens=100, max_model_len=1000) == 900
    # Past the room: clamped to it (the choice then finishes with "length"), not refused.
    assert resolve_max_tokens(901, prompt_tokens=100, max_model_len=1000) == 900
    assert resolve_max_tokens(32000, prompt_tokens=999, max_model_len=1000) == 1
    with pytest.raises(APIError) as info:
        resolve_max_tokens(1, prompt_tokens=1000, max_model_len=1000)
    assert (info.value.status, info.value.param) == (400, "messages")
    assert info.value.message == (
        "This model's maximum context length is 1000 tokens. However, your messages "
        "resulted in 1000 tokens. Please reduce the length of the messages."
    )
    with pytest.raises(APIError) as info:
        resolve_max_tokens(None, prompt_tokens=1000, max_model_len=1000, prompt_param="prompt")
    assert (info.value.status, info.value.param) == (400, "prompt")
    assert "your prompt resulted in 1000 tokens" in info.value.message
