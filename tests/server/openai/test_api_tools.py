"""Tool calls and JSON output through the live server (grammar-constrained decoding).

With ``tool_choice`` required or named, and with ``response_format``, the
output must parse and validate whatever the (random) model prefers: that is
the constraint under test. Oracles: ``jsonschema`` validation, ``json.loads``,
and the streamed pieces joined against the whole response.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from api_helpers import THINK_END_ID, LiveServer, stream_raw

DSML_ID = 128825  # "｜DSML｜"

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER_SCHEMA},
}
PING = {
    "type": "function",
    "function": {
        "name": "ping",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


def test_named_tool_choice_yields_a_schema_valid_call(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="deepseek-chat",
        messages=ASK,
        tools=[PING, WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=160,
        logit_bias={str(DSML_ID): 100},  # the marker as its one token, as V4.1 writes it
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER_SCHEMA)


def test_required_tool_choice_streams_openai_deltas(live_server: LiveServer) -> None:
    body = {
        "model": "deepseek-chat",
        "messages": ASK,
        "tools": [PING],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_tokens": 100,
        # ｜DSML｜ as one token when allowed: fewer steps than spelling it out.
        "logit_bias": {str(DSML_ID): 100},
    }
    events, _ = stream_raw(live_server, "/v1/chat/completions", {**body, "stream": True})
    deltas = [c["delta"] for e in events for c in e["choices"]]
    calls = [t for d in deltas for t in d.get("tool_calls", [])]
    first, *rest = calls
    # First delta: index, id, type, name and empty arguments; then argument fragments only.
    assert first == {
        "index": 0,
        "id": first["id"],
        "type": "function",
        "function": {"name": "ping", "arguments": ""},
    }
    assert all(
        set(t) == {"index", "function"} and set(t["function"]) == {"arguments"} for t in rest
    )
    assert json.loads("".join(t["function"]["arguments"] for t in calls)) == {}
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["tool_calls"]


def test_tool_choice_none_never_calls(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="deepseek-chat", messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=6
    )
    assert r.choices[0].message.tool_calls is None
    assert r.choices[0].finish_reason in ("stop", "length")


def test_tool_results_round_trip_and_reasoning_rule(live_server: LiveServer) -> None:
    """A past call and its result are accepted; with thinking on, a past call turn
    without ``reasoning_content`` is DeepSeek's 400."""
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    body = {"model": "deepseek-chat", "messages": history, "tools": [WEATHER], "max_tokens": 2}
    assert live_server.post("/v1/chat/completions", body).status_code == 200
    r = live_server.post("/v1/chat/completions", {**body, "model": "deepseek-reasoner"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["message"] == (
        "The `reasoning_content` in the thinking mode must be passed back to the API."
    )
    assert error["param"] == "messages[1].reasoning_content"


@pytest.mark.parametrize("n", [1, 2])
def test_json_schema_output_validates(client: openai.OpenAI, n: int) -> None:
    """n = 2 runs one grammar per choice (two engine requests)."""
    r = client.chat.completions.create(
        model="deepseek-chat",
        messages=[{"role": "user", "content": "Answer in JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA},
        },
        n=n,
        seed=3,
        max_tokens=40,
    )
    assert len(r.choices) == n
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), ANSWER_SCHEMA)


def test_json_object_after_reasoning(client: openai.OpenAI) -> None:
    """Thinking on: free reasoning, then the JSON. A +100 bias ends the reasoning at once;
    the grammar forbids ``</think>`` afterwards, so the bias cannot leak into the JSON."""
    bias = {str(THINK_END_ID): 100}
    r = client.chat.completions.create(
        model="deepseek-reasoner",
        messages=[{"role": "user", "content": "Answer in JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": ANSWER_SCHEMA},
        },
        temperature=0,
        max_tokens=40,
        logit_bias=bias,
    )
    message = r.choices[0].message
    assert message.model_extra["reasoning_content"] == ""
    jsonschema.validate(json.loads(message.content), ANSWER_SCHEMA)
    assert r.usage.completion_tokens_details.reasoning_tokens == 1


def test_json_object_mode_is_an_object_or_cut(client: openai.OpenAI) -> None:
    """``json_object``: any object. A random model may write a long string, so a cut
    (``length``) output is only checked to be a prefix of an object."""
    r = client.chat.completions.create(
        model="deepseek-chat",
        messages=[{"role": "user", "content": "JSON please"}],
        response_format={"type": "json_object"},
        max_tokens=24,
        seed=1,
    )
    choice = r.choices[0]
    text = choice.message.content.lstrip()
    assert text.startswith("{")
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


# ---------------------------------------------------------------- schemas and the DSML format

CLOSE_TAG = "</｜DSML｜ parameter>"
# Names with '>' and '<' are DSML-safe (the header ends at '">'); on a random model the
# enums keep the call short.
ANGLED_SCHEMA = {
    "type": "object",
    "properties": {
        "c>d": {"type": "string", "enum": ["x", "y"]},
        "<b>": {"type": "integer", "minimum": 1, "maximum": 3},
    },
    "required": ["c>d", "<b>"],
    "additionalProperties": False,
}


def _one_tool(parameters: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


def _joined_stream_calls(events: list[dict]) -> list[tuple[str, str]]:
    calls: dict[int, list[str]] = {}
    for event in events:
        for choice in event["choices"]:
            assert not choice["delta"].get("content"), choice
            for delta in choice["delta"].get("tool_calls") or []:
                name, args = calls.setdefault(delta["index"], ["", ""])
                if "id" in delta:
                    name = delta["function"]["name"]
                calls[delta["index"]] = [name, args + delta["function"]["arguments"]]
    return [(name, args) for name, args in (calls[i] for i in sorted(calls))]


def test_angle_brackets_in_property_names_give_schema_valid_calls(
    live_server: LiveServer,
) -> None:
    """The grammar writes such names verbatim; the parser must read them back whole and
    streamed (it used to take the '>' for the end of a malformed header and drop it: the
    call came back ``{}``). Named; ``required`` parses the same block."""
    body = {
        "model": "deepseek-chat",
        "messages": ASK,
        "tools": _one_tool(ANGLED_SCHEMA),
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_tokens": 120,
        "logit_bias": {str(DSML_ID): 100},
    }
    r = live_server.post("/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls", choice
    (call,) = choice["message"]["tool_calls"]
    arguments = json.loads(call["function"]["arguments"])
    jsonschema.validate(arguments, ANGLED_SCHEMA)
    events, _ = stream_raw(live_server, "/v1/chat/completions", {**body, "stream": True})
    streamed = _joined_stream_calls(events)
    assert [(n, json.loads(a)) for n, a in streamed] == [("f", arguments)]
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["tool_calls"]


# (case, parameters, the 400's param)
UNCARRIABLE = [
    (
        "quote in a required name",
        {
            "type": "object",
            "properties": {'a"b': {"type": "string", "enum": ["x"]}},
            "required": ['a"b'],
        },
        'tools[0].function.parameters.properties.a"b',
    ),
    (
        "close tag as an enum value",
        {
            "type": "object",
            "properties": {"q": {"type": "string", "enum": [CLOSE_TAG]}},
            "required": ["q"],
        },
        "tools[0].function.parameters.properties.q.enum[0]",
    ),
    ("string schema", {"type": "string"}, "tools[0].function.parameters"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("parameters", "param"), [c[1:] for c in UNCARRIABLE], ids=[c[0] for c in UNCARRIABLE]
)
def test_schemas_the_call_format_cannot_carry_are_400s_naming_the_property(
    live_server: LiveServer, parameters: dict, param: str, stream: bool
) -> None:
    """These came back as ``tool_calls`` with arguments that broke the schema (``{}``, or
    an empty value and a second call); the format has no escape, so they are refused."""
    for tool_choice in ("required", "auto", "none"):
        body = {
            "model": "deepseek-chat",
            "messages": ASK,
            "tools": _one_tool(parameters),
            "tool_choice": tool_choice,
            "max_tokens": 4,
            "stream": stream,
        }
        r = live_server.post("/v1/chat/completions", body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == error["code"] == "invalid_request_error"
        assert error["param"] == param
        assert error["message"].startswith(param + ": ")
