"""The grammar backend on xgrammar: a spec -> a structural tag -> a compiled grammar -> matchers.

What a spec enforces (``StructuredOutputSpec`` in engine/api/sampling_params.py):

- ``json_schema``: compact JSON satisfying the schema (no whitespace between
  tokens, ``json.dumps(separators=(",", ":"))``); with tools and ``auto`` the
  output may instead be a calls block.
- ``tool_choice`` ``required`` (one or more calls of any tool; exactly one
  without ``parallel_tool_calls``) or ``function`` (exactly one call of it): a
  DSML calls block whose arguments satisfy each function's ``parameters``, then EOS.
- ``auto`` without a schema: free text, and once the model opens a calls block,
  the same calls grammar until the block closes, then EOS.
- Whitespace in a calls block is bounded: at most one character wherever the
  format allows any (the canonical layout's newline between tags).
- ``starts_in_reasoning``: free reasoning text first, up to ``</think>``.

Added tokens (``<｜User｜>``, BOS, placeholders, ...) are never allowed under a
grammar, except ``GRAMMAR_MARKERS``, which the formats use; EOS is allowed only
once the grammar is complete.

Compilation runs in a pool of its own (xgrammar releases the GIL while it
compiles), bounded by ``GrammarLimits.timeout_s``, in threads at a lower CPU
priority than the step loop's; a compiled grammar larger than
``GrammarLimits.max_bytes`` is refused (a 400 naming the limit). Compiled grammars
stay in the engine's ``GrammarCache``, an LRU bounded in bytes and keyed by the
spec, so a spec seen again costs a dictionary look-up. The vocabulary view is
built once, in the pool (``warm`` at engine start; else on the first spec); it is
read token by token so that no single call holds the GIL for long, which would
stop the step loop's thread.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from typing import Any

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

from engine.api.errors import GrammarError
from engine.api.sampling_params import StructuredOutputSpec
from engine.api.special_tokens import GRAMMAR_MARKERS, THINK_END, THINK_START
from engine.structured_output.grammar_cache import GrammarCache

logger = logging.getLogger(__name__)

# JSON output is compact: xgrammar's own JSON grammar without whitespace.
JSON_SEPARATORS = (",", ":")
# Longest whitespace run in a DSML calls block: the canonical layout puts one
# newline between tags, and no value needs more; unbounded runs let a model
# spend its whole budget on blanks and leave the call cut.
MAX_TOOL_CALL_WHITESPACE = 1
XGRAMMAR_MODEL = "deepseek_v4_1"  # xgrammar's built-in V4.1 calls-block format
# Grammar threads run this much nicer than the step loop: on a busy machine the
# loop's thread gets the CPU first and a compilation takes longer instead.
GRAMMAR_NICENESS = 5


@dataclass(frozen=True, slots=True)
class GrammarLimits:
    """Bounds on grammar work (flags of ``flashserve serve``, README "Limits")."""

    timeout_s: float = 10.0  # one compilation, wall time, queueing included
    cache_bytes: int = 256 << 20  # compiled grammars kept (LRU)
    workers: int = 2  # compilations at once
    max_bytes: int = 64 << 20  # one compiled grammar; larger: a 400

    def __post_init__(self) -> None:
        if not self.timeout_s > 0 or min(self.cache_bytes, self.workers, self.max_bytes) < 1:
            raise ValueError("GrammarLimits: every limit must be positive")


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
    """xgrammar's view of a byte-level BPE vocabulary with the added tokens masked.

    Read one token at a time: ``get_vocab`` builds the whole dictionary in one call
    that holds the GIL for 0.3-0.4 s (1.5 s on a loaded machine), long enough to
    stop every stream of the engine whose thread is waiting for it."""
    encoded = [tokenizer.id_to_token(i) or "" for i in range(vocab_size)]  # "": never
    for token_id, added in tokenizer.get_added_tokens_decoder().items():
        if token_id < vocab_size and added.content not in GRAMMAR_MARKERS:
            encoded[token_id] = ""
    return xgr.TokenizerInfo(
        encoded, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab_size, stop_token_ids=[eos_token_id]
    )


def structural_tag(spec: StructuredOutputSpec) -> StructuralTag:
    """The xgrammar structural tag enforcing ``spec``; ``GrammarError`` for a schema
    the compact-JSON converter (or the calls format) rejects."""
    try:
        body = _format(spec)
    except Exception as exc:  # xgrammar raises several types for a bad schema
        message = f"{spec.param}: cannot build a grammar: {clean_grammar_error(exc)}"
        raise GrammarError(message, param=spec.param) from exc
    if spec.starts_in_reasoning:
        reasoning = TagFormat(
            begin="", content=AnyTextFormat(excludes=[THINK_START, THINK_END]), end=THINK_END
        )
        body = SequenceFormat(elements=[reasoning, body])
    return StructuralTag(format=body)


def _format(spec: StructuredOutputSpec) -> Any:
    if spec.tools is not None and spec.tool_choice != "auto":
        return _calls_format(spec, spec.tool_choice)
    if spec.json_schema is not None:
        body: Any = _json_format(spec.json_schema)
        if spec.tools is not None:
            body = OrFormat(elements=[body, _calls_format(spec, "required")])
        return body
    # Free text until the model opens a calls block, which is then held to the same
    # grammar as a forced call (and ends the turn).
    return _calls_format(spec, "auto")


def _calls_format(spec: StructuredOutputSpec, tool_choice: str) -> Any:
    """xgrammar's V4.1 calls block for ``required``, one named function, or ``auto``
    (free text with the calls block as a triggered tag)."""
    choice: Any = tool_choice
    if tool_choice == "function":
        choice = {"type": "function", "function": {"name": spec.function_name}}
    functions = json.loads(spec.tools or "[]")
    tag = xgr.get_model_structural_tag(
        XGRAMMAR_MODEL,
        tools=[{"type": "function", "function": f} for f in functions],
        tool_choice=choice,
        reasoning="disabled",
        max_whitespace_cnt=MAX_TOOL_CALL_WHITESPACE,
        parallel_tool_calls=spec.parallel_tool_calls,
    )
    return tag.format


def _json_format(schema: str) -> GrammarFormat:
    """Compact JSON (the structural tag's JSON format always allows whitespace, so the
    grammar comes from xgrammar's JSON converter)."""
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, separators=JSON_SEPARATORS)
    return GrammarFormat(grammar=str(grammar))


class XGrammarMatcher:
    """A ``TokenMaskProvider`` backed by one xgrammar matcher (one sequence)."""

    __slots__ = ("_bitmask", "_matcher")

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)

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
        return bool(self._matcher.accept_string(text))


@dataclass(slots=True)
class XGrammarJob:
    """One spec compiling in the pool; late past ``deadline`` (``time.monotonic``)."""

    spec: StructuredOutputSpec
    future: Future[xgr.CompiledGrammar]
    deadline: float
    timeout_s: float
    vocab_size: int

    def ready(self, now: float) -> bool:
        """A compile that overruns is left to finish in its thread (xgrammar cannot be
        interrupted) and its result dropped; one that never started is cancelled, and
        the request gets a 503 (every grammar worker is busy)."""
        if self.future.done():
            self.future.result()  # raises the build's GrammarError
            return True
        if now < self.deadline:
            return False
        param = self.spec.param
        if self.future.cancel():
            raise GrammarError("Every grammar worker is busy; retry later", param=param, status=503)
        raise GrammarError(
            f"{param}: the grammar did not compile within {self.timeout_s:g} s; "
            "simplify the schema",
            param=param,
        )

    def matcher(self) -> XGrammarMatcher:
        matcher = XGrammarMatcher(self.future.result(), self.vocab_size)
        if self.spec.prefix and not matcher.accept_text(self.spec.prefix):
            raise GrammarError(
                "the assistant prefix does not fit the required output format",
                param=self.spec.prefix_param,
            )
        return matcher

    def cancel(self) -> None:
        self.future.cancel()

    def wait(self, timeout: float) -> None:
        wait_futures([self.future], timeout=max(0.0, timeout))


@dataclass(slots=True)
class StructuredOutputManager:
    """The engine's ``GrammarBackend``: compiles specs in its own threads, with the
    engine's tokenizer, and caches what it compiled (xgrammar's byte-bounded LRU)."""

    tokenizer: Tokenizer
    vocab_size: int
    eos_token_id: int
    limits: GrammarLimits = field(default_factory=GrammarLimits)
    max_threads: int = 1  # xgrammar's threads per compilation
    clock: Any = time.monotonic
    _compiler: xgr.GrammarCompiler | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _pool: ThreadPoolExecutor | None = None
    _cache: GrammarCache[xgr.CompiledGrammar] | None = None

    def __post_init__(self) -> None:
        self._cache = GrammarCache(self.limits.cache_bytes, remembered=(GrammarError,))

    def submit(self, spec: StructuredOutputSpec) -> XGrammarJob:
        future = self._workers().submit(self._compile, spec)
        timeout = self.limits.timeout_s
        return XGrammarJob(spec, future, self.clock() + timeout, timeout, self.vocab_size)

    def warm(self) -> None:
        """Build the vocabulary view now, in the pool (an engine about to serve: the
        first spec then does not pay for it while other streams run)."""
        self._workers().submit(self._grammar_compiler)

    def _workers(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    self.limits.workers, thread_name_prefix="grammar", initializer=_lower_priority
                )
            return self._pool

    def matcher_now(self, spec: StructuredOutputSpec) -> XGrammarMatcher:
        """Compile ``spec`` (bounded by the timeout) and return a matcher: for tools and
        tests that want one grammar without running an engine."""
        job = self.submit(spec)
        job.wait(self.limits.timeout_s)
        if not job.ready(self.clock()):
            job.ready(job.deadline)  # late: raises the timeout's GrammarError
        return job.matcher()

    def _compile(self, spec: StructuredOutputSpec) -> xgr.CompiledGrammar:
        # The prefix is the matchers' business (``XGrammarJob.matcher``): specs that
        # differ only there share one grammar.
        key = dataclasses.replace(spec, prefix="", prefix_param="")
        assert self._cache is not None
        return self._cache.get(key, lambda: self._build(spec), _grammar_bytes)

    def _build(self, spec: StructuredOutputSpec) -> xgr.CompiledGrammar:
        tag = structural_tag(spec)
        try:
            compiled = self._grammar_compiler().compile_structural_tag(tag)
        except Exception as exc:  # xgrammar raises several types for a bad schema
            message = f"{spec.param}: cannot build a grammar: {clean_grammar_error(exc)}"
            raise GrammarError(message, param=spec.param) from exc
        size, limit = _grammar_bytes(compiled), self.limits.max_bytes
        if size > limit:
            raise GrammarError(
                f"{spec.param}: the compiled grammar takes {size} bytes, more than this "
                f"server's limit of {limit} bytes (--max-grammar-bytes); simplify the schema",
                param=spec.param,
            )
        return compiled

    def _grammar_compiler(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                info = grammar_tokenizer_info(
                    self.tokenizer, vocab_size=self.vocab_size, eos_token_id=self.eos_token_id
                )
                # The engine's GrammarCache keeps what is compiled (keyed by the spec).
                self._compiler = xgr.GrammarCompiler(
                    info, max_threads=self.max_threads, cache_enabled=False
                )
            return self._compiler

    def cache_bytes_used(self) -> int:
        """Bytes of compiled grammars (and remembered refusals) the cache holds now."""
        return 0 if self._cache is None else self._cache.used_bytes

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)


def _grammar_bytes(compiled: xgr.CompiledGrammar) -> int:
    return int(compiled.memory_size_bytes)


def _lower_priority() -> None:
    """A grammar thread's initializer: nicer than the step loop (Linux: per thread)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), GRAMMAR_NICENESS)
    except (AttributeError, OSError) as exc:  # not Linux, or not permitted
        logger.debug("grammar threads keep the engine's priority: %s", exc)
