"""Test proposers with a known answer, and an engine that records every verify row.

The proposers draft from a stream a plain (non-speculative) run produced, so the
test knows which drafts the verify step must accept: ``oracle`` drafts the true
continuation (all accepted), ``wrong`` never does (all rejected), ``mixed`` is
right for the first ``j`` drafts and wrong after, ``j`` cycling with the position.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass

import torch
from engine_helpers import keep_first_writes, make_local_kv

from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.sequence import Sequence
from engine.core.step import StepBatch
from engine.model.deepseek_v41.reference import GlobalKV, ReplayPlan, forward
from engine.model.kv.dense_backend import KVPrecision
from engine.runner.model_runner import PagedModelRunner
from engine.runner.reference_runner import ReferenceRunner
from engine.spec_decode.proposer import Draft

K = 3  # num_speculative_tokens of these tests


class ScriptedProposer:
    """Drafts from ``streams[(request id, choice)]`` (prompt + the plain run's output)."""

    hidden_layers: tuple[int, ...] = ()

    def __init__(
        self,
        streams: dict[tuple[str, int], list[int]],
        modes: dict[str, str],
        strict: bool = True,
    ) -> None:
        self.streams = streams
        self.modes = modes  # request id -> oracle / wrong / mixed
        self.strict = strict  # the sequence must follow its stream
        self.released: list[int] = []
        self.calls = 0

    def propose(
        self, seq: Sequence, k: int, hidden: dict[int, torch.Tensor] | None = None
    ) -> Draft:
        self.calls += 1
        if seq.token_ids != self.streams[seq.request_id, seq.index][: seq.num_tokens]:
            assert not self.strict, "the speculative stream left the plain one"
            return Draft([wrong(t) for t in seq.token_ids[-k:]])
        truth = self.streams[seq.request_id, seq.index][seq.num_tokens : seq.num_tokens + k]
        mode = self.modes.get(seq.request_id, "mixed")
        right = {"oracle": len(truth), "wrong": 0}.get(mode, self.calls % (k + 1))
        return Draft(truth[:right] + [wrong(t) for t in truth[right:]])

    def release(self, seq: Sequence) -> None:
        self.released.append(seq.seq_id)


def wrong(token: int) -> int:
    """A token that is not ``token`` (the row's true sample)."""
    return token + 1 if token < 100 else token - 1


@dataclass(slots=True)
class Row:
    """What one step ran for one sampled sequence: tokens before its drafts, the drafts,
    and the logits of each row."""

    num_tokens: int
    drafts: int
    logits: torch.Tensor  # [drafts + 1, vocab]


class VerifyRecorder:
    """Wraps a runner; records each sampled sequence's rows, step by step."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.rows: dict[tuple[str, int], list[Row]] = defaultdict(list)
        self.batches: list[StepBatch] = []
        # (request id, choice) -> (tokens, stored tokens) of each admission's last chunk.
        self.admissions: dict[tuple[str, int], list[tuple[int, int]]] = defaultdict(list)

    def execute(self, batch: StepBatch) -> dict[int, torch.Tensor]:
        self.batches.append(batch)
        for chunk in batch.prefills:
            if chunk.last:
                s = chunk.seq
                self.admissions[s.request_id, s.index].append((s.prefill_end, s.stored_tokens))
        out = self.inner.execute(batch)
        for seq in batch.sampled():
            k = batch.num_drafts(seq)
            logits = out[seq.seq_id]
            assert logits.dim() == (2 if k else 1)
            logits = logits if k else logits[None]
            assert logits.shape[0] == k + 1
            self.rows[seq.request_id, seq.index].append(
                Row(seq.num_tokens - k, k, logits.double().clone())
            )
        return out

    def release(self, seq: Sequence) -> None:
        self.inner.release(seq)

    def __getattr__(self, name: str):
        # The inner runner's optional parts (prompt scores, hidden states, close).
        return getattr(self.inner, name)

    def committed(self, key: tuple[str, int], final_tokens: int) -> list[tuple[Row, int]]:
        """Each step's row record with the tokens it committed (the next step's start,
        or the sequence's final length, minus its own)."""
        rows = self.rows[key]
        ends = [r.num_tokens for r in rows[1:]] + [final_tokens]
        return [(r, end - r.num_tokens) for r, end in zip(rows, ends, strict=True)]

    def token_logits(self, key: tuple[str, int], final_tokens: int) -> list[torch.Tensor]:
        """The logits each committed token was sampled from, in order."""
        return [r.logits[i] for r, n in self.committed(key, final_tokens) for i in range(n)]


def dense_stream(model, tokens: list[int], admissions, max_tokens: int, window: int):
    """Greedy tokens and logits from dense forwards, one replay plan per admission
    (``(tokens, stored tokens)``): admission ``i`` reads the global KV of its stored
    prefix as the first forward that completed each entry computed it (pages are
    written once per committed entry). The oracle of a stream that was preempted."""
    tokens = list(tokens)
    out: list[int] = []
    logits: list[torch.Tensor] = []
    ratios = {l: model.config.compress_ratios[l] for l in model.config.kv_source_layer_ids}
    written = GlobalKV()
    for i, (length, stored_tokens) in enumerate(admissions):
        assert length == len(tokens)
        plan = ReplayPlan.prefill(model.config, length, window, stored_tokens=stored_tokens)
        stored = written.prefix(stored_tokens, ratios) if stored_tokens else None
        end = admissions[i + 1][0] if i + 1 < len(admissions) else None
        while len(out) < max_tokens and (end is None or len(tokens) < end):
            result = forward(model, torch.tensor(tokens), plan, stored)
            logits.append(result.logits[-1].double())
            tokens.append(int(result.logits[-1].argmax()))
            out.append(tokens[-1])
            keep_first_writes(written, result.global_kv)
    return out, logits


def spec_config(k: int = K, **extra) -> str:
    return json.dumps({"method": "ngram", "num_speculative_tokens": k, **extra})


def make_engine(
    model,
    runner: str,
    proposer=None,
    num_pages: int = 64,
    tokenizer=None,
    grammars=None,
    **config,
):
    """(engine, recorder, device pages) over ``runner``; speculative when ``proposer``."""
    config.setdefault("page_tokens", 8)
    if proposer is not None:
        config.setdefault("speculative_config", spec_config())
    cfg = EngineConfig(runner=runner, **config)
    kv, pages = make_local_kv(num_pages, cfg.page_tokens, None, cfg.kv_dtype)
    if runner == "reference":
        inner = ReferenceRunner(model, pages, KVPrecision(global_kv=cfg.kv_dtype))
    else:
        inner = PagedModelRunner(model, pages, cfg.max_num_seqs)
    recorder = VerifyRecorder(inner)
    engine = LLMEngine(
        cfg,
        recorder,
        kv,
        model_config=model.config,
        proposer=proposer,
        tokenizer=tokenizer,
        grammars=grammars or (NoGrammars() if tokenizer is not None else None),
    )
    return engine, recorder, pages


class NoGrammars:
    """A grammar backend for tests with a tokenizer but no structured output (the real
    one would build its vocabulary view)."""

    def submit(self, spec):
        raise AssertionError("no grammars in this test")

    def warm(self) -> None:
        pass

    def close(self) -> None:
        pass


def cached_pages(engine: LLMEngine, pages) -> dict[bytes, bytes]:
    """Every cached page's hash -> its bytes in every kv source (main and index)."""
    out = {}
    for page_hash, page in engine.kv.pool.hash_to_page.items():
        parts = []
        for source in pages.layout.sources:
            sp = pages.source(source.layer_id)
            parts += [sp.main[page].cpu().numpy().tobytes(), sp.index[page].cpu().numpy().tobytes()]
        out[page_hash] = b"".join(parts)
    return out
