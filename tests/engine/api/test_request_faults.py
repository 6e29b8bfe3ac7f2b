"""A fault in one request's mask provider, sampling or stop handling ends that request
with an error and leaves the engine serving everyone else (docs/design/hardening.md).

The fake engine's logits put all mass on a token chosen from the sequence, so the
request that does not fail must produce exactly the tokens it produces alone.
"""

from __future__ import annotations

import asyncio

import pytest
import torch
from engine_helpers import fake_engine, greedy, run_to_completion, token_stream

from engine.api.async_engine import AsyncEngine
from engine.api.errors import RequestError, RequestFailedError
from engine.api.request import Request
from engine.api.sampling_params import SamplingParams, StructuredOutputSpec
from engine.sample.sampler import apply_token_masks

VOCAB = 64


class ScriptedMask:
    """A mask provider that allows every token for ``ok_steps`` steps, then misbehaves
    in the way ``fault`` names: ``empty`` (allows nothing), ``raise`` (its mask call
    raises), ``accept`` (rejects the token with a TypeError), ``terminated``."""

    def __init__(self, fault: str, ok_steps: int = 1) -> None:
        self.fault, self.ok_steps, self.steps = fault, ok_steps, 0

    def allowed_tokens(self) -> torch.Tensor | None:
        self.steps += 1
        if self.steps <= self.ok_steps:
            return torch.ones(VOCAB, dtype=torch.bool)
        if self.fault == "empty":
            return torch.zeros(VOCAB, dtype=torch.bool)
        if self.fault == "raise":
            raise KeyError("internal state of the provider")
        return torch.ones(VOCAB, dtype=torch.bool)

    def accept(self, token_id: int) -> None:
        if self.fault == "accept" and self.steps > self.ok_steps:
            raise TypeError("provider bug")

    def is_terminated(self) -> bool:
        if self.fault == "terminated" and self.steps > self.ok_steps:
            raise RuntimeError("provider bug in the stop check")
        return False


class ScriptedGrammars:
    """A grammar backend whose jobs are ready at once and hand out ``masks`` in turn,
    one per request (a request's own grammar state, as the engine keeps it)."""

    def __init__(self, *masks: ScriptedMask) -> None:
        self.masks = list(masks)

    def submit(self, spec: StructuredOutputSpec) -> ScriptedGrammars:
        return self

    def ready(self, now: float) -> bool:
        return True

    def matcher(self) -> ScriptedMask:
        return self.masks.pop(0)

    def cancel(self) -> None:
        pass

    def wait(self, timeout: float) -> None:
        pass

    def close(self) -> None:
        pass


# What the request asks for is the backend's business: any spec will do.
SPEC = StructuredOutputSpec(json_schema='{"type":"object"}')


def test_a_dead_mask_row_fails_alone_and_is_left_unmasked() -> None:
    logits = torch.zeros(2, VOCAB)
    masks = [ScriptedMask("empty", ok_steps=0), ScriptedMask("empty", ok_steps=5)]
    failed = apply_token_masks(logits, masks)
    assert list(failed) == [0] and isinstance(failed[0], RequestError)
    assert "allows no next token" in str(failed[0])
    assert torch.equal(logits, torch.zeros(2, VOCAB))  # nothing masked: row 1 allows all


@pytest.mark.parametrize("fault", ["empty", "raise", "accept", "terminated"])
def test_a_failing_request_ends_with_an_error_and_the_others_run_on(fault: str) -> None:
    alone, _ = fake_engine(vocab_size=VOCAB)
    alone.add_request(Request("good", list(range(3, 20)), greedy(6)))
    expected = token_stream(run_to_completion(alone)["good"])
    assert len(expected) == 6

    engine, _ = fake_engine(vocab_size=VOCAB, grammars=ScriptedGrammars(ScriptedMask(fault)))
    engine.add_request(Request("good", list(range(3, 20)), greedy(6)))
    bad = SamplingParams(max_tokens=6, ignore_eos=True, structured=SPEC)
    engine.add_request(Request("bad", list(range(5, 30)), bad))
    outputs = run_to_completion(engine)

    last = outputs["bad"][-1]
    assert last.finished and last.error is not None
    assert [c.finish_reason for c in last.outputs] == ["error"]
    assert isinstance(last.error, RequestError) == (fault == "empty")
    assert token_stream(outputs["good"]) == expected
    assert outputs["good"][-1].error is None
    # The failed request's pages are back and the engine takes new work.
    assert engine.kv.stats().device_pages_in_use == 0
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.counters.finished.get("error") == 1
    engine.add_request(Request("next", list(range(3, 20)), greedy(6)))
    assert token_stream(run_to_completion(engine)["next"]) == expected


def test_async_engine_raises_the_request_error_and_keeps_running() -> None:
    grammars = ScriptedGrammars(ScriptedMask("empty"), ScriptedMask("raise"))
    engine, _ = fake_engine(vocab_size=VOCAB, grammars=grammars)
    ae = AsyncEngine(engine.config, engine=engine)
    try:

        async def run() -> list[int]:
            bad = SamplingParams(max_tokens=6, structured=SPEC)
            with pytest.raises(RequestError):
                async for _ in ae.generate(Request("bad", [5, 6, 7], bad)):
                    pass
            assert ae.is_running
            outs = [o async for o in ae.generate(Request("next", list(range(3, 20)), greedy(4)))]
            return [t for o in outs for c in o.outputs for t in c.token_ids]

        assert len(asyncio.run(asyncio.wait_for(run(), 10))) == 4

        async def bug() -> None:  # not the request's fault: a generic error, cause chained
            bad = SamplingParams(max_tokens=6, structured=SPEC)
            with pytest.raises(RequestFailedError) as info:
                async for _ in ae.generate(Request("bug", [5, 6, 7], bad)):
                    pass
            assert isinstance(info.value.__cause__, KeyError)
            assert "internal state" not in str(info.value)

        asyncio.run(asyncio.wait_for(bug(), 10))
        assert ae.is_running and ae.stats().running == 0
    finally:
        ae.shutdown()


class BlockingRunner:
    """Wraps a runner; ``execute`` waits on ``gate`` (a step that takes as long as the
    test wants, as a hung SSD read or a huge batch would)."""

    def __init__(self, inner) -> None:
        import threading

        self.inner, self.gate, self.entered = inner, threading.Event(), threading.Event()

    def execute(self, batch):
        self.entered.set()
        assert self.gate.wait(10)
        return self.inner.execute(batch)

    def release(self, seq) -> None:
        self.inner.release(seq)


def test_heartbeat_and_queue_counts_stay_true_while_a_step_hangs() -> None:
    """``stats`` counts what is running and waiting during a long step, and
    ``stalled_for`` grows while work is pending (what /health reads)."""
    import time

    engine, runner = fake_engine(vocab_size=VOCAB, max_num_seqs=1)
    blocking = BlockingRunner(runner)
    engine.runner = blocking
    engine.scheduler._release = blocking.release
    ae = AsyncEngine(engine.config, engine=engine)
    try:
        assert ae.stalled_for() == 0.0  # idle: nothing pending

        async def run() -> None:
            first = asyncio.ensure_future(_drain(ae, Request("a", [3, 4, 5], greedy(2))))
            assert await asyncio.to_thread(blocking.entered.wait, 5)
            second = asyncio.ensure_future(_drain(ae, Request("b", [3, 4, 6], greedy(2, n=3))))
            await asyncio.sleep(0.3)
            stats = ae.stats()
            assert (stats.running, stats.waiting) == (1, 3)  # mid-step, not the old snapshot
            assert ae.stalled_for() >= 0.25
            blocking.gate.set()
            await asyncio.wait_for(asyncio.gather(first, second), 10)
            assert ae.stalled_for() == 0.0
            assert (ae.stats().running, ae.stats().waiting) == (0, 0)

        started = time.monotonic()
        asyncio.run(run())
        assert time.monotonic() - started < 10
    finally:
        blocking.gate.set()
        ae.shutdown()


async def _drain(ae: AsyncEngine, request: Request) -> None:
    async for _ in ae.generate(request):
        pass
