"""Runners and builders shared by the scheduler, engine and async engine tests."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.api.sampling_params import SamplingParams
from engine.config import EngineConfig
from engine.core.llm_engine import LLMEngine
from engine.core.sequence import Sequence
from engine.core.step import StepBatch
from engine.model.deepseek_v41.config import ModelConfig
from engine.model.kv.dense_backend import GlobalKV, KVPrecision
from engine.runner.model_runner import PagedModelRunner
from engine.runner.reference_runner import ReferenceRunner
from kvstore.device.layout import kv_layout
from kvstore.local import LocalKV, open_local_kv
from kvstore.manager import KVCacheManager

TINY = ModelConfig.tiny()
W = 16  # the tiny model's sliding window = default replay window
ATOL = 1e-4  # logits of an engine run vs the oracle


def ratios(model) -> dict[int, int]:
    return {l: model.config.compress_ratios[l] for l in model.config.kv_source_layer_ids}


def assert_matches(runner, rid: str, outputs, expected: list[int], logits: list[torch.Tensor]):
    """Greedy tokens equal ``expected`` and every step's logits are within ``ATOL``."""
    assert token_stream(outputs[rid]) == expected
    got = runner.logits[rid, 0]
    assert len(got) == len(logits)
    for step, (a, b) in enumerate(zip(got, logits, strict=True)):
        diff = (a - b).abs().max().item()
        assert diff < ATOL, f"{rid}: step {step} logits differ by {diff}"


def assert_same_answer(runner, rid: str, outputs, cold) -> None:
    """A cache hit never changes the answer: ``rid``'s stream equals the cold run ``cold``.

    float64 models: logits to rounding (1e-9). fp32: the restore computes other
    row counts than the cold run, so GEMMs round differently by ~1e-7, and an
    FP4/FP8 code sitting on a rounding boundary can flip (a ~1e-3 jump in the
    logits; docs/design/semantics.md): greedy tokens equal, logits within 2e-2.
    """
    assert token_stream(outputs[rid]) == cold.tokens
    got = runner.logits[rid, 0]
    atol = 1e-9 if cold.logits[0].dtype == torch.float64 else 2e-2
    for step, (a, b) in enumerate(zip(got, cold.logits, strict=True)):
        diff = (a.double() - b.double()).abs().max().item()
        assert diff < atol, f"{rid}: step {step}: restored and cold logits differ by {diff}"


def prompt(n: int, seed: int) -> list[int]:
    """``n`` random token ids (seeded), away from BOS/EOS/pad."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 129000, (n,), generator=g).tolist()


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def make_kv(
    num_pages: int,
    page_tokens: int = 8,
    kv_dir=None,
    kv_dtype: str = "fp4",
) -> KVCacheManager:
    """A KV manager with the tiny model's layout and exactly ``num_pages`` pages."""
    return make_local_kv(num_pages, page_tokens, kv_dir, kv_dtype).manager


def make_local_kv(
    num_pages: int,
    page_tokens: int = 8,
    kv_dir=None,
    kv_dtype: str = "fp4",
) -> LocalKV:
    """``make_kv``'s manager and the page pool a runner writes."""
    layout = kv_layout(TINY.kv_source_layer_ids, TINY.compress_ratios, page_tokens, kv_dtype)
    return open_local_kv(layout, num_pages * layout.page_bytes, kv_dir=kv_dir)


class CheckingRunner:
    """A model-free runner that asserts the ModelRunner contract on every call.

    Logits put all mass on ``next_token(seq)`` (default: a hash of the tokens
    so far), so the engine's sampling is deterministic and cheap.
    """

    def __init__(
        self,
        kv: KVCacheManager,
        vocab_size: int,
        next_token: Callable[[Sequence], int] | None = None,
    ) -> None:
        self.kv = kv
        self.vocab_size = vocab_size
        self.next_token = next_token or (lambda s: (sum(s.token_ids) * 31 + s.num_tokens) % 61 + 3)
        self.released: list[int] = []
        self.batches: list[StepBatch] = []

    def execute(self, batch: StepBatch) -> dict[int, torch.Tensor]:
        pt = self.kv.page_tokens
        self.batches.append(batch)
        out = {}
        for seq in batch.decodes:
            assert not seq.in_prefill and seq.num_computed == seq.num_tokens - 1
            assert len(seq.block_table) * pt >= seq.num_tokens
            out[seq.seq_id] = self._logits(seq)
        for chunk in batch.prefills:
            seq = chunk.seq
            if seq.prefill_only and chunk.start == chunk.end:  # every page hit
                assert chunk.last and chunk.end == seq.prefill_end == seq.stored_tokens
            else:
                assert chunk.start == seq.num_computed < chunk.end <= seq.prefill_end
            assert chunk.last == (chunk.end == seq.prefill_end)
            assert len(seq.block_table) * pt >= chunk.end
            if seq.prefill_only:  # no decoder rows, so no logits
                assert seq.decoder_start == seq.prefill_end
            elif chunk.last:
                out[seq.seq_id] = self._logits(seq)
        for seq in [*batch.decodes, *(c.seq for c in batch.prefills)]:
            assert seq.block_table == self.kv.block_table(seq.seq_id)
        return out

    def release(self, seq: Sequence) -> None:
        self.released.append(seq.seq_id)

    def _logits(self, seq: Sequence) -> torch.Tensor:
        logits = torch.zeros(self.vocab_size)
        logits[self.next_token(seq)] = 10.0
        return logits


class RecordingRunner:
    """Wraps a runner; records, per (request id, choice index), the logits of every
    step and the plan of every admission that ran its last prefill chunk."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.logits: dict[tuple[str, int], list[torch.Tensor]] = defaultdict(list)
        self.admissions: dict[tuple[str, int], list[Admission]] = defaultdict(list)
        self.max_prefills_per_step = 0

    def execute(self, batch: StepBatch) -> dict[int, torch.Tensor]:
        self.max_prefills_per_step = max(self.max_prefills_per_step, len(batch.prefills))
        for chunk in batch.prefills:
            if chunk.last:
                s = chunk.seq
                self.admissions[s.request_id, s.index].append(
                    Admission(s.prefill_end, s.stored_tokens, s.encoder_start, s.decoder_start)
                )
        out = self.inner.execute(batch)
        for seq in batch.sampled():
            self.logits[seq.request_id, seq.index].append(out[seq.seq_id].clone())
        return out

    def release(self, seq: Sequence) -> None:
        self.inner.release(seq)

    def take_prompt_logprobs(self):
        return self.inner.take_prompt_logprobs()


@dataclass(frozen=True, slots=True)
class Admission:
    """The plan an admission ran its last prefill chunk with."""

    num_tokens: int  # L
    stored_tokens: int  # H
    encoder_start: int  # e0
    decoder_start: int  # d0


def fake_engine(
    num_pages: int = 64,
    vocab_size: int = 64,
    next_token: Callable[[Sequence], int] | None = None,
    tokenizer=None,
    grammars=None,
    **config,
) -> tuple[LLMEngine, CheckingRunner]:
    config.setdefault("page_tokens", 8)
    cfg = EngineConfig(runner="reference", **config)
    kv = make_kv(num_pages, cfg.page_tokens)
    runner = CheckingRunner(kv, vocab_size, next_token)
    engine = LLMEngine(
        cfg,
        runner,
        kv,
        model_config=TINY,
        vocab_size=vocab_size,
        tokenizer=tokenizer,
        grammars=grammars,
    )
    return engine, runner


def reference_engine(
    model, num_pages: int = 64, kv_dir=None, runner: str = "reference", **config
) -> tuple[LLMEngine, RecordingRunner]:
    """An engine over the dense ReferenceRunner (or the paged runner), recording
    logits and admissions."""
    config.setdefault("page_tokens", 8)
    cfg = EngineConfig(runner=runner, **config)
    kv, pages = make_local_kv(num_pages, cfg.page_tokens, kv_dir, cfg.kv_dtype)
    if runner == "reference":
        inner = ReferenceRunner(model, pages, KVPrecision(global_kv=cfg.kv_dtype))
    else:
        inner = PagedModelRunner(model, pages, cfg.max_num_seqs)
    runner = RecordingRunner(inner)
    engine = LLMEngine(
        cfg,
        runner,
        kv,
        model_config=model.config,
        encoder_only=model.encoder_only,
    )
    return engine, runner


def run_to_completion(engine: LLMEngine, max_steps: int = 10_000) -> dict[str, list]:
    """Step until idle; every output of every request, by request id."""
    outputs: dict[str, list] = defaultdict(list)
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return outputs
        for out in engine.step():
            outputs[out.request_id].append(out)
    raise AssertionError(f"engine still busy after {max_steps} steps")


def token_stream(outputs: list, index: int = 0) -> list[int]:
    return [t for out in outputs for c in out.outputs if c.index == index for t in c.token_ids]


def keep_first_writes(written: GlobalKV, new: GlobalKV) -> None:
    """Add ``new``'s entries past those ``written`` holds: a page is written once, by
    the first forward that completed it (what a dense oracle of a paged run reads)."""
    for table, fresh in ((written.latents, new.latents), (written.keys, new.keys)):
        for layer, values in fresh.items():
            old = table.get(layer, values[:0])
            table[layer] = torch.cat([old, values[old.shape[0] :]])
