"""Tool parameter schemas that DeepSeek's DSML call format can carry, checked once per request.

A call is written as DSML tags (server/chat/tool_calls.py shows one): each
top-level argument is ``<｜DSML｜ parameter name="KEY" string="true|false">VALUE
</｜DSML｜ parameter>``, ``KEY`` and a string ``VALUE`` as raw text, anything
else as JSON. The format has no escape: DeepSeek's encoder writes names and
string values as they are, the model was trained on that, and xgrammar's
``deepseek_v4_1`` grammar writes them the same way. So a schema that lets a
call contain the format's own syntax produces calls the parser cannot read
back (a quote in a name ends the attribute; an ``enum`` value holding
``</｜DSML｜ parameter>`` closes the parameter early), and the response says
``tool_calls`` with arguments that break the schema.

Decision: refuse, not escape. An escape of our own (``&quot;``, ``\\"``) would
have to be written by the model, which never saw one, and by xgrammar's
grammar, which writes names verbatim; it could not round-trip. Refusing is a
400 that names the tool and the property, before anything is compiled. What is
refused (docs/design/api.md, "Tools"):

- ``parameters`` that is not an object schema: a ``type`` other than
  ``"object"`` (OpenAI's rule; a call's arguments are always an object, and
  xgrammar, given ``{"type": "string"}``, lets through an empty call whose ``{}``
  breaks that schema). A schema without ``type`` (``{}``, ``{"anyOf": ...}``)
  is read as the object of parameters it describes, as before;
- a property name holding ``"`` (one rule at every depth: only top-level names
  sit in the attribute, but nested ones gain nothing from a quote) or the
  ``｜DSML｜`` marker;
- an ``enum``/``const`` value or a ``pattern`` holding the ``｜DSML｜`` marker
  (every tag of the format contains it, and the marker is a special token no
  answer needs). Any string inside the value counts, also where the call would
  carry it as JSON, which the parser reads back: one rule, simply stated.

Not caught here: a top-level string whose ``pattern`` matches the close tag
without spelling the marker (``.*``). xgrammar's grammar keeps the tag out of
plain strings only; such a value would end its parameter early.

Tool names need no check here: their pattern (``^[A-Za-z0-9_.:-]{1,64}$``,
server/openai/protocol.py) already excludes every character of the syntax.

``check_tool_schemas`` takes the schemas alone, so every API that lists tools
(the chat completions ``tools[i].function.parameters``, another API's
``tools[i].input_schema``) calls the same check with its own field path.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from engine.api.special_tokens import DSML
from server.http.errors import APIError
from server.http.input_checks import InputProblem

OPENAI_PARAMETERS_FIELD = "tools[{i}].function.parameters"
# Keywords whose value is one subschema, a list of them, or a name -> subschema map.
_ONE_SCHEMA = (
    "items",
    "additionalItems",
    "additionalProperties",
    "unevaluatedItems",
    "unevaluatedProperties",
    "contains",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
)
_SCHEMA_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_MAP = ("$defs", "definitions", "patternProperties", "dependentSchemas")


def check_tool_schemas(
    schemas: Sequence[Mapping[str, Any] | None], field: str = OPENAI_PARAMETERS_FIELD
) -> None:
    """A 400 ``APIError`` for the first schema the DSML call format cannot carry.

    ``schemas[i]`` is tool ``i``'s parameter schema (None: the tool takes none);
    ``field`` is its path with ``{i}`` for the index, which the error's ``param``
    extends to the offending value (``tools[0].function.parameters.properties.a"b``).
    """
    for i, schema in enumerate(schemas):
        if schema is None:
            continue
        where = field.format(i=i)
        try:
            _check_root(schema, where)
            _check_schema(schema, where)
        except InputProblem as exc:
            raise APIError(400, str(exc), param=exc.where) from None


def _check_root(schema: Mapping[str, Any], where: str) -> None:
    if "type" not in schema:
        return
    kind = schema["type"]
    if kind == "object" or kind == ["object"]:
        return
    raise InputProblem(
        where,
        f'must be a JSON Schema of type "object", got type {json.dumps(kind)}: '
        "a call's arguments are an object",
    )


def _check_schema(schema: Any, where: str) -> None:
    """Walk the keywords that hold names, values or subschemas; data keywords such as
    ``default`` and ``examples`` never reach the output."""
    if not isinstance(schema, Mapping):
        return
    properties = schema.get("properties")
    if isinstance(properties, Mapping):
        for name, sub in properties.items():
            _check_name(name, f"{where}.properties.{name}")
            _check_schema(sub, f"{where}.properties.{name}")
    required = schema.get("required")
    if isinstance(required, list):
        for j, name in enumerate(required):
            if isinstance(name, str):
                _check_name(name, f"{where}.required[{j}]")
    if "enum" in schema:
        _check_values(schema["enum"], f"{where}.enum")
    if "const" in schema:
        _check_values(schema["const"], f"{where}.const")
    pattern = schema.get("pattern")
    if isinstance(pattern, str) and DSML in pattern:
        raise _marker_problem(f"{where}.pattern", "the pattern")
    for key, sub in _subschemas(schema):
        _check_schema(sub, f"{where}.{key}")


def _subschemas(schema: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    for key in _ONE_SCHEMA:
        value = schema.get(key)
        if isinstance(value, list):  # draft-07 tuple ``items``
            yield from ((f"{key}[{j}]", s) for j, s in enumerate(value))
        elif value is not None:
            yield key, value
    for key in _SCHEMA_LIST:
        value = schema.get(key)
        if isinstance(value, list):
            yield from ((f"{key}[{j}]", s) for j, s in enumerate(value))
    for key in _SCHEMA_MAP:
        value = schema.get(key)
        if isinstance(value, Mapping):
            yield from ((f"{key}.{name}", s) for name, s in value.items())


def _check_name(name: str, where: str) -> None:
    if '"' in name:
        raise InputProblem(
            where,
            f"the property name {json.dumps(name, ensure_ascii=False)} holds '\"', which "
            "would end the name attribute of a DSML parameter tag; DeepSeek's tool-call "
            "format has no escape for it",
        )
    if DSML in name:
        raise _marker_problem(where, f"the property name {json.dumps(name, ensure_ascii=False)}")


def _check_values(value: Any, where: str) -> None:
    """Every string inside an ``enum``/``const`` value, keys of object values included."""
    if isinstance(value, str):
        if DSML in value:
            raise _marker_problem(where, f"the value {json.dumps(value, ensure_ascii=False)}")
    elif isinstance(value, list):
        for j, item in enumerate(value):
            _check_values(item, f"{where}[{j}]")
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _check_values(key, f"{where}.{key}")
            _check_values(item, f"{where}.{key}")


def _marker_problem(where: str, what: str) -> InputProblem:
    return InputProblem(
        where,
        f"{what} holds '{DSML}', the marker of DeepSeek's tool-call tags, so a call "
        "could not be read back; the format has no escape for it",
    )
