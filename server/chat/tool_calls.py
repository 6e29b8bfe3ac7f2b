"""DSML tool calls: the tool block of the prompt, and parsing calls out of the model's text.

V4.1 writes calls after its answer text as (``｜DSML｜`` is token 128825)::

    {content}

    <｜DSML｜ calls>
    <｜DSML｜ invoke name="get_weather">
    <｜DSML｜ parameter name="city" string="true">Paris</｜DSML｜ parameter>
    <｜DSML｜ parameter name="days" string="false">3</｜DSML｜ parameter>
    </｜DSML｜ invoke>
    </｜DSML｜ calls>

String arguments are raw text (``string="true"``); every other value is JSON.
``ToolCallParser`` turns streamed text into content deltas and OpenAI tool-call
deltas; a non-streamed response joins the same deltas (server/chat/chat_output.py),
so streamed and non-streamed responses agree byte for byte.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from engine.api.special_tokens import (
    CALLS_CLOSE,
    CALLS_OPEN,
    DSML,
    INVOKE_CLOSE,
    INVOKE_OPEN,
    PARAM_CLOSE,
    PARAM_OPEN,
    THINK_END,
    THINK_START,
    partial_tag_tail,
)

# The V4.1 tool block, as the model was trained on it (DeepSeek's encoding/encoding.py).
TOOLS_TEMPLATE = """## Tools

You have access to a set of tools to help answer the user's question. \
You can invoke tools by writing a "{calls_open}" block like the following:

{calls_open}
{invoke_open}$TOOL_NAME">
{param_open}$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE{param_close}
...
{invoke_close}
{invoke_open}$TOOL_NAME2">
...
{invoke_close}
{calls_close}

String parameters should be specified as is and set `string="true"`. \
For all other types (numbers, booleans, arrays, objects), pass the value in JSON format \
and set `string="false"`.

If thinking_mode is enabled (triggered by {think_start}), you MUST output your complete \
reasoning inside {think_start}...{think_end} BEFORE any tool calls or final response.

Otherwise, output directly after {think_end} with tool calls or final response.

### Available Tool Schemas

{schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""


def to_json(value: Any) -> str:
    """JSON as the encoder writes it: ``json.dumps`` defaults, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=False)


def render_tools(functions: Iterable[Mapping[str, Any]]) -> str:
    """The ``## Tools`` block listing each function object as one JSON line."""
    return TOOLS_TEMPLATE.format(
        calls_open=CALLS_OPEN,
        calls_close=CALLS_CLOSE,
        invoke_open=INVOKE_OPEN,
        invoke_close=INVOKE_CLOSE,
        param_open=PARAM_OPEN,
        param_close=PARAM_CLOSE,
        think_start=THINK_START,
        think_end=THINK_END,
        schemas="\n".join(to_json(dict(f)) for f in functions),
    )


def arguments_dict(arguments: str | Mapping[str, Any]) -> dict[str, Any]:
    """A past call's arguments as a dict.

    Like the reference encoder: a JSON string is decoded (twice, for clients that
    double-encode); anything that is not an object becomes ``{"arguments": raw}``.
    """
    value: Any = arguments
    for _ in range(2):
        if not isinstance(value, str):
            break
        try:
            value = json.loads(value)
        except ValueError:
            break
    if isinstance(value, Mapping):
        return dict(value)
    return {"arguments": arguments}


def render_invoke(name: str, arguments: str | Mapping[str, Any]) -> str:
    params = [
        f'{PARAM_OPEN}{key}" string="{"true" if isinstance(v, str) else "false"}">'
        f"{v if isinstance(v, str) else to_json(v)}{PARAM_CLOSE}"
        for key, v in arguments_dict(arguments).items()
    ]
    return f'{INVOKE_OPEN}{name}">\n' + "\n".join(params) + f"\n{INVOKE_CLOSE}"


def render_tool_calls(calls: Iterable[tuple[str, str | Mapping[str, Any]]]) -> str:
    """The calls block for ``(name, arguments)`` pairs (no leading blank line)."""
    invokes = "\n".join(render_invoke(name, args) for name, args in calls)
    return f"{CALLS_OPEN}\n{invokes}\n{CALLS_CLOSE}"


# ---------------------------------------------------------------- parsing


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(slots=True)
class ToolCallDelta:
    """An OpenAI streamed tool-call piece: the header (id and name) or an argument fragment."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass(slots=True)
class ParsedToolCall:
    id: str
    name: str
    arguments: str  # a JSON object, as OpenAI's ``function.arguments``


@dataclass(slots=True)
class ParseDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class _State(Enum):
    CONTENT = "content"  # plain answer text
    CALLS = "calls"  # inside a calls block, between invokes
    INVOKE = "invoke"  # inside an invoke, between parameters
    PARAM = "param"  # inside a parameter's value


_PARAM_HEADER = re.compile(re.escape(PARAM_OPEN) + r'([^"]*)"(?: string="(true|false)")?>')


def _json_value(raw: str) -> str:
    """A non-string parameter as JSON; text that is not JSON is kept as a string."""
    try:
        return to_json(json.loads(raw))
    except ValueError:
        return to_json(raw)


class ToolCallParser:
    """Incremental DSML parser: ``feed`` text deltas, then ``finish`` once.

    Content text never includes a partial ``<｜DSML｜ calls>``. Whitespace next to
    a calls block separates it from the answer and is dropped. Arguments are
    streamed as JSON fragments whose concatenation is the final arguments
    string: string values character by character, other values once their
    parameter closes. At ``finish`` an unclosed call (output cut by
    ``max_tokens``) keeps the arguments generated so far, a pending non-string
    value as its raw text, without a trailing partial close tag: nothing is
    invented to close it, so a cut call never
    passes for a complete one (``complete`` is False and the finish reason says
    "length").
    """

    def __init__(
        self, id_factory: Callable[[], str] = new_call_id, *, forced: bool = False
    ) -> None:
        """``forced``: a grammar makes the whole output one calls block (``tool_choice``
        required or named), so no text of it is ever content."""
        self._new_id = id_factory
        self._forced = forced
        self._state = _State.CONTENT
        self._buf = ""
        self._skip_ws = False  # drop whitespace right after a calls block
        self._calls: list[ParsedToolCall] = []
        self._args: list[str] = []  # arguments so far, per call
        self._has_param = False  # the open invoke has a parameter already
        self._param_is_string = False
        self._raw_value = ""  # a non-string value waiting for its close tag
        self._in_json_string = False  # the non-string value's text is inside a JSON string
        self._json_escape = False  # ... right after a backslash there
        self._block_closed = False  # a calls block has been closed

    @property
    def tool_calls(self) -> list[ParsedToolCall]:
        return [
            ParsedToolCall(c.id, c.name, a) for c, a in zip(self._calls, self._args, strict=True)
        ]

    @property
    def has_calls(self) -> bool:
        return bool(self._calls)

    @property
    def complete(self) -> bool:
        """Calls were made and their block closed: every call is whole."""
        return bool(self._calls) and self._block_closed and self._state is _State.CONTENT

    def feed(self, text: str) -> ParseDelta:
        self._buf += text
        out = ParseDelta()
        while self._step(out):
            pass
        return out

    def finish(self) -> ParseDelta:
        out = ParseDelta()
        if self._state is _State.CONTENT:
            if not self._held_back_markup(self._buf):
                out.content = self._take_content(self._buf)
        elif self._state is _State.PARAM and not self._param_is_string:
            # Cut inside a non-string value: its text so far, unparsed. The held-back
            # tail (a possible start of the close tag) is dropped here as in a string
            # value, so the streamed fragments join to these arguments.
            self._emit(out, self._raw_value.strip())
        self._buf = ""
        return out

    def _held_back_markup(self, tail: str) -> bool:
        """Whether the text held back at the end (the start of a calls block cut by
        ``max_tokens``, with the blank lines before it) is markup, never content: always
        under a forced call, whose output is the block from its first character (the
        tail is then ``"\n\n<"``, say); otherwise once it holds the ``｜DSML｜`` marker,
        which no answer text needs. A bare ``"<"`` or blank stays content: the model
        may have written it as text."""
        return bool(tail) and (self._forced or DSML in tail)

    # -- one transition per call; False when more text is needed

    def _step(self, out: ParseDelta) -> bool:
        if self._state is _State.CONTENT:
            return self._step_content(out)
        if self._state is _State.CALLS:
            return self._step_calls(out)
        if self._state is _State.INVOKE:
            return self._step_invoke(out)
        return self._step_param(out)

    def _take_content(self, text: str) -> str:
        if self._skip_ws:
            text = text.lstrip()
            self._skip_ws = not text
        return text

    def _step_content(self, out: ParseDelta) -> bool:
        buf = self._buf
        at = buf.find(CALLS_OPEN)
        if at >= 0:
            out.content += self._take_content(buf[:at].rstrip())
            self._buf = buf[at + len(CALLS_OPEN) :]
            self._state = _State.CALLS
            return True
        # Hold back a possible start of the block and the whitespace before it.
        safe = buf[: len(buf) - partial_tag_tail(buf, [CALLS_OPEN])].rstrip()
        out.content += self._take_content(safe)
        self._buf = buf[len(safe) :]
        return False

    def _step_calls(self, out: ParseDelta) -> bool:
        buf = self._buf
        invoke, close = buf.find(INVOKE_OPEN), buf.find(CALLS_CLOSE)
        if close >= 0 and (invoke < 0 or close < invoke):
            self._buf = buf[close + len(CALLS_CLOSE) :]
            self._state = _State.CONTENT
            self._skip_ws = True
            self._block_closed = True
            return True
        if invoke >= 0:
            end = buf.find('">', invoke + len(INVOKE_OPEN))
            if end < 0:
                self._buf = buf[invoke:]
                return False
            name = buf[invoke + len(INVOKE_OPEN) : end]
            self._buf = buf[end + 2 :]
            call = ParsedToolCall(self._new_id(), name, "")
            self._calls.append(call)
            self._args.append("")
            out.tool_calls.append(ToolCallDelta(len(self._calls) - 1, call.id, name, ""))
            self._state = _State.INVOKE
            self._has_param = False
            return True
        # Text between invokes is not part of any call.
        self._buf = buf[len(buf) - partial_tag_tail(buf, [INVOKE_OPEN, CALLS_CLOSE]) :]
        return False

    def _step_invoke(self, out: ParseDelta) -> bool:
        buf = self._buf
        param, close = buf.find(PARAM_OPEN), buf.find(INVOKE_CLOSE)
        if close >= 0 and (param < 0 or close < param):
            self._buf = buf[close + len(INVOKE_CLOSE) :]
            self._close_invoke(out)
            return True
        if param >= 0:
            header = _PARAM_HEADER.match(buf, param)
            if header is None:
                # A header ends at '">' (a name cannot hold '"': server/chat/tool_schemas.py),
                # so a lone '>' is part of the name (``c>d``) and the header is still
                # coming; only text past a '">' that does not match is malformed.
                end = buf.find('">', param + len(PARAM_OPEN))
                if end >= 0:  # malformed header: skip it
                    self._buf = buf[end + 2 :]
                    return True
                self._buf = buf[param:]
                return False
            key, is_string = header.group(1), header.group(2)
            self._param_is_string = is_string == "true"
            self._raw_value = ""
            self._in_json_string = self._json_escape = False
            sep = ", " if self._has_param else "{"
            self._emit(out, sep + to_json(key) + ": " + ('"' if self._param_is_string else ""))
            self._has_param = True
            self._buf = buf[header.end() :]
            self._state = _State.PARAM
            return True
        self._buf = buf[len(buf) - partial_tag_tail(buf, [PARAM_OPEN, INVOKE_CLOSE]) :]
        return False

    def _step_param(self, out: ParseDelta) -> bool:
        if not self._param_is_string:
            return self._step_json_param(out)
        buf = self._buf
        at = buf.find(PARAM_CLOSE)
        if at >= 0:
            self._close_param(buf[:at], out)
            self._buf = buf[at + len(PARAM_CLOSE) :]
            self._state = _State.INVOKE
            return True
        keep = partial_tag_tail(buf, [PARAM_CLOSE])
        piece, self._buf = buf[: len(buf) - keep], buf[len(buf) - keep :]
        self._emit(out, to_json(piece)[1:-1])  # JSON escaping is per character
        return False

    def _step_json_param(self, out: ParseDelta) -> bool:
        """A non-string value is JSON, and the grammar lets a string inside it hold any
        text, the close tag included (``["a</｜DSML｜ parameter>"]``): the tag ends the
        value only outside JSON strings."""
        buf, i = self._buf, 0
        while i < len(buf):
            ch = buf[i]
            if self._in_json_string:
                if self._json_escape:
                    self._json_escape = False
                elif ch == "\\":
                    self._json_escape = True
                elif ch == '"':
                    self._in_json_string = False
            elif buf.startswith(PARAM_CLOSE, i):
                self._close_param(buf[:i], out)
                self._buf = buf[i + len(PARAM_CLOSE) :]
                self._state = _State.INVOKE
                return True
            elif len(buf) - i < len(PARAM_CLOSE) and PARAM_CLOSE.startswith(buf[i:]):
                break  # a possible start of the close tag: wait for more
            elif ch == '"':
                self._in_json_string = True
            i += 1
        self._raw_value += buf[:i]
        self._buf = buf[i:]
        return False

    def _close_param(self, piece: str, out: ParseDelta) -> None:
        if self._param_is_string:
            self._emit(out, to_json(piece)[1:-1] + '"')
        else:
            self._emit(out, _json_value(self._raw_value + piece))

    def _close_invoke(self, out: ParseDelta) -> None:
        self._emit(out, "}" if self._has_param else "{}")
        self._state = _State.CALLS

    def _emit(self, out: ParseDelta, fragment: str) -> None:
        """Append an argument fragment of the open call, merging with this feed's last one."""
        if not fragment:
            return
        index = len(self._calls) - 1
        self._args[index] += fragment
        last = out.tool_calls[-1] if out.tool_calls else None
        if last is not None and last.index == index and last.id is None:
            last.arguments += fragment
        else:
            out.tool_calls.append(ToolCallDelta(index, arguments=fragment))
