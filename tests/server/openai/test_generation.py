"""Generation: merging engine calls, usage over calls, admission, cancellation (fake engine).

The fake engine scripts each request's outputs and records which streams were
left unfinished, which is what makes ``AsyncEngine`` abort a request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from engine.api.errors import RequestError
from engine.api.request import CompletionOutput, Request, RequestMetrics, RequestOutput, Usage
from server.http.errors import APIError
from server.metrics.metrics import ServerMetrics
from server.openai.generation import (
    Admission,
    ClientGone,
    EngineCall,
    Generation,
    ServingContext,
    run_to_end,
)
from server.settings import ServerSettings


class FakeEngine:
    def __init__(self, prompt_hits: dict[str, int] | None = None, steps: int = 2) -> None:
        self.prompt_hits = prompt_hits or {}
        self.steps = steps
        self.abandoned: list[str] = []
        self.finished: list[str] = []
        self.hold = asyncio.Event()  # set to let streams past their first output
        self.is_running = True

    def validate(self, request: Request) -> None:
        if not request.prompt_token_ids:
            raise RequestError("prompt_token_ids", "the prompt is empty")
        if request.sampling_params.top_p > 1:
            raise RequestError("top_p", "in (0, 1]")

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        n, done = request.sampling_params.n, False
        prompt = len(request.prompt_token_ids)
        hit = self.prompt_hits.get(request.request_id, 0)
        try:
            for step in range(1, self.steps + 1):
                if step == 2:
                    await self.hold.wait()
                await asyncio.sleep(0)  # outputs arrive from another thread, one per step
                last = step == self.steps
                outputs = [
                    CompletionOutput(i, "x", [7], finish_reason="length" if last else None)
                    for i in range(n)
                ]
                usage = Usage(prompt, step * n, hit, prompt - hit)
                metrics = RequestMetrics(0.0, 0.1, 0.2, 0.2 + step, 0.2 + step if last else None)
                done = last
                yield RequestOutput(request.request_id, outputs, last, usage, metrics)
        finally:
            (self.finished if done else self.abandoned).append(request.request_id)


def _ctx(engine: FakeEngine, limit: int | None = None) -> ServingContext:
    return ServingContext(
        engine=engine,  # type: ignore[arg-type]
        settings=ServerSettings(),
        metrics=ServerMetrics("m"),
        tokenizer=None,  # type: ignore[arg-type]
        token_texts=None,  # type: ignore[arg-type]
        admission=Admission(limit),
    )


def _call(rid: str, first: int, group: int, *, prompt: int = 10, n: int = 1) -> EngineCall:
    request = Request(rid, list(range(1, prompt + 1)))
    request.sampling_params.n = n
    return EngineCall(request, first, group)


async def _collect(gen: Generation) -> dict[int, list[CompletionOutput]]:
    seen: dict[int, list[CompletionOutput]] = {}

    async def never() -> bool:
        return False

    await run_to_end(gen, lambda u: seen.setdefault(u.index, []).append(u.output), never, 0.05)
    return seen


def test_merged_choices_and_usage_count_each_prompt_once() -> None:
    async def main() -> None:
        engine = FakeEngine({"a": 4, "b": 9, "c": 3})
        engine.hold.set()
        ctx = _ctx(engine)
        # Prompt group 0 split into two calls (choices 0 and 1); group 1 has choices 2, 3.
        calls = [
            _call("a", 0, 0, prompt=10),
            _call("b", 1, 0, prompt=10),
            _call("c", 2, 1, prompt=7, n=2),
        ]
        gen = Generation(ctx, calls)
        seen = await _collect(gen)
        await gen.close()
        assert sorted(seen) == [0, 1, 2, 3]
        assert all([o.finish_reason for o in outs] == [None, "length"] for outs in seen.values())
        usage = gen.usage(reasoning_tokens=1)
        # prompt: 10 (group 0, once) + 7; cached: call a's 4 (group 0's first) + 3.
        assert (usage.prompt_tokens, usage.prompt_cache_hit_tokens) == (17, 7)
        assert usage.completion_tokens == 2 + 2 + 4
        assert usage.prompt_tokens_details.cached_tokens == 7
        assert usage.completion_tokens_details.reasoning_tokens == 1
        assert sorted(engine.finished) == ["a", "b", "c"] and engine.abandoned == []
        assert ctx.admission.active == 0
        # One latency observation per finished engine request.
        text = ctx.metrics.render().decode()
        assert 'flashserve:e2e_request_latency_seconds_count{model_name="m"} 3.0' in text

    asyncio.run(main())


def test_close_abandons_unfinished_streams() -> None:
    async def main() -> None:
        engine = FakeEngine()
        ctx = _ctx(engine)
        gen = Generation(ctx, [_call("a", 0, 0), _call("b", 1, 0)])
        first = await gen.next(1.0)
        assert first is not None and not gen.finished
        await gen.close()
        await gen.close()  # idempotent
        assert sorted(engine.abandoned) == ["a", "b"]
        assert ctx.admission.active == 0

    asyncio.run(main())


def test_client_gone_is_noticed_while_outputs_keep_coming() -> None:
    async def main() -> None:
        engine = FakeEngine(steps=10**6)
        engine.hold.set()
        gen = Generation(_ctx(engine), [_call("a", 0, 0)])
        checks = 0

        async def gone() -> bool:
            nonlocal checks
            checks += 1
            return True

        with pytest.raises(ClientGone):
            await run_to_end(gen, lambda u: None, gone, 0.01)
        await gen.close()
        assert checks == 1 and engine.abandoned == ["a"]

    asyncio.run(main())


def test_a_stopped_engine_is_a_503_before_anything_starts() -> None:
    async def main() -> None:
        engine = FakeEngine()
        engine.is_running = False
        ctx = _ctx(engine)
        with pytest.raises(APIError) as err:
            Generation(ctx, [_call("a", 0, 0)])
        assert err.value.status == 503 and ctx.admission.active == 0

    asyncio.run(main())


def test_admission_limit_is_a_429() -> None:
    async def main() -> None:
        engine = FakeEngine()
        ctx = _ctx(engine, limit=1)
        gen = Generation(ctx, [_call("a", 0, 0)])
        with pytest.raises(APIError) as full:
            Generation(ctx, [_call("b", 0, 0)])
        assert full.value.status == 429
        await gen.close()
        again = Generation(ctx, [_call("c", 0, 0)])
        await again.close()

    asyncio.run(main())


@pytest.mark.parametrize(
    ("call", "status", "param", "message"),
    [
        (lambda: _call("a", 0, 0, prompt=0), 400, "prompt", "prompt: the prompt is empty"),
        (None, 422, "top_p", "top_p: in (0, 1]"),
    ],
)
def test_engine_validation_errors_name_the_field(
    call, status: int, param: str, message: str
) -> None:
    async def main() -> None:
        bad = call() if call else _call("a", 0, 0)
        if call is None:
            bad.request.sampling_params.top_p = 2.0
        ctx = _ctx(FakeEngine())
        with pytest.raises(APIError) as err:
            Generation(ctx, [bad], prompt_param="prompt")
        assert (err.value.status, err.value.param, err.value.message) == (status, param, message)
        assert ctx.admission.active == 0  # refused before taking a place

    asyncio.run(main())
