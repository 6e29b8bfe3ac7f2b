"""Forced tool calls through the live server, with no help from ``logit_bias``.

The tiny model is random: left to itself it would take every freedom the
grammar leaves (the reason whitespace had to be bounded). Every response that
says "tool_calls" must carry arguments that validate against the function's
schema (``jsonschema``), the budget must not run out first, and a call cut by
``max_tokens`` says "length" with the arguments it had, unclosed.

The schemas bound their strings (``enum``, ``maxLength``) and numbers: an
unbounded string is free text, which a random model never ends. ``｜DSML｜`` is
favoured by ``logit_bias`` only so the random model writes that marker as its
one token (as V4.1 does) instead of spelling it in ten byte tokens: it is
allowed only where the grammar already requires the marker. The budget is
what a request without ``max_tokens`` gets here (DeepSeek's 4,096 capped by
the test server's 1,024-token context), written out because the test server
overrides the default with 8 for its fuzzed requests.
"""

from __future__ import annotations

import json
import math

import jsonschema
import openai
import pytest
from api_helpers import MAX_MODEL_LEN, LiveServer, stream_raw

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Rome", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"type": "string", "enum": ["c", "f"]},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
NOTE_SCHEMA = {
    "type": "object",
    "properties": {
        "text": {"type": "string", "maxLength": 6},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "urgent": {"type": "boolean"},
    },
    "required": ["text", "urgent"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "take_note": NOTE_SCHEMA}
TOOLS = [
    {"type": "function", "function": {"name": name, "parameters": schema}}
    for name, schema in SCHEMAS.items()
]
ASK = [{"role": "user", "content": "Weather in Paris for three days, and note it."}]
NAMED = {"type": "function", "function": {"name": "take_note"}}
SEED_CHOICES = 2  # n per request: choice i is seeded seed + i
DSML_AS_ONE_TOKEN = {"128825": 100}
# The context left after the prompt (about 430 tokens of tool block): what the
# default budget comes to on the test server.
BUDGET = MAX_MODEL_LEN - 600


def valid_calls(message, finish_reason: str) -> list[tuple[str, dict]]:
    assert finish_reason == "tool_calls", message
    assert message.content is None
    calls = []
    for call in message.tool_calls:
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        calls.append((call.function.name, arguments))
    return calls


@pytest.mark.parametrize(
    ("tool_choice", "parallel"),
    [("required", True), ("required", False), (NAMED, True)],
    ids=["required-parallel", "required-single", "named"],
)
def test_forced_calls_are_schema_valid_and_end_by_eos(
    client: openai.OpenAI, tool_choice, parallel: bool
) -> None:
    r = client.chat.completions.create(
        model="deepseek-chat",
        messages=ASK,
        tools=TOOLS,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel,
        temperature=1.0,
        seed=11,
        n=SEED_CHOICES,
        max_tokens=BUDGET,
        logit_bias=DSML_AS_ONE_TOKEN,
    )
    assert r.usage.completion_tokens < SEED_CHOICES * BUDGET
    for choice in r.choices:
        if parallel and tool_choice != NAMED and choice.finish_reason == "length":
            # With parallel calls on, the grammar bounds each call but not how many
            # follow: a random model may keep calling until the budget ends (seed 11,
            # choice 1 made five calls when the tiny model was served packed). Every
            # call before the cut is complete and valid; only the last is open.
            done = choice.message.tool_calls[:-1]
            assert len(done) >= 2, choice.message
            for call in done:
                arguments = json.loads(call.function.arguments)
                jsonschema.validate(arguments, SCHEMAS[call.function.name])
            continue
        calls = valid_calls(choice.message, choice.finish_reason)
        if tool_choice == NAMED:
            assert [name for name, _ in calls] == ["take_note"]  # one call, even with parallel on
        elif not parallel:
            assert len(calls) == 1
        else:
            assert len(calls) >= 1
        ids = [c.id for c in choice.message.tool_calls]
        assert len(set(ids)) == len(ids)


def test_streamed_argument_deltas_join_to_the_same_valid_json(
    live_server: LiveServer, client: openai.OpenAI
) -> None:
    """The same seeded request streamed and not: the same call, deltas joined (several
    calls in one stream: tests/server/chat/test_tool_calls.py)."""
    body = {
        "model": "deepseek-chat",
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 1.0,
        "seed": 5,
        "max_tokens": BUDGET,
        "logit_bias": DSML_AS_ONE_TOKEN,
    }
    whole = client.chat.completions.create(**body)
    expected = valid_calls(whole.choices[0].message, whole.choices[0].finish_reason)
    events, _ = stream_raw(live_server, "/v1/chat/completions", {**body, "stream": True})
    joined: dict[int, dict] = {}
    for event in events:
        for choice in event["choices"]:
            for delta in choice["delta"].get("tool_calls") or []:
                call = joined.setdefault(delta["index"], {"name": None, "arguments": ""})
                if "id" in delta:
                    call["name"] = delta["function"]["name"]
                call["arguments"] += delta["function"]["arguments"]
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["tool_calls"]
    streamed = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(joined.items())]
    assert streamed == expected
    assert len(streamed) == 1
    for name, arguments in streamed:
        jsonschema.validate(arguments, SCHEMAS[name])


def test_a_call_cut_by_max_tokens_says_length_and_keeps_its_text(client: openai.OpenAI) -> None:
    body = {
        "model": "deepseek-chat",
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": NAMED,
        "temperature": 0,
        "logit_bias": DSML_AS_ONE_TOKEN,
    }
    full = client.chat.completions.create(**body, max_tokens=BUDGET)
    (whole,) = full.choices[0].message.tool_calls
    valid_calls(full.choices[0].message, full.choices[0].finish_reason)
    n = full.usage.completion_tokens  # the calls block and EOS
    strict_prefixes = 0  # cuts that fell inside the arguments
    for cut_at in (n - 14,):  # inside the last parameter's value or its tags
        cut = client.chat.completions.create(**body, max_tokens=cut_at)
        choice = cut.choices[0]
        assert choice.finish_reason == "length"
        (call,) = choice.message.tool_calls
        assert call.function.name == "take_note"
        arguments = call.function.arguments
        # What had been generated: a prefix of the whole call, nothing invented.
        assert whole.function.arguments.startswith(arguments), (arguments, whole)
        assert arguments != "{}"
        if arguments and arguments != whole.function.arguments:
            strict_prefixes += 1
            with pytest.raises(json.JSONDecodeError):
                json.loads(arguments)
    assert strict_prefixes >= 1


def test_top_logprobs_under_the_grammar_list_only_producible_tokens(
    client: openai.OpenAI,
) -> None:
    """The forced prefix leaves few tokens allowed: ``top_logprobs`` lists fewer than
    asked rather than masked tokens at -9999, and each list is a distribution's top:
    sorted, its probabilities summing to at most 1, the chosen token's logprob among
    them when it is the best."""
    r = client.chat.completions.create(
        model="deepseek-chat",
        messages=ASK,
        tools=TOOLS,
        tool_choice=NAMED,
        temperature=0,
        max_tokens=12,
        logprobs=True,
        top_logprobs=20,
        logit_bias=DSML_AS_ONE_TOKEN,
    )
    entries = r.choices[0].logprobs.content
    assert len(entries) == 12
    shorter = 0
    for entry in entries:
        values = [t.logprob for t in entry.top_logprobs]
        assert all(-9999 < v <= 0 for v in values), values
        assert values == sorted(values, reverse=True)
        assert sum(math.exp(v) for v in values) <= 1 + 1e-4
        assert entry.logprob == pytest.approx(values[0], abs=1e-4)  # greedy: the best
        shorter += len(values) < 20
    assert shorter > 0  # the grammar allowed fewer than 20 tokens somewhere


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
def test_a_forced_call_cut_before_its_first_call_has_no_content(
    live_server: LiveServer, client: openai.OpenAI, tool_choice
) -> None:
    """The grammar writes ``\\n\\n<｜DSML｜ calls>\\n`` first; a budget that ends in it
    used to leave the held-back start (``"\\n\\n<｜DS"``) as the answer's content. A
    forced answer is never text: content null (none streamed), no call before its
    header is whole, ``length``."""
    body = {
        "model": "deepseek-chat",
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": tool_choice,
        "temperature": 0,
        "logit_bias": DSML_AS_ONE_TOKEN,
    }
    for max_tokens in (1, 2, 3, 4, 5):  # "\n", "\n", "<", "｜DSML｜", " calls"...
        r = client.chat.completions.create(**body, max_tokens=max_tokens)
        choice = r.choices[0]
        assert choice.finish_reason == "length"
        assert choice.message.content is None, (max_tokens, choice.message)
        assert choice.message.tool_calls is None
        events, _ = stream_raw(
            live_server, "/v1/chat/completions", {**body, "max_tokens": max_tokens, "stream": True}
        )
        deltas = [c["delta"] for e in events for c in e["choices"]]
        assert "".join(d.get("content") or "" for d in deltas) == "", deltas
        assert not any(d.get("tool_calls") for d in deltas)
        finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
        assert finishes == ["length"]
