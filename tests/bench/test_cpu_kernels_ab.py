"""``bench/cpu_kernels_ab.py`` and ``bench/ced_ttft_http.py`` at their smallest."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch
from serving_fake_server import FakeServer, FakeState

from bench.ced_ttft_http import ttft
from bench.cpu_kernels_ab import _ab
from engine.model.deepseek_v41.mhc import sinkhorn
from kernels import cpu_native


@pytest.mark.skipif(cpu_native.library() is None, reason="no C compiler")
def test_ab_toggles_the_c_loops_step_by_step(monkeypatch) -> None:
    monkeypatch.setenv(cpu_native.ENV_VAR, "1")
    logits = torch.randn(2, 4, 4)
    seen: list[str] = []

    def step() -> None:
        seen.append(os.environ[cpu_native.ENV_VAR])
        sinkhorn(logits, 20, 1e-6)

    res = _ab(step, steps=3)
    assert seen[2:8] == ["1", "0"] * 3  # after the warm-up, the modes alternate
    assert os.environ[cpu_native.ENV_VAR] == "1"  # left on
    # 117 eager pass operations become one C call.
    assert res["0"]["op_calls"] - res["1"]["op_calls"] > 100
    assert res["1"]["cpu_ms"] > 0 and res["0"]["cpu_ms"] > 0


def test_ttft_is_the_wait_for_the_first_streamed_token() -> None:
    state = FakeState(first_delay_s=0.3)
    with FakeServer(state) as server:
        t = asyncio.run(ttft(server.base_url, "a b c"))
    assert 0.3 <= t < 1.5  # the server waits 0.3 s before its first chunk


def test_op_breakdown_charges_operations_to_their_sources() -> None:
    from bench.engine_bench import tiny_model
    from bench.op_breakdown import breakdown
    from engine.runner.paged_backend import PagedKV

    store_swa = PagedKV.store_swa
    torch.set_grad_enabled(False)
    try:
        counts = breakdown(tiny_model(), batch=1)
    finally:
        torch.set_grad_enabled(True)
    assert PagedKV.store_swa is store_swa  # the wrappers are removed again
    for source in ("MoE", "sparse attention", "mHC coefficients", "other"):
        assert counts[source] > 0, source
    assert sum(counts.values()) > 1000  # a decode step is thousands of operations
