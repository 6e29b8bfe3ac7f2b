"""Checks of a raw request body that pydantic's field types do not make.

Every string in the body (values and keys, at any depth) must be encodable as
UTF-8: JSON allows a lone surrogate escape (``"\\ud800"``) that Python decodes
into a string the tokenizer, the tenant hash and the grammar compiler all
reject with exceptions of their own. And no value may nest deeper than
``MAX_JSON_DEPTH``: the prompt renderer and the schema walkers recurse.

Both are 400s that name the field (``messages[0].content``), raised before any
other validation so a malformed value never reaches code that would fail on it.
"""

from __future__ import annotations

import json
from typing import Any

from server.http.errors import APIError

MAX_JSON_DEPTH = 64


class InputProblem(ValueError):
    """One value of a body that fails a check: ``where`` is its path (``""``: the body
    itself), ``problem`` what is wrong, without the path."""

    def __init__(self, where: str, problem: str) -> None:
        super().__init__(f"{where or 'body'}: {problem}")
        self.where = where
        self.problem = problem


def check_body(data: Any) -> None:
    """Raise a 400 ``APIError`` for unencodable text or nesting past ``MAX_JSON_DEPTH``."""
    try:
        _walk(data, "", 0)
    except InputProblem as exc:
        raise APIError(400, str(exc), param=exc.where or None) from None


def check_arguments_text(arguments: str, where: str) -> None:
    """A past tool call's ``arguments`` string: the JSON it holds (decoded up to twice,
    as the prompt renderer does) must not nest past ``MAX_JSON_DEPTH`` either.

    Raises ``InputProblem``: the caller, a field validator, places it at its field.
    """
    value: Any = arguments
    for _ in range(2):
        if not isinstance(value, str):
            break
        try:
            value = json.loads(value)
        except RecursionError:
            raise _too_deep(where) from None
        except ValueError:
            return
    _walk(value, where, 0)


def _walk(value: Any, where: str, depth: int) -> None:
    if isinstance(value, str):
        if not _encodable(value):
            raise InputProblem(
                where,
                "the text holds a lone UTF-16 surrogate (e.g. \\ud800), which is not valid Unicode",
            )
        return
    if isinstance(value, dict | list) and depth >= MAX_JSON_DEPTH:
        raise _too_deep(where)
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and not _encodable(key):
                raise InputProblem(
                    where,
                    "a key holds a lone UTF-16 surrogate (e.g. \\ud800), which is not valid "
                    "Unicode",
                )
            _walk(item, f"{where}.{key}" if where else str(key), depth + 1)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _walk(item, f"{where}[{i}]", depth + 1)


def _too_deep(where: str) -> InputProblem:
    return InputProblem(where, f"nested more than {MAX_JSON_DEPTH} levels deep")


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
