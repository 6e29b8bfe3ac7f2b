"""AsyncEngine alone: over a prebuilt engine its streams match the float64 oracle, and a
step that raises fails every stream and stops the loop. What it shares with the core
process's client is tested once for both in test_engine_client.py."""

from __future__ import annotations

import asyncio
import time

import pytest
from engine_helpers import fake_engine, greedy, prompt, reference_engine

from engine.api.async_engine import AsyncEngine
from engine.api.errors import EngineDeadError
from engine.api.request import Request


@pytest.fixture
def async_engine(engine_model):
    engine, runner = reference_engine(engine_model)
    ae = AsyncEngine(engine.config, engine=engine)
    ae.runner = runner  # type: ignore[attr-defined]
    yield ae
    ae.shutdown()


async def collect(ae: AsyncEngine, request: Request) -> list:
    return [out async for out in ae.generate(request)]


async def wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


def tokens_of(outputs) -> list[int]:
    return [t for out in outputs for c in out.outputs for t in c.token_ids]


def test_concurrent_generate_streams_match_reference(async_engine, oracle):
    prompts = {"x": prompt(23, 102), "y": prompt(45, 105), "z": prompt(10, 100)}

    async def main():
        ticks = 0
        done = asyncio.Event()

        async def ticker():
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0.005)

        tick_task = asyncio.create_task(ticker())
        results = await asyncio.gather(
            *(collect(async_engine, Request(rid, p, greedy(2))) for rid, p in prompts.items())
        )
        done.set()
        await tick_task
        return dict(zip(prompts, results, strict=True)), ticks

    results, ticks = asyncio.run(main())
    for rid, tokens in prompts.items():
        outputs = results[rid]
        assert outputs[-1].finished and all(not o.finished for o in outputs[:-1])
        assert tokens_of(outputs) == oracle(tokens, 2).tokens
    # The event loop kept running while the engine thread computed.
    assert ticks >= 5
    assert async_engine.stats().counters.requests_finished == 3


class FailingRunner:
    """Wraps a runner; ``execute`` raises once ``fail`` is set (a step that blows up)."""

    def __init__(self, inner) -> None:
        import threading

        self.inner, self.fail = inner, threading.Event()

    def execute(self, batch):
        if self.fail.is_set():
            raise RuntimeError("the device fell over")
        return self.inner.execute(batch)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_failed_step_fails_every_stream_and_stops_the_loop():
    engine, runner = fake_engine()
    failing = FailingRunner(runner)
    engine.runner = failing
    ae = AsyncEngine(engine.config, engine=engine)
    try:

        async def main():
            outs: dict[str, list] = {"x": [], "y": []}

            async def consume(rid: str) -> None:
                async for out in ae.generate(Request(rid, [3, 4, 5], greedy(10_000))):
                    outs[rid].append(out)

            tasks = [asyncio.create_task(consume(rid)) for rid in outs]
            await wait_for(lambda: all(outs.values()))
            failing.fail.set()
            for task in tasks:
                with pytest.raises(EngineDeadError, match=r"engine step failed.*fell over"):
                    await asyncio.wait_for(task, 10)
            await wait_for(lambda: not ae.is_running)
            # New requests are refused, the step's exception chained.
            with pytest.raises(EngineDeadError, match="not running") as info:
                await collect(ae, Request("late", [3, 4], greedy(1)))
            assert isinstance(info.value.__cause__, RuntimeError)

        asyncio.run(main())
    finally:
        ae.shutdown(timeout=10)
