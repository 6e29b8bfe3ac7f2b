"""Cheap checks of a JSON schema before it is compiled into a grammar.

``schema_problem`` names the first reason a schema cannot be served, or None:

- it admits no value at all (``anyOf: []``, a ``required`` property that
  ``additionalProperties: false`` excludes, a ``pattern`` no string matches
  such as ``^[^\\s\\S]$``, ``minimum > maximum``...). Compiled anyway, such a
  grammar either dead-ends mid-output or lets through values that break the
  schema; refusing it up front is a clear 400.
- it would be expensive to compile: nesting deeper than ``MAX_SCHEMA_DEPTH``,
  or a pattern whose nested counted repetitions (``((a{1,50}){1,50}){1,20}``)
  expand past ``MAX_PATTERN_EXPANSION`` copies.

The check is conservative: "None" means "no problem found", never "proved
satisfiable"; what it misses is caught when the grammar first allows no token
(the engine then ends that request with an error).
"""

from __future__ import annotations

import re
import threading
from functools import cache
from typing import Any, TypeGuard

try:  # CPython's own regex parser; the check is skipped where it is missing
    import re._constants as _sre
    import re._parser as _parser
except ImportError:  # pragma: no cover
    _parser = None

MAX_SCHEMA_DEPTH = 64
MAX_PATTERN_EXPANSION = 10_000
# Negated character classes tried against every code point per schema (~10 ms each).
MAX_CLASS_SCANS = 16
_budget = threading.local()


def schema_problem(schema: Any, where: str = "schema") -> str | None:
    """Why ``schema`` cannot be served (its language is empty, or it is too costly), or None."""
    _budget.scans = MAX_CLASS_SCANS
    return _problem(schema, where, 0)


def _problem(schema: Any, where: str, depth: int) -> str | None:
    if depth > MAX_SCHEMA_DEPTH:
        return f"{where}: nested more than {MAX_SCHEMA_DEPTH} levels deep"
    if schema is False:
        return f"{where}: the schema `false` admits no value"
    if not isinstance(schema, dict):
        return None
    for key in ("anyOf", "oneOf"):
        options = schema.get(key)
        if isinstance(options, list):
            if not options:
                return f"{where}.{key}: an empty list admits no value"
            reasons = [_problem(o, f"{where}.{key}[{i}]", depth + 1) for i, o in enumerate(options)]
            if all(reasons):
                return reasons[0]
    for i, part in enumerate(schema.get("allOf") or []):
        if reason := _problem(part, f"{where}.allOf[{i}]", depth + 1):
            return reason
    if schema.get("enum") == []:
        return f"{where}.enum: an empty list admits no value"
    if schema.get("type") == []:
        return f"{where}.type: an empty list admits no value"
    for low, high in (
        ("minimum", "maximum"),
        ("minLength", "maxLength"),
        ("minItems", "maxItems"),
        ("minProperties", "maxProperties"),
    ):
        lo, hi = schema.get(low), schema.get(high)
        if _number(lo) and _number(hi) and lo > hi:
            return f"{where}: {low} {lo} is above {high} {hi}"
    pattern = schema.get("pattern")
    if isinstance(pattern, str) and (reason := _pattern_problem(pattern)):
        return f"{where}.pattern: {reason}"
    return _object_problem(schema, where, depth) or _array_problem(schema, where, depth)


def _object_problem(schema: dict[str, Any], where: str, depth: int) -> str | None:
    properties = schema.get("properties")
    properties = properties if isinstance(properties, dict) else {}
    required = schema.get("required")
    required = [r for r in required if isinstance(r, str)] if isinstance(required, list) else []
    closed = schema.get("additionalProperties") is False and not schema.get("patternProperties")
    for name in required:
        if name not in properties and closed:
            return (
                f"{where}.required: '{name}' is required but additionalProperties: false "
                "excludes it (it is not in properties)"
            )
        if name in properties and (
            reason := _problem(properties[name], f"{where}.properties.{name}", depth + 1)
        ):
            return reason
    for name, sub in properties.items():
        if name not in required:  # an optional property that admits nothing can be left out
            reason = _problem(sub, f"{where}.properties.{name}", depth + 1)
            if reason and "nested more than" in reason:
                return reason
    return None


def _array_problem(schema: dict[str, Any], where: str, depth: int) -> str | None:
    items = schema.get("items")
    if not isinstance(items, dict | bool):
        return None
    reason = _problem(items, f"{where}.items", depth + 1)
    min_items = schema.get("minItems")
    if reason and (("nested more than" in reason) or (_number(min_items) and min_items > 0)):
        return reason
    return None


def _number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


# ---------------------------------------------------------------- patterns


def _pattern_problem(pattern: str) -> str | None:
    if _parser is None:
        return None
    try:
        parsed = _parser.parse(pattern)
    except (re.error, RecursionError, OverflowError):
        return None  # not Python's dialect: the grammar compiler has the last word
    try:
        if _expansion(parsed) > MAX_PATTERN_EXPANSION:
            return (
                f"its counted repetitions expand to more than {MAX_PATTERN_EXPANSION} copies; "
                "use * or + instead"
            )
        if _empty(parsed):
            return "no string matches it (e.g. an empty character class such as [^\\s\\S])"
    except RecursionError:
        return "nested too deeply"
    return None


def _expansion(sub: Any) -> int:
    """Copies a regex compiler makes of the innermost item (product of counted repeats)."""
    worst = 1
    for op, av in sub:
        if op in (_sre.MAX_REPEAT, _sre.MIN_REPEAT, _sre.POSSESSIVE_REPEAT):
            lo, hi, item = av
            count = lo if hi == _sre.MAXREPEAT else hi
            worst = max(worst, max(1, count) * _expansion(item))
        elif op is _sre.BRANCH:
            worst = max(worst, *(_expansion(b) for b in av[1]))
        elif op is _sre.SUBPATTERN:
            worst = max(worst, _expansion(av[-1]))
        elif op is _sre.ATOMIC_GROUP:
            worst = max(worst, _expansion(av))
    return worst


def _empty(sub: Any) -> bool:
    """No string matches this (parsed) sequence: one of its required items matches nothing."""
    for op, av in sub:
        if op is _sre.IN and _class_empty(av):
            return True
        if op is _sre.BRANCH and all(_empty(b) for b in av[1]):
            return True
        if op is _sre.SUBPATTERN and _empty(av[-1]):
            return True
        if op is _sre.ATOMIC_GROUP and _empty(av):
            return True
        if op in (_sre.MAX_REPEAT, _sre.MIN_REPEAT, _sre.POSSESSIVE_REPEAT):
            lo, _, item = av
            if lo > 0 and _empty(item):
                return True
    return False


def _class_empty(items: list[Any]) -> bool:
    """A character class (``[...]``) that matches no code point at all.

    Only a negated class can be empty (a plain one lists at least one character
    or category); it is tried against every code point once (~10 ms), and the
    answer is cached, so a schema repeating one class pays once.
    """
    if not items or items[0][0] is not _sre.NEGATE:
        return False
    key = repr(items)
    if key not in _EMPTY_CLASSES:
        if getattr(_budget, "scans", 0) <= 0:
            return False  # budget spent: leave the rest to the grammar's dead-state check
        _budget.scans -= 1
        if len(_EMPTY_CLASSES) >= _MAX_CACHED_CLASSES:
            _EMPTY_CLASSES.clear()
        sub = _parser.SubPattern(_parser.State(), [(_sre.IN, items)])
        compiled = re._compiler.compile(sub)  # type: ignore[attr-defined]
        _EMPTY_CLASSES[key] = compiled.search(_every_code_point()) is None
    return _EMPTY_CLASSES[key]


_EMPTY_CLASSES: dict[str, bool] = {}
_MAX_CACHED_CLASSES = 1024


@cache
def _every_code_point() -> str:
    return "".join(map(chr, range(0x110000)))


# Built at import (server start-up), not inside the first request that needs it: the
# join holds the GIL for ~0.1 s, which a request thread would take from the event loop.
_every_code_point()
