"""``bench/profile_step.py`` at its smallest: one profiled decode step of one request."""

from __future__ import annotations

import torch

from bench.engine_bench import tiny_model
from bench.profile_step import profile_decode


def test_profile_counts_operators_and_ranks_them_by_self_time() -> None:
    torch.set_grad_enabled(False)
    try:
        r = profile_decode(tiny_model(), batch=1, steps=1, top=5)
    finally:
        torch.set_grad_enabled(True)
    assert r["batch"] == 1 and r["step_ms"] > 0
    assert r["op_calls_per_step"] > 100  # a decode step is many operator calls
    shares = [t["share"] for t in r["top"]]
    assert len(shares) == 5 and shares == sorted(shares, reverse=True)
    assert 0 < sum(shares) <= 1
    assert any(t["op"] == "aten::mm" for t in r["top"])  # the GEMMs are among the top
