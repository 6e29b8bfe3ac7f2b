"""Tools through the ``anthropic`` SDK: a forced call valid by construction, streamed,
then the ``tool_result`` round trip.

Oracles: the tool's ``input_schema`` (jsonschema) for the forced call's input,
Anthropic's documented event order for its stream (``check_event_order``, on
the SDK's typed events), and the OpenAI path for the round trip: the same
conversation written as chat messages must make a prompt of the same length
(one template renders both).

One forced call serves every check: the random tiny model spells the DSML markup
out token by token, about 90 output tokens per call.
"""

from __future__ import annotations

import json

import jsonschema
from api_helpers import LiveServer
from messages_helpers import GREEDY, blocks, check_event_order, sdk

NOTE = {
    "type": "object",
    "properties": {"topic": {"type": "string", "enum": ["rain", "sun"]}},
    "required": ["topic"],
    "additionalProperties": False,
}
TOOLS = [
    {"name": "noop", "input_schema": {"type": "object", "properties": {}}},
    {"name": "take_note", "description": "Write a note", "input_schema": NOTE},
]
ASK = {"role": "user", "content": "Note the weather."}


def _chat_tools() -> list[dict]:
    return [
        {
            "type": "function",
            "function": {
                "name": t["name"],
                **({"description": t["description"]} if "description" in t else {}),
                "parameters": t["input_schema"],
            },
        }
        for t in TOOLS
    ]


def test_a_named_forced_call_streamed_then_its_result(live_server: LiveServer) -> None:
    client = sdk(live_server)
    stream = client.messages.create(
        model="claude-sonnet-4-5",
        max_tokens=200,  # about 90 needed
        messages=[ASK],
        tools=TOOLS,
        tool_choice={"type": "tool", "name": "take_note"},
        stream=True,
        extra_body=GREEDY,
    )
    events = [(e.type, e.model_dump(mode="json")) for e in stream]
    check_event_order(events)
    (block,) = blocks(events)
    assert block["type"] == "tool_use" and block["name"] == "take_note"
    assert block["id"].startswith("toolu_") and block["input"] == {}
    deltas = {d["delta"]["type"] for n, d in events if n == "content_block_delta"}
    assert deltas == {"input_json_delta"}
    assert events[-2][1]["delta"]["stop_reason"] == "tool_use"
    arguments = json.loads(block["partial_json"])
    jsonschema.validate(arguments, NOTE)

    history = [
        ASK,
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": block["id"], "name": "take_note", "input": arguments}
            ],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": block["id"], "content": "saved"}],
        },
    ]
    answer = client.messages.create(
        model="claude-sonnet-4-5", max_tokens=2, messages=history, tools=TOOLS
    )
    assert answer.stop_reason in ("max_tokens", "end_turn", "tool_use")
    # The same turn on the chat path: a prompt of the same length.
    chat = live_server.client().chat.completions.create(
        model="deepseek-flash",
        max_tokens=1,
        messages=[
            ASK,
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": block["id"],
                        "type": "function",
                        "function": {"name": "take_note", "arguments": json.dumps(arguments)},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": block["id"], "content": "saved"},
        ],
        tools=_chat_tools(),
        extra_body={"thinking": {"type": "disabled"}},
    )
    usage = answer.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == chat.usage.prompt_tokens
