"""Both ``EngineClient``s pass the same suite: ``AsyncEngine`` (the step loop on a thread)
and ``EngineCoreClient`` (the loop in a core process). Concurrent streams equal a
synchronous engine's outputs, early close and abort free pages, refusals come before the
engine, prefill counts its published pages, shutdown ends open streams.

What only one of them has (a prebuilt engine, a killed core, socket files) is tested in
test_async_engine.py and test_core_client.py."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter

import pytest
from engine_helpers import greedy, prompt, run_to_completion

from engine.api.async_engine import AsyncEngine
from engine.api.core_client import EngineCoreClient
from engine.api.errors import EngineDeadError, RequestError
from engine.api.request import Request
from engine.api.sampling_params import SamplingParams
from engine.api.stream import StreamingClient
from engine.config import EngineConfig
from engine.loader.builder import build_engine

# float64: every engine gives the same tokens whatever its step batches are, and
# logprobs equal to float64 rounding (BLAS may sum a product of another row count in
# another order, so the last bits can differ when the clients' batches differ).
CONFIG = EngineConfig(
    max_num_seqs=4, page_tokens=16, kv_cache_bytes=4 << 20, max_model_len=256, dtype="float64"
)
TIMEOUT_S = 60.0
KINDS = ["in_process", "multi_process"]


def make_client(kind: str, config: EngineConfig = CONFIG) -> StreamingClient:
    if kind == "in_process":
        return AsyncEngine(config, "tiny")
    return EngineCoreClient(config, "tiny", torch_threads=1)


@pytest.fixture(scope="module", params=KINDS)
def client(request):
    """One client of each kind for the tests that leave it running (counters accumulate:
    the tests compare before and after)."""
    c = make_client(request.param)
    yield c
    c.shutdown(timeout=30)


@pytest.fixture(params=KINDS)
def kind(request) -> str:
    return request.param


def params(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def requests() -> list[Request]:
    return [
        Request("a", [0, 19, 881, 2043, 77], params(6, logprobs=2)),
        Request("b", [0, 5, 6, 7, 8, 9, 10] * 3, params(5, n=2, prompt_logprobs=1)),
        Request("c", [0, 4096, 12, 13], params(4, ignore_eos=True, stop_token_ids=[3])),
    ]


async def collect(engine, request: Request) -> list:
    return [out async for out in engine.generate(request)]


async def run_all(engine, reqs: list[Request]) -> dict[str, list]:
    outs = await asyncio.wait_for(asyncio.gather(*(collect(engine, r) for r in reqs)), TIMEOUT_S)
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


def _floats_close(got, want) -> bool:
    """Equal structures, floats to 1e-12 relative (``summary``'s logprob tuples)."""
    if isinstance(want, float):
        return isinstance(got, float) and got == pytest.approx(want, rel=1e-12, abs=1e-12)
    if isinstance(want, dict):
        return got.keys() == want.keys() and all(_floats_close(got[k], want[k]) for k in want)
    if isinstance(want, list | tuple):
        return len(got) == len(want) and all(map(_floats_close, got, want))
    return got == want


def assert_same(got: dict, want: dict, rid: str) -> None:
    """Tokens, texts, finishes and usage exactly; logprobs to float64 rounding."""
    exact = lambda s: {  # noqa: E731
        "ids": {i: (c["ids"], c["text"], c["finish"]) for i, c in s["choices"].items()},
        "finished": s["finished"],
        "usage": s["usage"],
        "prompt_ids": [[t for t, _ in p] for p in s["prompt_lp"]],
    }
    assert exact(got) == exact(want), rid
    assert _floats_close(got, want), (rid, got, want)


def tokens_of(outputs) -> list[int]:
    return [t for out in outputs for c in out.outputs for t in c.token_ids]


def finished_since(client, before: dict[str, int]) -> dict[str, int]:
    """Choices finished by reason since ``before`` (a copy of ``counters.finished``)."""
    now = Counter(client.stats().counters.finished)
    now.subtract(before)
    return {reason: n for reason, n in now.items() if n}


async def wait_for(predicate, timeout: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.01)


@pytest.fixture(scope="module")
def sync_engine():
    """A synchronous ``LLMEngine`` of the same model, the clients' reference."""
    engine = build_engine(CONFIG, "tiny")
    yield engine
    engine.close()


def test_concurrent_streams_equal_the_synchronous_engine(client, sync_engine):
    for r in requests():
        sync_engine.add_request(r)
    expected = run_to_completion(sync_engine)
    before = client.stats().counters.requests_finished

    async def main():
        ticks = 0
        done = asyncio.Event()

        async def ticker():
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0.005)

        tick_task = asyncio.create_task(ticker())
        results = await run_all(client, requests())
        done.set()
        await tick_task
        return results, ticks

    got, ticks = asyncio.run(main())
    for rid, outs in expected.items():
        assert_same(summary(got[rid]), summary(outs), rid)
        assert got[rid][-1].finished and all(not o.finished for o in got[rid][:-1])
    a = summary(got["a"])["choices"][0]
    assert len(a["ids"]) == 6 and len(a["lp"]) == 6 and all(len(t[2]) == 2 for t in a["lp"])
    assert len(summary(got["b"])["choices"]) == 2
    assert summary(got["b"])["prompt_lp"] and len(summary(got["b"])["prompt_lp"][0]) == 20
    # The event loop kept running while the engine computed.
    assert ticks >= 5
    assert client.stats().counters.requests_finished == before + 3
    assert client.tokenizer is not None and client.tokenizer.get_vocab_size() > 100_000
    facts = (client.vocab_size, client.max_model_len, client.eos_token_id)
    assert facts == (sync_engine.vocab_size, 256, sync_engine.eos_token_id)


def test_closing_the_stream_early_aborts_and_frees_pages(client):
    before = dict(client.stats().counters.finished)

    async def main():
        stream = client.generate(Request("long", prompt(40, 9), greedy(500)))
        first = await asyncio.wait_for(stream.__anext__(), TIMEOUT_S)
        assert not first.finished and len(tokens_of([first])) == 1
        assert client.stats().kv.device_pages_in_use > 0
        await stream.aclose()  # the consumer went away: the engine aborts, no final output
        await wait_for(lambda: client.stats().kv.device_pages_in_use == 0)
        await wait_for(lambda: client.num_active == 0)
        assert finished_since(client, before) == {"abort": 1}

        # An id is free again as soon as its consumer closes, and the new
        # stream sees nothing of the old request.
        stream = client.generate(Request("again", prompt(40, 9), greedy(500)))
        await asyncio.wait_for(stream.__anext__(), TIMEOUT_S)
        await stream.aclose()
        again = await asyncio.wait_for(
            collect(client, Request("again", prompt(40, 9), greedy(2))), TIMEOUT_S
        )
        assert len(tokens_of(again)) == 2 and again[-1].outputs[0].finish_reason == "length"
        await wait_for(lambda: client.stats().kv.device_pages_in_use == 0)

    asyncio.run(main())
    assert finished_since(client, before) == {"abort": 2, "length": 1}
    stats = client.stats()
    assert stats.running == stats.waiting == 0


def test_cancelled_consumer_and_explicit_abort(client):
    before = dict(client.stats().counters.finished)

    async def main():
        started = asyncio.Event()

        async def consume(rid: str) -> list:
            outs = []
            async for out in client.generate(Request(rid, prompt(20, 11), greedy(500))):
                outs.append(out)
                started.set()
            return outs

        task = asyncio.create_task(consume("cancelled"))
        await asyncio.wait_for(started.wait(), TIMEOUT_S)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_for(lambda: finished_since(client, before).get("abort") == 1)

        # abort() from outside: the consumer sees the final "abort" output.
        started.clear()
        task = asyncio.create_task(consume("aborted"))
        await asyncio.wait_for(started.wait(), TIMEOUT_S)
        client.abort("aborted")
        outs = await asyncio.wait_for(task, TIMEOUT_S)
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
        await wait_for(lambda: client.stats().kv.device_pages_in_use == 0)
        await wait_for(lambda: client.num_active == 0)

    asyncio.run(main())
    assert finished_since(client, before) == {"abort": 2}


BAD_REQUESTS = [
    (Request("e", [], params(1)), "prompt_token_ids", "empty"),
    (Request("l", [5] * 300, params(1)), "prompt_token_ids", "max_model_len"),
    (Request("p", [5, 6], SamplingParams(top_p=0.0)), "top_p", r"^top_p: "),
]


def test_bad_requests_are_refused_with_the_field_named(client):
    # What a server calls before admission: the client's own limits, no round trip.
    for request, param, text in BAD_REQUESTS:
        with pytest.raises(RequestError, match=text) as caught:
            client.validate(request)
        assert caught.value.param == param

    async def main():
        # A caller that skips validate is refused by the engine alike, the field named
        # across the process boundary too.
        for request, param, text in BAD_REQUESTS:
            with pytest.raises(RequestError, match=text) as caught:
                await collect(client, request)
            assert caught.value.param == param
        with pytest.raises(ValueError, match="prefill_only=True"):
            await client.prefill(Request("q", [5, 6], params(1)))
        stream = client.generate(Request("d", [0, 5, 6], params(10_000, ignore_eos=True)))
        await asyncio.wait_for(stream.__anext__(), TIMEOUT_S)
        with pytest.raises(ValueError, match="already in flight"):
            await collect(client, Request("d", [0, 5, 6], params(1)))
        await stream.aclose()
        # Aborting an id the engine does not hold is a no-op.
        client.abort("nobody")
        out = await asyncio.wait_for(collect(client, Request("after", [0, 5], params(2))), 30)
        assert out[-1].finished

    asyncio.run(main())
    assert client.is_running and client.stalled_for() < 5.0
    assert client.validate(Request("ok", [0, 5], params(1))) is None


def test_prefill_counts_the_pages_it_published(kind, tmp_path):
    client = make_client(kind, dataclasses.replace(CONFIG, kv_dir=tmp_path))
    try:
        request = Request("pf", prompt(2 * 16 + 5, 3), params(1), prefill_only=True)
        result = asyncio.run(asyncio.wait_for(client.prefill(request, timeout=30), TIMEOUT_S))
        files = sorted(tmp_path.rglob("*.kvp"))
    finally:
        client.shutdown(timeout=30)
    # Only full pages are prefilled and published; the tail is left to the decode worker.
    assert (result.prompt_tokens, result.published_pages, result.page_tokens) == (37, 2, 16)
    assert [f.stat().st_size for f in files] == [result.page_file_bytes] * 2
    assert result.published_bytes == 2 * result.page_file_bytes and result.hit_tokens == 0


def test_shutdown_ends_open_streams_and_refuses_new_requests(kind):
    client = make_client(kind)

    async def main():
        outputs = await asyncio.wait_for(
            collect(client, Request("t", prompt(12, 5), greedy(3))), 30
        )
        assert len(tokens_of(outputs)) == 3 and outputs[-1].finished
        assert outputs[-1].usage.completion_tokens == 3

        outs: list = []

        async def consume() -> None:
            async for out in client.generate(Request("s", [0, 7, 8], greedy(10_000))):
                outs.append(out)

        task = asyncio.create_task(consume())
        await wait_for(lambda: bool(outs))
        await asyncio.to_thread(client.shutdown, 30)
        with pytest.raises(EngineDeadError, match="shut down"):
            await asyncio.wait_for(task, 10.0)

    try:
        asyncio.run(main())
    except BaseException:
        client.shutdown(timeout=30)
        raise
    assert not client.is_running
    with pytest.raises(EngineDeadError):
        asyncio.run(collect(client, Request("late", prompt(12, 5), greedy(1))))
