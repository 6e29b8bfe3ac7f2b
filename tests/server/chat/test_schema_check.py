"""Schemas refused before compiling, grammar errors without internals, raw-body checks,
and a real xgrammar dead state ending its row only (docs/design/hardening.md)."""

from __future__ import annotations

import json

import pytest
import torch
import xgrammar as xgr

from engine.api.errors import RequestError
from engine.loader.tokenizer import load_tokenizer
from engine.sample.sampler import apply_token_masks
from engine.structured_output.xgrammar_backend import (
    XGrammarMatcher,
    clean_grammar_error,
    grammar_tokenizer_info,
)
from server.chat.schema_check import schema_problem
from server.http.errors import APIError
from server.http.input_checks import (
    MAX_JSON_DEPTH,
    InputProblem,
    check_arguments_text,
    check_body,
)

VOCAB = 129280


@pytest.mark.parametrize(
    ("schema", "found"),
    [
        ({"type": "string", "pattern": "^[^\\s\\S]$"}, "schema.pattern: no string matches"),
        ({"type": "string", "pattern": "x[^\\d\\D]"}, "schema.pattern: no string matches"),
        ({"type": "string", "pattern": "([^\\w\\W])+"}, "schema.pattern: no string matches"),
        ({"anyOf": []}, "schema.anyOf: an empty list"),
        ({"oneOf": [{"enum": []}, {"type": []}]}, "schema.oneOf[0].enum: an empty list"),
        (
            {"type": "object", "required": ["b"], "additionalProperties": False},
            "schema.required: 'b' is required but additionalProperties: false",
        ),
        (
            {"properties": {"a": {"anyOf": []}}, "required": ["a"]},
            "schema.properties.a.anyOf",
        ),
        ({"type": "array", "items": False, "minItems": 1}, "schema.items: the schema `false`"),
        ({"minimum": 3, "maximum": 2}, "schema: minimum 3 is above maximum 2"),
        ({"pattern": "^((a{1,50}){1,50}){1,20}$"}, "expand to more than 10000 copies"),
    ],
)
def test_unsatisfiable_or_costly_schemas_are_named(schema: dict, found: str) -> None:
    reason = schema_problem(schema)
    assert reason is not None and found in reason, reason


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "pattern": "a|[^\\w\\W]"},  # one branch still matches
        {"type": "string", "pattern": "^[^a]*$"},
        {"type": "string", "pattern": "([^\\s\\S])?b"},  # the empty part is optional
        {"properties": {"a": {"anyOf": []}}},  # an optional property may be left out
        {"type": "array", "items": False},  # [] satisfies it
        {
            "type": "object",
            "required": ["a"],
            "additionalProperties": False,
            "properties": {"a": {}},
        },
        {"pattern": "^(a{1,50}){1,50}$"},
        {"pattern": "(("},  # not ours to judge: the grammar compiler answers
    ],
)
def test_satisfiable_schemas_pass(schema: dict) -> None:
    assert schema_problem(schema) is None


def test_schema_nesting_is_bounded() -> None:
    schema: dict = {"type": "string"}
    for _ in range(100):
        schema = {"anyOf": [schema]}
    assert "nested more than 64" in (schema_problem(schema) or "")


def test_grammar_errors_lose_their_source_paths() -> None:
    raw = (
        "[10:12:20] /project/cpp/regex_converter.cc:94: Regex parsing error at position 3: "
        "The parenthesis is not closed.\nStack trace:\n  /usr/lib/libxgrammar.so(+0x12)"
    )
    assert clean_grammar_error(RuntimeError(raw)) == (
        "Regex parsing error at position 3: The parenthesis is not closed."
    )
    assert "/usr" not in clean_grammar_error(ValueError("in /usr/lib/python3/x.py:3: bad"))


def test_raw_body_checks_name_the_field() -> None:
    with pytest.raises(APIError) as info:
        check_body({"messages": [{"content": "ok"}, {"content": ["a", "\ud800"]}]})
    assert info.value.status == 400 and info.value.param == "messages[1].content[1]"
    with pytest.raises(APIError) as info:
        check_body({"tools": [{"parameters": {"\udfff": {}}}]})
    assert info.value.param == "tools[0].parameters"
    deep: list = []
    for _ in range(MAX_JSON_DEPTH + 1):
        deep = [deep]
    with pytest.raises(APIError, match="nested more than"):
        check_body({"x": deep})
    check_body({"x": json.loads("[" * 60 + "]" * 60)})  # within the bound
    with pytest.raises(InputProblem) as problem:
        check_arguments_text("[" * 5000, "arguments")
    assert (problem.value.where, problem.value.problem) == (
        "arguments",
        f"nested more than {MAX_JSON_DEPTH} levels deep",
    )
    with pytest.raises(InputProblem) as problem:
        check_arguments_text(json.dumps("[" * 70 + "]" * 70), "arguments")
    assert problem.value.where == "arguments" + "[0]" * MAX_JSON_DEPTH
    assert str(problem.value) == f"{problem.value.where}: {problem.value.problem}"
    with pytest.raises(InputProblem, match=r"^arguments\.k: the text holds a lone"):
        check_arguments_text('{"k": "\\ud800"}', "arguments")
    check_arguments_text('{"a": [1, 2]}', "arguments")
    check_arguments_text("not json", "arguments")


def test_a_real_dead_grammar_state_fails_its_row_only() -> None:
    """The empty-language schema compiled anyway (as before the up-front check): after
    the opening quote the matcher allows nothing; the sampler reports that row alone."""
    tokenizer = load_tokenizer()
    info = grammar_tokenizer_info(tokenizer, vocab_size=VOCAB, eos_token_id=1)
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(
        json.dumps({"type": "string", "pattern": "^[^\\s\\S]$"})
    )
    dead = XGrammarMatcher(compiled, VOCAB)
    dead.accept(tokenizer.token_to_id('"'))
    logits = torch.zeros(2, VOCAB)
    failed = apply_token_masks(logits, [None, dead])
    assert list(failed) == [1] and isinstance(failed[1], RequestError)
    assert bool(torch.isfinite(logits).all())


def test_grammar_cache_is_bounded_in_bytes() -> None:
    """Distinct schemas once grew the server by 2.5 GB. Without a bound the
    compiled-grammar cache keeps every grammar; with ``--grammar-cache-bytes`` set to
    a quarter of that it stays within its bound (the engine's own LRU; xgrammar's
    passed it by one entry)."""
    from engine.api.sampling_params import StructuredOutputSpec
    from engine.structured_output.xgrammar_backend import GrammarLimits, StructuredOutputManager

    tokenizer = load_tokenizer()

    def cached_bytes(limit: int) -> int:
        manager = StructuredOutputManager(tokenizer, VOCAB, 1, GrammarLimits(cache_bytes=limit))
        for i in range(12):
            schema = {"type": "object", "properties": {f"k{i}": {"type": "integer"}}}
            assert manager.matcher_now(StructuredOutputSpec(json_schema=json.dumps(schema)))
        used = manager.cache_bytes_used()
        manager.close()
        return used

    unbounded = cached_bytes(1 << 40)
    one = unbounded / 12  # the grammars are alike in size
    bound = int(3 * one)
    bounded = cached_bytes(bound)
    assert bound - 1.5 * one <= bounded <= bound
    assert unbounded > 2 * bounded
