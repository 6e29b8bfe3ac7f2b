"""AsyncEngine: concurrent streams from asyncio, early close and abort free pages."""

from __future__ import annotations

import asyncio
import time

import pytest
from engine_helpers import greedy, prompt, reference_engine

from engine.api.async_engine import AsyncEngine, EngineDeadError
from engine.api.errors import RequestError
from engine.api.request import Request
from engine.config import EngineConfig


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


def test_closing_the_iterator_early_aborts_and_frees_pages(async_engine):
    async def main():
        stream = async_engine.generate(Request("long", prompt(40, 9), greedy(500)))
        first = await stream.__anext__()
        assert not first.finished and len(tokens_of([first])) == 1
        assert async_engine.stats().kv.device_pages_in_use > 0
        await stream.aclose()
        await wait_for(lambda: async_engine.stats().kv.device_pages_in_use == 0)
        assert async_engine.stats().counters.finished == {"abort": 1}

        # An id is free again as soon as its consumer closes, and the new
        # stream sees nothing of the old request.
        stream = async_engine.generate(Request("again", prompt(40, 9), greedy(500)))
        await stream.__anext__()
        await stream.aclose()
        again = await collect(async_engine, Request("again", prompt(40, 9), greedy(2)))
        assert len(tokens_of(again)) == 2 and again[-1].outputs[0].finish_reason == "length"
        await wait_for(lambda: async_engine.stats().kv.device_pages_in_use == 0)

    asyncio.run(main())
    stats = async_engine.stats()
    assert stats.counters.finished == {"abort": 2, "length": 1}
    assert stats.running == stats.waiting == 0


def test_cancelled_consumer_and_explicit_abort(async_engine):
    async def main():
        started = asyncio.Event()

        async def consume(rid: str) -> list:
            outs = []
            async for out in async_engine.generate(Request(rid, prompt(20, 11), greedy(500))):
                outs.append(out)
                started.set()
            return outs

        task = asyncio.create_task(consume("cancelled"))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_for(lambda: async_engine.stats().counters.finished.get("abort") == 1)

        # abort() from outside: the consumer sees the final "abort" output.
        started.clear()
        task = asyncio.create_task(consume("aborted"))
        await started.wait()
        async_engine.abort("aborted")
        outs = await task
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        await wait_for(lambda: async_engine.stats().kv.device_pages_in_use == 0)

    asyncio.run(main())


def test_invalid_and_duplicate_requests_raise(async_engine):
    async def main():
        with pytest.raises(RequestError, match="empty") as empty:
            await collect(async_engine, Request("e", [], greedy(1)))
        assert empty.value.param == "prompt_token_ids"
        stream = async_engine.generate(Request("d", prompt(12, 1), greedy(100)))
        await stream.__anext__()
        with pytest.raises(ValueError, match="already in flight"):
            await collect(async_engine, Request("d", prompt(12, 1), greedy(1)))
        await stream.aclose()

    asyncio.run(main())


def test_tiny_engine_builds_generates_and_shuts_down():
    ae = AsyncEngine(EngineConfig(runner="reference", page_tokens=16, kv_cache_bytes=1 << 22))
    try:
        outputs = asyncio.run(collect(ae, Request("t", prompt(12, 5), greedy(3))))
        assert len(tokens_of(outputs)) == 3 and outputs[-1].finished
        assert outputs[-1].usage.completion_tokens == 3
    finally:
        ae.shutdown()
    assert not ae.is_running
    with pytest.raises(EngineDeadError):
        asyncio.run(collect(ae, Request("late", prompt(12, 5), greedy(1))))
