"""A chat request's output format as the engine's ``StructuredOutputSpec``, checked first.

The engine compiles and enforces the spec (engine/structured_output/); what is
enforced for each API setting is written there. This module translates the
OpenAI fields (``response_format``, ``tools``, ``tool_choice``,
``parallel_tool_calls``) and refuses, before anything is compiled, schemas too
large or ones no value satisfies (server/chat/schema_check.py). What only
compiling can tell (a schema xgrammar rejects, a compile past
``--grammar-timeout``, a chat prefix that does not fit) comes back from the
engine as a ``GrammarError`` that the server answers with the same 400 (or 503).

OpenAI semantics kept here, not in the engine: ``strict: false`` is ignored
(the schema is always enforced) and a function without ``parameters`` takes no
arguments.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from engine.api.sampling_params import StructuredOutputSpec
from server.chat.schema_check import schema_problem
from server.http.errors import APIError
from server.openai.protocol import NamedToolChoice, ResponseFormat, Tool

# OpenAI: "omitting parameters defines a function with an empty parameter list".
NO_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {},
    "additionalProperties": False,
}


def check_grammar_inputs(
    max_schema_bytes: int, response_format: ResponseFormat | None, tools: Sequence[Tool]
) -> None:
    """400 before compiling: schemas too large, or ones no value satisfies."""
    schemas: list[tuple[str, Any]] = []
    if response_format is not None and response_format.json_schema is not None:
        schemas.append(("response_format.json_schema.schema", response_format.json_schema.schema_))
    for i, tool in enumerate(tools):
        if tool.function.parameters is not None:
            schemas.append((f"tools[{i}].function.parameters", tool.function.parameters))
    size = sum(len(json.dumps(s)) for _, s in schemas)
    if size > max_schema_bytes:
        param = schemas[0][0].split("[", 1)[0]
        raise APIError(
            400,
            f"{param}: the schemas total {size} bytes of JSON; at most "
            f"{max_schema_bytes} are compiled into a grammar",
            param=param,
        )
    for where, schema in schemas:
        reason = schema_problem(schema, where)
        if reason is not None:
            param = where.split("[", 1)[0]
            raise APIError(400, f"cannot enforce the schema: {reason}", param=param)


def structured_output_spec(
    max_schema_bytes: int,
    *,
    response_format: ResponseFormat | None = None,
    tools: Sequence[Tool] | None = None,
    tool_choice: str | NamedToolChoice | None = None,
    parallel_tool_calls: bool = True,
    starts_in_reasoning: bool = False,
    prefix: str = "",
) -> StructuredOutputSpec | None:
    """The spec enforcing a request's output format, or ``None`` when nothing is.

    ``tools``/``tool_choice``: None when the calls block cannot start (no tools, or
    ``tool_choice: none``). ``starts_in_reasoning``: the prompt ends inside
    ``<think>``. ``prefix``: answer text the prompt already holds (chat prefix
    completion), which the grammar must accept before generation starts.
    """
    forced = bool(tools) and (tool_choice == "required" or isinstance(tool_choice, NamedToolChoice))
    wants_json = response_format is not None and response_format.type != "text"
    auto_tools = bool(tools) and tool_choice in (None, "auto")
    if not (forced or wants_json or auto_tools):
        return None
    json_answer = wants_json and not forced
    check_grammar_inputs(max_schema_bytes, response_format if json_answer else None, tools or [])
    named = tool_choice.function.name if isinstance(tool_choice, NamedToolChoice) else None
    return StructuredOutputSpec(
        json_schema=_compact(_schema_of(response_format)) if json_answer else None,
        tools=_compact([_function_spec(t) for t in tools]) if tools else None,
        tool_choice=("function" if named else "required") if forced else "auto",
        function_name=named if forced else None,
        parallel_tool_calls=parallel_tool_calls,
        starts_in_reasoning=starts_in_reasoning,
        prefix=prefix,
        param="response_format" if json_answer else "tools",
        prefix_param="messages",
    )


def _compact(value: Any) -> str:
    """Compact JSON text: what the spec carries across to the engine."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _schema_of(response_format: ResponseFormat | None) -> dict[str, Any]:
    """The schema a JSON answer satisfies: the client's, or any object for ``json_object``."""
    if response_format is not None and response_format.type == "json_schema":
        assert response_format.json_schema is not None
        return response_format.json_schema.schema_
    return {"type": "object"}


def _function_spec(tool: Tool) -> dict[str, Any]:
    """A function for the engine: ``strict`` dropped (xgrammar would leave non-strict
    arguments unconstrained), and no ``parameters`` read as OpenAI does, no arguments
    (xgrammar would allow any JSON)."""
    spec = tool.function.model_dump(exclude_none=True, exclude={"strict"})
    spec.setdefault("parameters", NO_PARAMETERS)
    return spec
