"""Synthetic tool-call conversations for the demo: the JSON and DSML text real clients send.

Agent frameworks send a tool block (JSON schemas, one per line) and expect
the model to answer with a DSML calls block whose non-string parameters are
JSON. The plays hold none of that text, so a tokenizer trained on them spends
about a token per character on it and the model never sees a call. This
module draws function schemas from a fixed bank, arguments that satisfy
them, and renders whole conversations as the server encodes a chat request
with tools (server/chat/chat_encoding.py and server/chat/tool_calls.py; nothing imports
``server``, so the template is restated here and a test holds the two
together), so what the model learns is byte for byte what it is served: a user
request, the assistant's call, and (sometimes) the tool's JSON result and a
reply in verse.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

from training.bpe import ASSISTANT, BOS, DSML, EOS, SYSTEM, THINK_END, THINK_START, USER
from training.chat_data import EFFORT_LINE

CALLS_OPEN, CALLS_CLOSE = f"<{DSML} calls>", f"</{DSML} calls>"
INVOKE_OPEN, INVOKE_CLOSE = f'<{DSML} invoke name="', f"</{DSML} invoke>"
PARAM_OPEN, PARAM_CLOSE = f'<{DSML} parameter name="', f"</{DSML} parameter>"
TOOL_RESULT = "<tool_result>{content}</tool_result>"
# The V4.1 tool block of the system turn (server/chat/tool_calls.py TOOLS_TEMPLATE).
TOOLS_TEMPLATE = f"""## Tools

You have access to a set of tools to help answer the user's question. \
You can invoke tools by writing a "{CALLS_OPEN}" block like the following:

{CALLS_OPEN}
{INVOKE_OPEN}$TOOL_NAME">
{PARAM_OPEN}$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{PARAM_CLOSE}
...
{INVOKE_CLOSE}
{INVOKE_OPEN}$TOOL_NAME2">
...
{INVOKE_CLOSE}
{CALLS_CLOSE}

String parameters should be specified as is and set `string="true"`. \
For all other types (numbers, booleans, arrays, objects), pass the value in JSON format \
and set `string="false"`.

If thinking_mode is enabled (triggered by {THINK_START}), you MUST output your complete \
reasoning inside {THINK_START}...{THINK_END} BEFORE any tool calls or final response.

Otherwise, output directly after {THINK_END} with tool calls or final response.

### Available Tool Schemas

{{schemas}}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""

_CITIES = ["Paris", "London", "Verona", "Venice", "Athens", "Rome", "Vienna", "Padua",
           "Messina", "Elsinore", "Tokyo", "Berlin", "Madrid", "Lisbon", "Boston"]  # fmt: skip
_NAMES = ["Romeo", "Juliet", "Hamlet", "Ophelia", "Portia", "Viola", "Rosalind", "Prospero",
          "Miranda", "Othello", "Desdemona", "Lear", "Cordelia", "Beatrice",
          "Benedick"]  # fmt: skip
_TOPICS = ["weather", "the market", "a sonnet", "the news", "train times", "a recipe",
           "flights", "the exchange rate", "a play", "the calendar"]  # fmt: skip
_WORDS = ["love", "honour", "crown", "storm", "night", "ghost", "sword", "letter", "ring",
          "island", "forest", "garden", "king", "queen", "fool", "music", "dream"]  # fmt: skip
_LANGUAGES = ["French", "German", "Italian", "Spanish", "Latin", "Japanese"]
_CURRENCIES = ["USD", "EUR", "GBP", "JPY", "CHF"]
_SYMBOLS = ["AAPL", "MSFT", "NVDA", "GOOG", "AMZN", "TSLA"]

# Each entry: the OpenAI function object and the user's request, a format string
# over the argument names (arguments not in the string are still generated).
_BANK: list[tuple[dict[str, Any], str]] = [
    (
        {"name": "get_weather", "description": "Get the current weather for a city.",
         "parameters": {"type": "object", "properties": {
             "city": {"type": "string", "description": "City name"},
             "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
             "days": {"type": "integer", "minimum": 1, "maximum": 7}},
             "required": ["city"]}},
        "What is the weather in {city} for the next {days} days?",
    ),
    (
        {"name": "search_web", "description": "Search the web and return the top results.",
         "parameters": {"type": "object", "properties": {
             "query": {"type": "string"},
             "max_results": {"type": "integer", "minimum": 1, "maximum": 20}},
             "required": ["query", "max_results"]}},
        "Search for {query}, please.",
    ),
    (
        {"name": "send_email", "description": "Send an email message.",
         "parameters": {"type": "object", "properties": {
             "to": {"type": "string"}, "subject": {"type": "string"},
             "body": {"type": "string"}, "urgent": {"type": "boolean"}},
             "required": ["to", "subject", "body"]}},
        "Write to {to} about {subject}.",
    ),
    (
        {"name": "get_stock_price", "description": "Look up the latest price of a stock.",
         "parameters": {"type": "object", "properties": {
             "symbol": {"type": "string", "enum": _SYMBOLS}},
             "required": ["symbol"]}},
        "How is {symbol} trading today?",
    ),
    (
        {"name": "create_event", "description": "Add an event to the calendar.",
         "parameters": {"type": "object", "properties": {
             "title": {"type": "string"},
             "date": {"type": "string", "description": "YYYY-MM-DD"},
             "attendees": {"type": "array", "items": {"type": "string"}},
             "duration_minutes": {"type": "integer", "minimum": 15, "maximum": 240}},
             "required": ["title", "date", "attendees"]}},
        "Put {title} in my calendar on {date}.",
    ),
    (
        {"name": "convert_currency", "description": "Convert an amount between currencies.",
         "parameters": {"type": "object", "properties": {
             "amount": {"type": "number"},
             "from": {"type": "string", "enum": _CURRENCIES},
             "to": {"type": "string", "enum": _CURRENCIES}},
             "required": ["amount", "from", "to"]}},
        "How much is {amount} {from} in {to}?",
    ),
    (
        {"name": "translate", "description": "Translate text into another language.",
         "parameters": {"type": "object", "properties": {
             "text": {"type": "string"},
             "target_language": {"type": "string", "enum": _LANGUAGES}},
             "required": ["text", "target_language"]}},
        "Translate '{text}' into {target_language}.",
    ),
    (
        {"name": "set_reminder", "description": "Remind the user after some minutes.",
         "parameters": {"type": "object", "properties": {
             "message": {"type": "string"},
             "minutes": {"type": "integer", "minimum": 1, "maximum": 1440}},
             "required": ["message", "minutes"]}},
        "Remind me to {message} in {minutes} minutes.",
    ),
    (
        {"name": "book_table", "description": "Reserve a table at a restaurant.",
         "parameters": {"type": "object", "properties": {
             "restaurant": {"type": "string"},
             "party_size": {"type": "integer", "minimum": 1, "maximum": 12},
             "time": {"type": "string", "description": "HH:MM"},
             "outdoor": {"type": "boolean"}},
             "required": ["restaurant", "party_size", "time"]}},
        "Book a table for {party_size} at {restaurant} at {time}.",
    ),
    (
        {"name": "find_quote", "description": "Find lines of a play that mention a word.",
         "parameters": {"type": "object", "properties": {
             "word": {"type": "string"},
             "play": {"type": "string"},
             "limit": {"type": "integer", "minimum": 1, "maximum": 10}},
             "required": ["word"]}},
        "Find where {play} speaks of {word}.",
    ),
    (
        {"name": "add_contact", "description": "Save a person to the address book.",
         "parameters": {"type": "object", "properties": {
             "person": {"type": "object", "properties": {
                 "name": {"type": "string"}, "age": {"type": "integer"},
                 "tags": {"type": "array", "items": {"type": "string"}}},
                 "required": ["name"]},
             "notify": {"type": "boolean"}},
             "required": ["person"]}},
        "Add {person} to my contacts.",
    ),
    (
        {"name": "calculate", "description": "Evaluate an arithmetic expression.",
         "parameters": {"type": "object", "properties": {
             "expression": {"type": "string"},
             "precision": {"type": "integer", "minimum": 0, "maximum": 10}},
             "required": ["expression"]}},
        "What is {expression}?",
    ),
]  # fmt: skip


@dataclass(frozen=True, slots=True)
class ToolCallSample:
    functions: list[dict[str, Any]]  # the tools offered (OpenAI function objects)
    name: str  # the function called
    arguments: dict[str, Any]  # valid against that function's parameters
    text: str  # the whole rendered conversation, ending with EOS
    messages: list[dict[str, Any]]  # the same conversation as OpenAI chat messages
    thinking: bool


def functions() -> list[dict[str, Any]]:
    """Every function object of the bank (copies)."""
    return [json.loads(json.dumps(f)) for f, _ in _BANK]


def _string(rng: random.Random, key: str) -> str:
    if key == "city":
        return rng.choice(_CITIES)
    if key in ("to", "restaurant", "name"):
        return rng.choice(_NAMES) + ("" if key != "to" else "@example.com")
    if key == "date":
        return f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    if key == "time":
        return f"{rng.randint(11, 22):02d}:{rng.choice(['00', '15', '30', '45'])}"
    if key == "expression":
        a, b, op = rng.randint(2, 999), rng.randint(2, 99), rng.choice("+-*/")
        return f"{a} {op} {b}"
    if key == "play":
        return rng.choice(["Hamlet", "Macbeth", "Othello", "King Lear", "The Tempest"])
    if key in ("query", "subject", "title"):
        return f"{rng.choice(_TOPICS)} in {rng.choice(_CITIES)}"
    words = rng.sample(_WORDS, rng.randint(1, 4))
    return " ".join(words)


def value_for(schema: dict[str, Any], key: str, rng: random.Random) -> Any:
    """A value of ``schema`` (the subset of JSON Schema the bank uses)."""
    if "enum" in schema:
        return rng.choice(schema["enum"])
    kind = schema["type"]
    if kind == "string":
        return _string(rng, key)
    if kind == "integer":
        return rng.randint(schema.get("minimum", 0), schema.get("maximum", 100))
    if kind == "number":
        return round(rng.uniform(1, 5000), rng.choice([0, 1, 2]))
    if kind == "boolean":
        return rng.random() < 0.5
    if kind == "array":
        return [value_for(schema["items"], key, rng) for _ in range(rng.randint(1, 3))]
    if kind == "object":
        return arguments_for(schema, rng)
    raise ValueError(f"no generator for type {kind!r}")


def arguments_for(schema: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """Every required property and each optional one with probability 1/2, in schema order."""
    required = set(schema.get("required", []))
    return {
        key: value_for(prop, key, rng)
        for key, prop in schema["properties"].items()
        if key in required or rng.random() < 0.5
    }


def _result(name: str, arguments: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """A plausible JSON tool result."""
    result: dict[str, Any] = {"status": "ok", "tool": name}
    if rng.random() < 0.5:
        result["value"] = round(rng.uniform(-50, 500), 2)
    result["items"] = [rng.choice(_WORDS) for _ in range(rng.randint(0, 3))]
    result["echo"] = arguments
    return result


def tool_conversation(rng: random.Random, replies: list[str]) -> ToolCallSample:
    """One conversation: 1-3 tools offered, a request, the call, maybe the result and a reply.

    ``replies`` are texts (speeches) for the assistant's answer after the
    tool's result and for a system prompt. Thinking is on for a third of the
    conversations (empty reasoning, as the plays' chats do).
    """
    offered = rng.sample(range(len(_BANK)), rng.randint(1, 3))
    called = rng.choice(offered)
    function, request = _BANK[called]
    arguments = arguments_for(function["parameters"], rng)
    fields = {k: json.dumps(v) if not isinstance(v, str) else v for k, v in arguments.items()}
    user = request.format_map(_Defaulting(fields))
    thinking = rng.random() < 1 / 3
    call_id = f"call_{rng.randrange(16**8):08x}"
    system = rng.choice(replies) if rng.random() < 0.3 else ""
    result = reply = None
    if rng.random() < 0.4:
        result = _to_json(_result(function["name"], arguments, rng))
        reply = rng.choice(replies)
    offered_functions = [_BANK[i][0] for i in offered]
    schemas = "\n".join(_to_json(f) for f in offered_functions)
    # An assistant turn: empty reasoning closed when thinking, its text, EOS.
    opening = THINK_START if thinking else THINK_END
    closing = THINK_END if thinking else ""
    out = [
        BOS + SYSTEM + (EFFORT_LINE.format(budget=75) if thinking else ""),
        system + "\n\n" + TOOLS_TEMPLATE.format(schemas=schemas),
        USER + user + ASSISTANT + opening,
        closing + "\n\n" + render_call(function["name"], arguments) + EOS,
    ]
    if result is not None:
        out.append(USER + TOOL_RESULT.format(content=result) + ASSISTANT + opening)
        out.append(closing + str(reply) + EOS)
    messages = _messages(system, user, function["name"], arguments, call_id, result, reply)
    if thinking:  # DeepSeek wants past tool-call turns' reasoning passed back
        for m in messages:
            if m["role"] == "assistant":
                m["reasoning_content"] = ""
    return ToolCallSample(
        offered_functions, function["name"], arguments, "".join(out), messages, thinking
    )


def _messages(
    system: str,
    user: str,
    name: str,
    arguments: dict[str, Any],
    call_id: str,
    result: str | None,
    reply: str | None,
) -> list[dict[str, Any]]:
    """The conversation as an OpenAI ``messages`` list (what a client would send)."""
    call = {"id": call_id, "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}  # fmt: skip
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": user})
    messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
    if result is not None:
        messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
        messages.append({"role": "assistant", "content": reply})
    return messages


def _to_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def render_call(name: str, arguments: dict[str, Any]) -> str:
    """One call's DSML calls block: strings raw, every other value as JSON."""
    params = [
        f'{PARAM_OPEN}{key}" string="{"true" if isinstance(v, str) else "false"}">'
        f"{v if isinstance(v, str) else _to_json(v)}{PARAM_CLOSE}"
        for key, v in arguments.items()
    ]
    invoke = f'{INVOKE_OPEN}{name}">\n' + "\n".join(params) + f"\n{INVOKE_CLOSE}"
    return f"{CALLS_OPEN}\n{invoke}\n{CALLS_CLOSE}"


class _Defaulting(dict):
    def __missing__(self, key: str) -> str:
        return key
