"""Golden tests: the V4.1 chat template against hand-written prompt strings."""

from __future__ import annotations

import pytest

from engine.api.special_tokens import DSML
from engine.loader.checkpoint_writer import write_tiny_tokenizer
from engine.loader.tokenizer import load_tokenizer
from engine.model.deepseek_v41.config import ModelConfig
from server.chat.chat_encoding import (
    ASSISTANT,
    BOS,
    EOS,
    FIM_BEGIN,
    FIM_END,
    FIM_HOLE,
    SYSTEM,
    USER,
    encode_chat,
    encode_completion,
    encode_fim,
    ends_inside_reasoning,
)
from server.http.errors import APIError
from server.openai.protocol import ChatCompletionRequest, reasoning_budget

EFFORT = (
    "Reasoning Effort: {} (range 1-100, the higher the value, the more thorough the reasoning)\n\n"
)


def encode(body: dict, *, thinking: bool, effort: int = 75) -> str:
    request = ChatCompletionRequest.model_validate({"model": "deepseek-flash", **body})
    return encode_chat(
        request.messages,
        tools=request.tools,
        tool_choice=request.tool_choice,
        thinking=thinking,
        reasoning_effort=effort,
        prefix_completion=request.prefix_completion,
        response_format=request.response_format,
    )


def test_special_token_strings() -> None:
    assert BOS == "<｜begin▁of▁sentence｜>"
    assert EOS == "<｜end▁of▁sentence｜>"
    assert SYSTEM == "<｜System｜>"
    assert USER == "<｜User｜>"
    assert ASSISTANT == "<｜Assistant｜>"
    assert DSML == "｜DSML｜"
    assert (FIM_HOLE, FIM_BEGIN, FIM_END) == ("<｜fim▁hole｜>", "<｜fim▁begin｜>", "<｜fim▁end｜>")


def test_plain_chat_thinking_off() -> None:
    prompt = encode({"messages": [{"role": "user", "content": "Hi"}]}, thinking=False)
    assert prompt == "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜></think>"
    assert not ends_inside_reasoning(prompt)


def test_plain_chat_thinking_on() -> None:
    prompt = encode({"messages": [{"role": "user", "content": "Hi"}]}, thinking=True)
    assert prompt == (
        "<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: 75 (range 1-100, the higher the "
        "value, the more thorough the reasoning)\n\n<｜User｜>Hi<｜Assistant｜><think>"
    )
    assert ends_inside_reasoning(prompt)


HISTORY = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Q1"},
    {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
    {"role": "user", "content": "Q2"},
]


def test_system_and_multi_turn_thinking_off_drops_reasoning() -> None:
    assert encode({"messages": HISTORY}, thinking=False) == (
        "<｜begin▁of▁sentence｜><｜System｜>You are terse.<｜User｜>Q1<｜Assistant｜></think>A1"
        "<｜end▁of▁sentence｜><｜User｜>Q2<｜Assistant｜></think>"
    )


def test_system_and_multi_turn_thinking_on_drops_past_reasoning() -> None:
    assert encode({"messages": HISTORY}, thinking=True, effort=50) == (
        "<｜begin▁of▁sentence｜><｜System｜>" + EFFORT.format(50) + "You are terse."
        "<｜User｜>Q1<｜Assistant｜></think>A1<｜end▁of▁sentence｜>"
        "<｜User｜>Q2<｜Assistant｜><think>"
    )


def test_developer_is_system_and_mid_conversation_system() -> None:
    messages = [
        {"role": "developer", "content": "S"},
        {"role": "user", "content": "U1"},
        {"role": "assistant", "content": "A1"},
        {"role": "system", "content": "R"},
        {"role": "user", "content": "U2"},
    ]
    assert encode({"messages": messages}, thinking=False) == (
        "<｜begin▁of▁sentence｜><｜System｜>S<｜User｜>U1<｜Assistant｜></think>A1"
        "<｜end▁of▁sentence｜><｜System｜>R<｜User｜>U2<｜Assistant｜></think>"
    )


def test_trailing_system_and_trailing_assistant_open_a_new_turn() -> None:
    # The reference encoder adds the assistant header after a final system or
    # assistant message (a fresh turn), unless it is a prefix.
    sys_last = [{"role": "user", "content": "U"}, {"role": "system", "content": "S2"}]
    assert encode({"messages": sys_last}, thinking=False) == (
        "<｜begin▁of▁sentence｜><｜User｜>U<｜System｜>S2<｜Assistant｜></think>"
    )
    asst_last = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
    assert encode({"messages": asst_last}, thinking=False) == (
        "<｜begin▁of▁sentence｜><｜User｜>U<｜Assistant｜></think>A<｜end▁of▁sentence｜>"
        "<｜Assistant｜></think>"
    )


def test_content_parts_and_consecutive_users_join_with_a_blank_line() -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "user", "content": "c"},
    ]
    assert encode({"messages": messages}, thinking=False) == (
        "<｜begin▁of▁sentence｜><｜User｜>a\n\nb\n\nc<｜Assistant｜></think>"
    )


@pytest.mark.parametrize(
    ("effort", "budget"),
    [
        (None, 75),
        ("low", 50),
        ("minimal", 50),
        ("medium", 75),
        ("high", 75),
        ("xhigh", 100),
        ("max", 100),
        (1, 1),
        (42, 42),
        (100, 100),
    ],
)
def test_reasoning_effort_variants(effort: str | int | None, budget: int) -> None:
    assert reasoning_budget(effort) == budget
    prompt = encode(
        {"messages": [{"role": "user", "content": "q"}]},
        thinking=True,
        effort=reasoning_budget(effort),
    )
    assert prompt == (
        f"<｜begin▁of▁sentence｜><｜System｜>Reasoning Effort: {budget} (range 1-100, the higher "
        "the value, the more thorough the reasoning)\n\n<｜User｜>q<｜Assistant｜><think>"
    )


def test_effort_outside_range_is_refused() -> None:
    request = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "q"}]}
    )
    with pytest.raises(ValueError):
        encode_chat(request.messages, thinking=True, reasoning_effort=0)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}

TOOLS_BLOCK = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke "
    'tools by writing a "<｜DSML｜ calls>" block like the following:\n\n'
    "<｜DSML｜ calls>\n"
    '<｜DSML｜ invoke name="$TOOL_NAME">\n'
    '<｜DSML｜ parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE'
    "</｜DSML｜ parameter>\n"
    "...\n"
    "</｜DSML｜ invoke>\n"
    '<｜DSML｜ invoke name="$TOOL_NAME2">\n'
    "...\n"
    "</｜DSML｜ invoke>\n"
    "</｜DSML｜ calls>\n\n"
    'String parameters should be specified as is and set `string="true"`. For all other '
    "types (numbers, booleans, arrays, objects), pass the value in JSON format and set "
    '`string="false"`.\n\n'
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete "
    "reasoning inside <think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
    '{"name": "get_weather", "description": "Weather of a city", "parameters": '
    '{"type": "object", "properties": {"city": {"type": "string"}}}}\n\n'
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke "
    "tool calls.\n"
)


def test_tools_block_without_system_message() -> None:
    prompt = encode(
        {"messages": [{"role": "user", "content": "Paris?"}], "tools": [WEATHER]}, thinking=False
    )
    assert prompt == (
        "<｜begin▁of▁sentence｜><｜System｜>\n\n"
        + TOOLS_BLOCK
        + "<｜User｜>Paris?<｜Assistant｜></think>"
    )


def test_tools_block_follows_the_system_text() -> None:
    prompt = encode(
        {
            "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Paris?"}],
            "tools": [WEATHER],
        },
        thinking=True,
    )
    assert prompt == (
        "<｜begin▁of▁sentence｜><｜System｜>"
        + EFFORT.format(75)
        + "S\n\n"
        + TOOLS_BLOCK
        + "<｜User｜>Paris?<｜Assistant｜><think>"
    )


def test_tool_choice_does_not_change_the_prompt() -> None:
    base = {"messages": [{"role": "user", "content": "Paris?"}], "tools": [WEATHER]}
    prompts = {
        encode({**base, "tool_choice": choice}, thinking=False)
        for choice in (
            "none",
            "auto",
            "required",
            {"type": "function", "function": {"name": "get_weather"}},
        )
    }
    assert len(prompts) == 1


def test_tool_call_turn_and_tool_results_thinking_on() -> None:
    # Tools present: every assistant turn keeps its reasoning. Two calls; the
    # results arrive out of order and are folded, in call order, into one user turn.
    messages = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "Two cities.",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                },
                {
                    "id": "c2",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome", "days": 2}'},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
        {"role": "tool", "tool_call_id": "c1", "content": "sun"},
        {
            "role": "assistant",
            "content": "Sun in Paris, rain in Rome.",
            "reasoning_content": "Done.",
        },
        {"role": "user", "content": "Thanks"},
    ]
    prompt = encode({"messages": messages, "tools": [WEATHER]}, thinking=True)
    assert prompt == (
        "<｜begin▁of▁sentence｜><｜System｜>"
        + EFFORT.format(75)
        + "\n\n"
        + TOOLS_BLOCK
        + "<｜User｜>Weather in Paris and Rome?"
        "<｜Assistant｜><think>Two cities.</think>Checking.\n\n"
        "<｜DSML｜ calls>\n"
        '<｜DSML｜ invoke name="get_weather">\n'
        '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n"
        '<｜DSML｜ invoke name="get_weather">\n'
        '<｜DSML｜ parameter name="city" string="true">Rome</｜DSML｜ parameter>\n'
        '<｜DSML｜ parameter name="days" string="false">2</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n"
        "</｜DSML｜ calls><｜end▁of▁sentence｜>"
        "<｜User｜><tool_result>sun</tool_result>\n\n<tool_result>rain</tool_result>"
        "<｜Assistant｜><think>Done.</think>Sun in Paris, rain in Rome.<｜end▁of▁sentence｜>"
        "<｜User｜>Thanks<｜Assistant｜><think>"
    )


def test_tool_call_turn_thinking_off() -> None:
    messages = [
        {"role": "user", "content": "Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "sun"}]},
    ]
    prompt = encode({"messages": messages, "tools": [WEATHER]}, thinking=False)
    assert prompt.endswith(
        "<｜User｜>Paris?<｜Assistant｜></think>\n\n<｜DSML｜ calls>\n"
        '<｜DSML｜ invoke name="get_weather">\n'
        '<｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>\n'
        "</｜DSML｜ invoke>\n</｜DSML｜ calls><｜end▁of▁sentence｜>"
        "<｜User｜><tool_result>sun</tool_result><｜Assistant｜></think>"
    )


def test_missing_reasoning_on_a_tool_call_turn_is_deepseeks_400() -> None:
    call = {"id": "c1", "function": {"name": "get_weather", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sun"},
    ]
    with pytest.raises(APIError) as info:
        encode({"messages": messages, "tools": [WEATHER]}, thinking=True)
    assert info.value.status == 400
    assert info.value.message == (
        "The `reasoning_content` in the thinking mode must be passed back to the API."
    )
    assert info.value.param == "messages[1].reasoning_content"
    # An empty reasoning is passed back; thinking off or no tools need none.
    messages[1]["reasoning_content"] = ""
    encode({"messages": messages, "tools": [WEATHER]}, thinking=True)
    del messages[1]["reasoning_content"]
    encode({"messages": messages, "tools": [WEATHER]}, thinking=False)
    encode({"messages": messages}, thinking=True)


def test_response_format_block() -> None:
    body = {
        "messages": [{"role": "user", "content": "Give JSON"}],
        "response_format": {"type": "json_object"},
    }
    assert encode(body, thinking=False) == (
        "<｜begin▁of▁sentence｜><｜System｜>\n\n## Response Format:\n\nYou MUST strictly adhere "
        'to the following schema to reply:\n{"type": "json_object"}'
        "<｜User｜>Give JSON<｜Assistant｜></think>"
    )
    body["response_format"] = {"type": "text"}
    assert encode(body, thinking=False) == (
        "<｜begin▁of▁sentence｜><｜User｜>Give JSON<｜Assistant｜></think>"
    )


def test_prefix_completion_chat_mode() -> None:
    messages = [
        {"role": "user", "content": "Write quick sort"},
        {"role": "assistant", "content": "```python\n", "prefix": True},
    ]
    assert encode({"messages": messages}, thinking=False) == (
        "<｜begin▁of▁sentence｜><｜User｜>Write quick sort<｜Assistant｜></think>```python\n"
    )


def test_prefix_completion_thinking_mode() -> None:
    head = (
        "<｜begin▁of▁sentence｜><｜System｜>"
        + EFFORT.format(75)
        + "<｜User｜>Q<｜Assistant｜><think>"
    )
    only_reasoning = [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "", "reasoning_content": "Let me", "prefix": True},
    ]
    prompt = encode({"messages": only_reasoning}, thinking=True)
    assert prompt == head + "Let me"
    assert ends_inside_reasoning(prompt)
    with_answer = [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "The answer", "reasoning_content": "R", "prefix": True},
    ]
    prompt = encode({"messages": with_answer}, thinking=True)
    assert prompt == head + "R</think>The answer"
    assert not ends_inside_reasoning(prompt)
    no_reasoning = [
        {"role": "user", "content": "Q"},
        {"role": "assistant", "content": "```", "prefix": True},
    ]
    assert encode({"messages": no_reasoning}, thinking=True) == head + "</think>```"


def test_prefix_completion_needs_a_final_assistant_message() -> None:
    request = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "q"}]}
    )
    with pytest.raises(APIError):
        encode_chat(request.messages, thinking=False, reasoning_effort=75, prefix_completion=True)


def test_fim_and_plain_completion() -> None:
    assert encode_fim("def f(", "    return x\n") == (
        "<｜begin▁of▁sentence｜><｜fim▁begin｜>def f(<｜fim▁hole｜>    return x\n<｜fim▁end｜>"
    )
    assert (
        encode_fim("a", None)
        == "<｜begin▁of▁sentence｜><｜fim▁begin｜>a<｜fim▁hole｜><｜fim▁end｜>"
    )
    assert encode_completion("Once") == "<｜begin▁of▁sentence｜>Once"


def test_special_tokens_are_single_ids_in_the_real_tokenizer() -> None:
    tokenizer = load_tokenizer()
    expected = {
        BOS: 0,
        EOS: 1,
        USER: 128803,
        ASSISTANT: 128804,
        "<think>": 128821,
        "</think>": 128822,
        DSML: 128825,
        FIM_HOLE: 128800,
        FIM_BEGIN: 128801,
        FIM_END: 128802,
    }
    for text, token_id in expected.items():
        assert tokenizer.encode(text, add_special_tokens=False).ids == [token_id], text
    prompt = encode({"messages": [{"role": "user", "content": "Hi"}]}, thinking=False)
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    assert ids[:2] == [0, 128803] and ids[-2:] == [128804, 128822]


def test_system_token_is_a_single_id_in_the_tiny_tokenizer(tmp_path) -> None:
    # The packaged V4 tokenizer lacks <｜System｜>; the tiny checkpoint adds it.
    renamed = write_tiny_tokenizer(tmp_path, ModelConfig.tiny())
    tokenizer = load_tokenizer(tmp_path)
    system_id = renamed[SYSTEM]
    assert tokenizer.encode(SYSTEM, add_special_tokens=False).ids == [system_id]
    prompt = encode({"messages": [{"role": "user", "content": "Hi"}]}, thinking=True)
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids
    assert ids[:2] == [0, system_id] and ids[-1] == 128821
