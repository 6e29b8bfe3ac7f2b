"""Grammar-constrained decoding with xgrammar: JSON output and forced DSML tool calls.

One ``StructuredOutputCompiler`` per server holds xgrammar's view of the
vocabulary and its grammar cache; ``for_request`` returns a fresh
``GrammarMaskProvider`` (the engine's ``TokenMaskProvider``) per sequence, or
``None`` when nothing is enforced.

What is enforced:

- ``response_format`` ``json_object`` (any JSON object) or ``json_schema``;
  with tools and ``tool_choice: auto`` the output may instead be a calls block.
- ``tool_choice: required`` (one or more calls of any tool; exactly one with
  ``parallel_tool_calls: false``) or a named function (exactly one call of it):
  a DSML calls block whose arguments satisfy each function's ``parameters``
  schema (``strict: false`` is ignored: the schema is always enforced), then EOS.
- ``tool_choice: auto`` (or unset) with tools: free text, and once the model
  opens a calls block, the same calls grammar until the block closes, then EOS.
- Whitespace is bounded everywhere: in a calls block at most one character
  wherever the format allows any (the canonical layout's newline between tags;
  none is needed inside a value), and JSON output is compact (no whitespace
  between tokens, ``json.dumps(separators=(",", ":"))``).
- With thinking on, free reasoning text first, up to ``</think>``.

Added tokens (``<｜User｜>``, BOS, placeholders, ...) are never allowed under a
grammar, except ``<think>``, ``</think>`` and ``｜DSML｜``, which the formats
use; EOS is allowed only once the grammar is complete.
"""

from __future__ import annotations

import json
import re
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import xgrammar as xgr
from tokenizers import Tokenizer
from xgrammar.structural_tag import (
    AnyTextFormat,
    GrammarFormat,
    OrFormat,
    SequenceFormat,
    StructuralTag,
    TagFormat,
)

from engine.api.special_tokens import DSML, THINK_END, THINK_START
from server.chat.schema_check import schema_problem
from server.http.errors import APIError
from server.openai.protocol import NamedToolChoice, ResponseFormat, Tool

# Added tokens a grammar may produce; every other added token is masked out.
GRAMMAR_MARKERS = (THINK_START, THINK_END, DSML)
# JSON output is compact: xgrammar's own JSON grammar without whitespace.
JSON_SEPARATORS = (",", ":")
# Longest whitespace run in a DSML calls block: the canonical layout puts one
# newline between tags, and no value needs more; unbounded runs let a model
# spend its whole budget on blanks and leave the call cut.
MAX_TOOL_CALL_WHITESPACE = 1
XGRAMMAR_MODEL = "deepseek_v4_1"
# OpenAI: "omitting parameters defines a function with an empty parameter list".
NO_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {},
    "additionalProperties": False,
}  # xgrammar's built-in V4.1 calls-block format


@dataclass(frozen=True, slots=True)
class GrammarLimits:
    """Bounds on grammar work (flags of ``flashserve serve``, README "Limits")."""

    timeout_s: float = 10.0  # one compilation, wall time
    max_schema_bytes: int = 256 << 10  # JSON of the schemas one request asks to enforce
    cache_bytes: int = 256 << 20  # compiled grammars kept (LRU)
    workers: int = 2  # compilations at once

    def __post_init__(self) -> None:
        if not self.timeout_s > 0 or min(self.max_schema_bytes, self.cache_bytes, self.workers) < 1:
            raise ValueError("GrammarLimits: every limit must be positive")


def check_grammar_inputs(
    limits: GrammarLimits, response_format: ResponseFormat | None, tools: Sequence[Tool]
) -> None:
    """400 before compiling: schemas too large, or ones no value satisfies."""
    schemas: list[tuple[str, Any]] = []
    if response_format is not None and response_format.json_schema is not None:
        schemas.append(("response_format.json_schema.schema", response_format.json_schema.schema_))
    for i, tool in enumerate(tools):
        if tool.function.parameters is not None:
            schemas.append((f"tools[{i}].function.parameters", tool.function.parameters))
    size = sum(len(json.dumps(s)) for _, s in schemas)
    if size > limits.max_schema_bytes:
        param = schemas[0][0].split("[", 1)[0]
        raise APIError(
            400,
            f"{param}: the schemas total {size} bytes of JSON; at most "
            f"{limits.max_schema_bytes} are compiled into a grammar",
            param=param,
        )
    for where, schema in schemas:
        reason = schema_problem(schema, where)
        if reason is not None:
            param = where.split("[", 1)[0]
            raise APIError(400, f"cannot enforce the schema: {reason}", param=param)


# xgrammar's C++ errors start "[10:12:20] /project/cpp/regex_converter.cc:94: ".
_SOURCE_PREFIX = re.compile(r"^\s*(\[[\d:.]+\]\s*)?(\S+\.(cc|cpp|h|hpp|py):\d+:\s*)?")
_PATHS = re.compile(r"(/[\w.\-]+){2,}(:\d+)?")


def clean_grammar_error(exc: BaseException) -> str:
    """The compiler's complaint, without timestamps, source paths or a traceback."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = _PATHS.sub("<path>", _SOURCE_PREFIX.sub("", text))
    return text[:300]


def grammar_tokenizer_info(
    tokenizer: Tokenizer, *, vocab_size: int, eos_token_id: int
) -> xgr.TokenizerInfo:
    """xgrammar's view of a byte-level BPE vocabulary with the added tokens masked."""
    encoded = [""] * vocab_size  # "" = never produced under a grammar
    for token, token_id in tokenizer.get_vocab(with_added_tokens=True).items():
        if token_id < vocab_size:
            encoded[token_id] = token
    for token_id, added in tokenizer.get_added_tokens_decoder().items():
        if token_id < vocab_size and added.content not in GRAMMAR_MARKERS:
            encoded[token_id] = ""
    return xgr.TokenizerInfo(
        encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab_size, stop_token_ids=[eos_token_id]
    )


class GrammarMaskProvider:
    """A ``TokenMaskProvider`` backed by one xgrammar matcher (one sequence).

    It pickles (to reach an engine core in another process) as its compiled
    grammar's JSON plus the prefix text it accepted; the core rebuilds xgrammar's
    vocabulary view from its own tokenizer once, then each matcher in about 1 ms.
    """

    __slots__ = ("_bitmask", "_compiled", "_matcher", "_prefix", "_vocab_size")

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int) -> None:
        self._compiled = compiled
        self._vocab_size = vocab_size
        self._prefix = ""
        self._matcher = xgr.GrammarMatcher(compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        info = self._compiled.tokenizer_info
        eos = list(info.stop_token_ids)
        return (
            _restore_provider,
            (self._compiled.serialize_json(), self._vocab_size, eos, self._prefix),
        )

    def allowed_tokens(self) -> torch.Tensor:
        """Int32 bitmask ``[ceil(V / 32)]``; bit ``j`` of word ``i`` allows token ``32 i + j``."""
        self._matcher.fill_next_token_bitmask(self._bitmask)
        return self._bitmask[0].clone()

    def accept(self, token_id: int) -> None:
        if not self._matcher.accept_token(token_id):
            raise ValueError(f"token {token_id} is not allowed by the grammar")

    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def is_completed(self) -> bool:
        """The text so far is a complete match (EOS would be accepted)."""
        return self._matcher.is_completed()

    def accept_text(self, text: str) -> bool:
        """Advance past text already in the prompt (a chat prefix); False if it does not fit."""
        if not self._matcher.accept_string(text):
            return False
        self._prefix += text
        return True


# In an engine core process: xgrammar's vocabulary view by (vocab size, stop ids).
_CORE_INFOS: dict[tuple[int, tuple[int, ...]], xgr.TokenizerInfo] = {}
_CORE_INFOS_LOCK = threading.Lock()


def _restore_provider(
    grammar_json: str, vocab_size: int, stop_ids: list[int], prefix: str
) -> GrammarMaskProvider:
    """Unpickle a provider in the engine core, against the core's own tokenizer."""
    from engine.core.core_process import core_tokenizer

    key = (vocab_size, tuple(stop_ids))
    with _CORE_INFOS_LOCK:
        info = _CORE_INFOS.get(key)
        if info is None:
            tokenizer = core_tokenizer()
            if tokenizer is None:
                raise RuntimeError("a grammar reached an engine core without a tokenizer")
            info = grammar_tokenizer_info(
                tokenizer, vocab_size=vocab_size, eos_token_id=stop_ids[0]
            )
            _CORE_INFOS[key] = info
    provider = GrammarMaskProvider(
        xgr.CompiledGrammar.deserialize_json(grammar_json, info), vocab_size
    )
    if prefix and not provider.accept_text(prefix):
        raise RuntimeError("a grammar's accepted prefix does not fit it after the transfer")
    return provider


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Expand an int32 token bitmask into bool ``[vocab_size]``.

    Bytes are unpacked least significant bit first, so on a little-endian host
    bit ``j`` of word ``i`` lands at ``32 i + j`` (numpy: single-threaded and
    ~100x faster than torch's shift under CPU contention).
    """
    assert sys.byteorder == "little"
    words = bitmask.to(torch.int32).contiguous().numpy()
    bits = np.unpackbits(words.view(np.uint8), bitorder="little")[:vocab_size]
    return torch.from_numpy(bits.astype(bool))


class StructuredOutputCompiler:
    """Builds mask providers for requests; compiled grammars are cached by xgrammar."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        vocab_size: int,
        eos_token_id: int,
        max_threads: int = 1,
        limits: GrammarLimits | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.limits = limits or GrammarLimits()
        info = grammar_tokenizer_info(tokenizer, vocab_size=vocab_size, eos_token_id=eos_token_id)
        # xgrammar's cache is an LRU bounded in bytes: distinct schemas cannot grow it.
        self._compiler = xgr.GrammarCompiler(
            info, max_threads=max_threads, cache_limit_bytes=self.limits.cache_bytes
        )
        # Compilation runs here, never on the caller's thread, so it can be timed out
        # (xgrammar releases the GIL while it compiles).
        self._pool = ThreadPoolExecutor(self.limits.workers, thread_name_prefix="grammar")

    def for_request(
        self,
        *,
        response_format: ResponseFormat | None = None,
        tools: Sequence[Tool] | None = None,
        tool_choice: str | NamedToolChoice | None = None,
        parallel_tool_calls: bool = True,
        starts_in_reasoning: bool = False,
        prefix: str = "",
    ) -> GrammarMaskProvider | None:
        """The provider enforcing a request's output format, or ``None``.

        ``starts_in_reasoning``: the prompt ends inside ``<think>``. ``prefix``:
        answer text the prompt already holds (chat prefix completion), which the
        grammar must accept before generation starts.
        """
        forced = bool(tools) and (
            tool_choice == "required" or isinstance(tool_choice, NamedToolChoice)
        )
        wants_json = response_format is not None and response_format.type != "text"
        auto_tools = bool(tools) and tool_choice in (None, "auto")
        if not (forced or wants_json or auto_tools):
            return None
        param = "response_format" if wants_json and not forced else "tools"
        check_grammar_inputs(
            self.limits, response_format if wants_json and not forced else None, tools or []
        )
        try:
            if forced:
                body: Any = self._calls_format(tools or [], tool_choice, parallel_tool_calls)
            elif wants_json:
                assert response_format is not None
                body = _json_format(response_format)
                if auto_tools:
                    calls = self._calls_format(tools or [], "required", parallel_tool_calls)
                    body = OrFormat(elements=[body, calls])
            else:
                # Free text until the model opens a calls block, which is then held to
                # the same grammar as a forced call (and ends the turn).
                body = self._calls_format(tools or [], "auto", parallel_tool_calls)
        except Exception as exc:  # the compact-JSON converter rejects a bad schema
            message = f"{param}: cannot build a grammar: {clean_grammar_error(exc)}"
            raise APIError(400, message, param=param) from exc
        if starts_in_reasoning:
            reasoning = TagFormat(
                begin="", content=AnyTextFormat(excludes=[THINK_START, THINK_END]), end=THINK_END
            )
            body = SequenceFormat(elements=[reasoning, body])
        compiled = self._compile(StructuralTag(format=body), param)
        provider = GrammarMaskProvider(compiled, self.vocab_size)
        if prefix and not provider.accept_text(prefix):
            raise APIError(
                400,
                "the assistant prefix does not fit the required output format",
                param="messages",
            )
        return provider

    def _compile(self, tag: StructuralTag, param: str) -> xgr.CompiledGrammar:
        """Compile in the grammar pool within ``limits.timeout_s``; errors as a clean 400.

        A compile that overruns is left to finish in its thread (xgrammar cannot be
        interrupted) and its result dropped; one that never started is cancelled, and
        the request gets a 503 (every grammar worker is busy)."""
        future = self._pool.submit(self._compiler.compile_structural_tag, tag)
        try:
            return future.result(timeout=self.limits.timeout_s)
        except FutureTimeout:
            if future.cancel():
                raise APIError(
                    503, "Every grammar worker is busy; retry later", param=param
                ) from None
            raise APIError(
                400,
                f"{param}: the grammar did not compile within {self.limits.timeout_s:g} s; "
                "simplify the schema",
                param=param,
            ) from None
        except Exception as exc:  # xgrammar raises several types for a bad schema
            message = f"{param}: cannot build a grammar: {clean_grammar_error(exc)}"
            raise APIError(400, message, param=param) from exc

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    @staticmethod
    def _calls_format(tools: Sequence[Tool], tool_choice: Any, parallel_tool_calls: bool) -> Any:
        """xgrammar's V4.1 calls block for ``required``, one named function, or ``auto``
        (free text with the calls block as a triggered tag)."""
        choice = (
            tool_choice.model_dump() if isinstance(tool_choice, NamedToolChoice) else tool_choice
        )
        specs: list[Any] = [{"type": "function", "function": _function_spec(t)} for t in tools]
        tag = xgr.get_model_structural_tag(
            XGRAMMAR_MODEL,
            tools=specs,
            tool_choice=choice,
            reasoning="disabled",
            max_whitespace_cnt=MAX_TOOL_CALL_WHITESPACE,
            parallel_tool_calls=parallel_tool_calls,
        )
        return tag.format


def _function_spec(tool: Tool) -> dict[str, Any]:
    """A function for xgrammar: ``strict`` dropped (xgrammar would leave non-strict
    arguments unconstrained), and no ``parameters`` read as OpenAI does, no arguments
    (xgrammar would allow any JSON)."""
    spec = tool.function.model_dump(exclude_none=True, exclude={"strict"})
    spec.setdefault("parameters", NO_PARAMETERS)
    return spec


def _json_format(response_format: ResponseFormat) -> GrammarFormat:
    """Compact JSON for ``response_format`` (the structural tag's JSON format always
    allows whitespace, so the grammar comes from xgrammar's JSON converter)."""
    if response_format.type == "json_schema":
        assert response_format.json_schema is not None
        schema: dict[str, Any] = response_format.json_schema.schema_
    else:
        schema = {"type": "object"}
    grammar = xgr.Grammar.from_json_schema(
        json.dumps(schema), any_whitespace=False, separators=JSON_SEPARATORS
    )
    return GrammarFormat(grammar=str(grammar))
