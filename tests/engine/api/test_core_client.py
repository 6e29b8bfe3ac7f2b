"""The engine core in its own process (``EngineCoreClient``): the same outputs as the
in-process engine, abort and early close, refusals in the API process, a killed core,
graceful shutdown."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import time

import pytest

from engine.api.async_engine import AsyncEngine, EngineDeadError
from engine.api.core_client import EngineCoreClient
from engine.api.errors import RequestError
from engine.api.request import Request
from engine.api.sampling_params import SamplingParams
from engine.config import EngineConfig

# float64: both engines give bit-identical logits whatever their step batches are.
CONFIG = EngineConfig(
    max_num_seqs=4, page_tokens=16, kv_cache_bytes=4 << 20, max_model_len=256, dtype="float64"
)
TIMEOUT_S = 60.0


def params(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def requests() -> list[Request]:
    return [
        Request("a", [0, 19, 881, 2043, 77], params(6, logprobs=2)),
        Request("b", [0, 5, 6, 7, 8, 9, 10] * 3, params(5, n=2, prompt_logprobs=1)),
        Request("c", [0, 4096, 12, 13], params(4, ignore_eos=True, stop_token_ids=[3])),
    ]


async def run_all(engine, reqs: list[Request]) -> dict[str, list]:
    async def one(r: Request) -> list:
        return [out async for out in engine.generate(r)]

    outs = await asyncio.wait_for(asyncio.gather(*(one(r) for r in reqs)), TIMEOUT_S)
    return {r.request_id: o for r, o in zip(reqs, outs, strict=True)}


def summary(outputs: list) -> dict:
    """What a client sees of one request: per choice its tokens, text, logprobs, finish."""
    choices: dict[int, dict] = {}
    for out in outputs:
        for c in out.outputs:
            ch = choices.setdefault(c.index, {"ids": [], "text": "", "lp": [], "finish": None})
            ch["ids"] += c.token_ids
            ch["text"] += c.text
            ch["lp"] += [(t.token_id, t.logprob, t.top_logprobs) for t in c.logprobs or []]
            ch["finish"] = c.finish_reason or ch["finish"]
    last = outputs[-1]
    prompt_lp = [o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None]
    return {
        "choices": choices,
        "finished": [o.finished for o in outputs].count(True),
        "usage": (last.usage.prompt_tokens, last.usage.completion_tokens),
        "prompt_lp": [[(t.token_id, t.logprob) for t in p] for p in prompt_lp],
    }


async def wait_for(predicate, timeout: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


@pytest.fixture(scope="module")
def core():
    client = EngineCoreClient(CONFIG, "tiny", torch_threads=1)
    yield client
    client.shutdown(timeout=30)


def test_outputs_equal_the_in_process_engine(core):
    local = AsyncEngine(CONFIG, "tiny")
    try:
        expected = asyncio.run(run_all(local, requests()))
    finally:
        local.shutdown()
    got = asyncio.run(run_all(core, requests()))
    for rid, outs in expected.items():
        assert summary(got[rid]) == summary(outs), rid
    a = summary(got["a"])["choices"][0]
    assert len(a["ids"]) == 6 and len(a["lp"]) == 6 and all(len(t[2]) == 2 for t in a["lp"])
    assert len(summary(got["b"])["choices"]) == 2
    assert summary(got["b"])["prompt_lp"] and len(summary(got["b"])["prompt_lp"][0]) == 20
    assert core.stats().counters.requests_finished == 3
    assert core.tokenizer is not None and core.tokenizer.get_vocab_size() > 100_000


def test_abort_and_closed_stream_free_pages_in_the_core(core):
    async def main():
        before = dict(core.stats().counters.finished)
        stream = core.generate(Request("long", [0, 7, 8, 9], params(10_000, ignore_eos=True)))
        first = await asyncio.wait_for(stream.__anext__(), TIMEOUT_S)
        assert not first.finished
        assert core.stats().kv.device_pages_in_use > 0
        await stream.aclose()  # the client went away: the core aborts, no final output
        await wait_for(lambda: core.stats().kv.device_pages_in_use == 0)
        await wait_for(lambda: core.num_active == 0)

        outs: list = []

        async def consume() -> None:
            gen = core.generate(Request("ab", [0, 7, 8, 9], params(10_000, ignore_eos=True)))
            async for out in gen:
                outs.append(out)

        task = asyncio.create_task(consume())
        await wait_for(lambda: bool(outs))
        core.abort("ab")
        await asyncio.wait_for(task, TIMEOUT_S)
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        await wait_for(lambda: core.stats().kv.device_pages_in_use == 0)
        finished = core.stats().counters.finished
        assert finished.get("abort", 0) == before.get("abort", 0) + 2

    asyncio.run(main())


def test_bad_requests_are_refused_with_the_field_named(core):
    async def main():
        with pytest.raises(RequestError, match="empty") as empty:
            await run_all(core, [Request("e", [], params(1))])
        assert empty.value.param == "prompt_token_ids"  # across the process boundary
        with pytest.raises(RequestError, match="max_model_len"):
            await run_all(core, [Request("l", [5] * 300, params(1))])
        with pytest.raises(RequestError, match=r"^top_p: ") as top_p:
            await run_all(core, [Request("p", [5, 6], SamplingParams(top_p=0.0))])
        assert top_p.value.param == "top_p"
        # The same limits, in the API process, without a round trip (what a server calls).
        with pytest.raises(RequestError, match="max_model_len"):
            core.validate(Request("l", [5] * 300, params(1)))
        stream = core.generate(Request("d", [0, 5, 6], params(10_000, ignore_eos=True)))
        await asyncio.wait_for(stream.__anext__(), TIMEOUT_S)
        with pytest.raises(ValueError, match="already in flight"):
            await run_all(core, [Request("d", [0, 5, 6], params(1))])
        await stream.aclose()

    asyncio.run(main())
    assert core.is_running and core.stalled_for() < 5.0


def test_a_killed_core_fails_streams_and_refuses_new_requests():
    client = EngineCoreClient(CONFIG, "tiny", torch_threads=1)
    sockets = client.socket_dir
    assert sockets.is_dir()

    async def main():
        outs: list = []

        async def consume() -> None:
            gen = client.generate(Request("k", [0, 7, 8], params(10_000, ignore_eos=True)))
            async for out in gen:
                outs.append(out)

        task = asyncio.create_task(consume())
        await wait_for(lambda: bool(outs))
        os.kill(client.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError, match="exited"):
            await asyncio.wait_for(task, 10.0)
        assert not client.is_running
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(run_all(client, [Request("n", [0, 5], params(1))]), 5.0)

    try:
        asyncio.run(main())
    finally:
        started = time.monotonic()
        client.shutdown(timeout=10)
        assert time.monotonic() - started < 10
    assert not sockets.exists()


def test_graceful_shutdown_ends_streams_stops_the_core_and_removes_sockets(core):
    sockets, proc = core.socket_dir, core._proc

    async def main():
        outs: list = []

        async def consume() -> None:
            gen = core.generate(Request("s", [0, 7, 8], params(10_000, ignore_eos=True)))
            async for out in gen:
                outs.append(out)

        task = asyncio.create_task(consume())
        await wait_for(lambda: bool(outs))
        await asyncio.to_thread(core.shutdown, 30)
        with pytest.raises(EngineDeadError, match="shut down"):
            await asyncio.wait_for(task, 10.0)

    asyncio.run(main())
    assert proc.exitcode == 0  # it left by itself (ShutdownMsg), not killed
    assert not sockets.exists()
    assert proc not in multiprocessing.active_children()
    assert not core.is_running
