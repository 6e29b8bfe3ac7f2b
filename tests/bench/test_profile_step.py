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


def test_prefill_profile_covers_the_whole_prompt() -> None:
    """``--prefill``: one prompt's chunks to its first token, ranked the same way."""
    from bench.profile_step import profile_prefill

    torch.set_grad_enabled(False)
    try:
        r = profile_prefill(tiny_model(), tokens=40, top=4)
    finally:
        torch.set_grad_enabled(True)
    assert r["prefill_tokens"] == 40 and r["engine_steps"] >= 1
    assert r["op_calls_per_step"] > 100 and len(r["top"]) == 4
    shares = [t["share"] for t in r["top"]]
    assert shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 1
