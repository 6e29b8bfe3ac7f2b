"""The engine's grammar cache (an LRU in bytes, one build per key) and the grammar limits
around it: the compiled-size cap, the cache keyed by the spec, the vocabulary view,
the grammar threads' priority."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import xgrammar as xgr

from engine.api.errors import GrammarError
from engine.api.sampling_params import StructuredOutputSpec
from engine.loader.tokenizer import load_tokenizer
from engine.structured_output import xgrammar_backend
from engine.structured_output.grammar_cache import REFUSAL_BYTES, GrammarCache
from engine.structured_output.xgrammar_backend import (
    GRAMMAR_NICENESS,
    GrammarLimits,
    StructuredOutputManager,
    grammar_tokenizer_info,
)

VOCAB = 129280
EOS = 1
PATTERN = "^(a|b|c|d|e|f|g|h){1,50}(x|y|z){2,40}[0-9]{3,30}$"


def patterned(n: int) -> str:
    schema = {
        "type": "object",
        "properties": {f"p{i}": {"type": "string", "pattern": PATTERN} for i in range(n)},
        "required": [f"p{i}" for i in range(n)],
    }
    return json.dumps(schema)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


# ------------------------------------------------------------------ the cache alone


def test_lru_in_bytes_evicts_the_least_recently_used() -> None:
    cache: GrammarCache[str] = GrammarCache(limit_bytes=10)
    built: list[str] = []

    def get(key: str, nbytes: int) -> str:
        return cache.get(key, lambda: built.append(key) or key * nbytes, len)

    get("a", 4), get("b", 4)
    get("a", 4)  # a hit: "a" is now the most recent
    get("c", 4)  # 12 bytes > 10: "b" (least recent) goes
    assert built == ["a", "b", "c"] and cache.used_bytes == 8 and len(cache) == 2
    get("a", 4)
    assert built == ["a", "b", "c"]
    get("b", 4)
    assert built == ["a", "b", "c", "b"] and cache.used_bytes == 8


def test_a_value_larger_than_the_bound_is_returned_not_kept() -> None:
    cache: GrammarCache[str] = GrammarCache(limit_bytes=10)
    cache.get("small", lambda: "xx", len)
    assert cache.get("big", lambda: "y" * 11, len) == "y" * 11
    assert cache.used_bytes == 2 and len(cache) == 1


def test_concurrent_requests_for_one_key_build_it_once() -> None:
    cache: GrammarCache[object] = GrammarCache(limit_bytes=100)
    release, calls, results = threading.Event(), [], []

    def build() -> object:
        calls.append(1)
        release.wait(10)
        return object()

    threads = [
        threading.Thread(target=lambda: results.append(cache.get("k", build, lambda _: 1)))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    time.sleep(0.2)  # all three are in: one builds, two wait on it
    release.set()
    for t in threads:
        t.join(10)
    assert len(calls) == 1 and len(results) == 3
    assert results[0] is results[1] is results[2]


def test_remembered_refusals_are_raised_again_without_a_rebuild() -> None:
    cache: GrammarCache[str] = GrammarCache(limit_bytes=1 << 20, remembered=(ValueError,))
    calls = []

    def refuse() -> str:
        calls.append(1)
        raise ValueError("no")

    def crash() -> str:
        calls.append(2)
        raise RuntimeError("transient")

    for _ in range(2):
        with pytest.raises(ValueError):
            cache.get("bad", refuse, len)
    assert calls == [1] and cache.used_bytes == REFUSAL_BYTES
    for _ in range(2):
        with pytest.raises(RuntimeError):
            cache.get("flaky", crash, len)
    assert calls == [1, 2, 2]  # not remembered: built again


# ------------------------------------------------------------- in the grammar backend


def test_a_grammar_past_the_cap_is_a_400_naming_the_limit(tokenizer) -> None:
    """Its compiled size, measured by plain xgrammar (a second compiler), decides: at
    the cap it compiles, one byte under it is refused, and the refusal is remembered."""
    spec = StructuredOutputSpec(json_schema=patterned(1))
    info = grammar_tokenizer_info(tokenizer, vocab_size=VOCAB, eos_token_id=EOS)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    size = compiler.compile_structural_tag(xgrammar_backend.structural_tag(spec)).memory_size_bytes
    assert size > 100_000

    at_cap = StructuredOutputManager(tokenizer, VOCAB, EOS, GrammarLimits(max_bytes=size))
    assert at_cap.matcher_now(spec).allowed_tokens() is not None
    assert at_cap.cache_bytes_used() == size
    at_cap.close()

    under = StructuredOutputManager(tokenizer, VOCAB, EOS, GrammarLimits(max_bytes=size - 1))
    for _ in range(2):
        with pytest.raises(GrammarError) as caught:
            under.matcher_now(spec)
        error = caught.value
        assert error.status == 400 and error.param == "response_format"
        assert f"takes {size} bytes" in error.message and str(size - 1) in error.message
        assert "--max-grammar-bytes" in error.message
    assert under.cache_bytes_used() == REFUSAL_BYTES  # kept as a refusal, not a grammar
    under.close()


def test_the_cache_is_keyed_by_the_spec_and_prefixes_share_a_grammar(
    tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hit skips building the structural tag (a fifth of a second of GIL-holding
    Python for a heavy schema); specs differing only in their prefix share one grammar,
    and each matcher still starts past its own prefix."""
    built = []
    real = xgrammar_backend.structural_tag
    monkeypatch.setattr(
        xgrammar_backend, "structural_tag", lambda spec: built.append(spec) or real(spec)
    )
    manager = StructuredOutputManager(tokenizer, VOCAB, EOS)
    plain = StructuredOutputSpec(json_schema='{"type":"object"}')
    opened = StructuredOutputSpec(json_schema='{"type":"object"}', prefix="{")
    fresh, again, past_brace = (manager.matcher_now(s) for s in (plain, plain, opened))
    assert len(built) == 1
    assert fresh.accept_text("{") and again.accept_text("{")
    assert not past_brace.accept_text("{")  # already past its prefix's brace
    assert past_brace.accept_text("}") and past_brace.is_completed()
    manager.close()


def test_the_vocabulary_view_is_the_tokenizers_whole_vocabulary(tokenizer) -> None:
    """Read token by token (no GIL-holding ``get_vocab``), it is the same view: every id
    that ``get_vocab`` maps, with the added tokens other than the markers masked."""
    info = grammar_tokenizer_info(tokenizer, vocab_size=VOCAB, eos_token_id=EOS)
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    masked = {
        i
        for i, t in tokenizer.get_added_tokens_decoder().items()
        if t.content not in xgrammar_backend.GRAMMAR_MARKERS
    }
    expected = [""] * VOCAB
    for token, i in vocab.items():
        if i < VOCAB and i not in masked:
            expected[i] = token
    # xgrammar's decoded view: byte-level tokens come back as their bytes.
    reference = xgr.TokenizerInfo(
        expected, xgr.VocabType.BYTE_LEVEL, vocab_size=VOCAB, stop_token_ids=[EOS]
    )
    assert info.decoded_vocab == reference.decoded_vocab
    assert info.vocab_size == VOCAB and list(info.stop_token_ids) == [EOS]


@pytest.mark.skipif(not hasattr(os, "setpriority"), reason="no per-thread priority here")
def test_grammar_threads_run_nicer_than_the_step_loop(tokenizer) -> None:
    manager = StructuredOutputManager(tokenizer, VOCAB, EOS)
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    pool = manager._workers()
    nice = pool.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
    assert nice.result(10) == min(19, base + GRAMMAR_NICENESS)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base
    manager.close()


def test_warm_builds_the_vocabulary_view_before_any_spec(tokenizer) -> None:
    """An engine about to serve calls ``warm`` (engine/loader/builder.py): the first
    spec then finds the compiler ready instead of building it while streams run."""
    manager = StructuredOutputManager(tokenizer, VOCAB, EOS)
    assert manager._compiler is None
    manager.warm()
    manager._workers().submit(lambda: None).result(60)  # queued after the warm-up
    deadline = time.monotonic() + 60
    while manager._compiler is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert manager._compiler is not None
    manager.close()
