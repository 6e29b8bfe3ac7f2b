"""bench/moe_bench.py at its smallest: the three variants agree and every row is timed."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from bench import moe_bench
from engine.model.deepseek_v41.config import ModelConfig
from engine.model.deepseek_v41.moe import MoE


def test_loop_baseline_equals_the_fused_layer_in_fp32() -> None:
    torch.manual_seed(0)
    moe = MoE(ModelConfig.tiny())
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0.0, 0.05)
    x = torch.randn(16, moe.gate.weight.shape[1])
    with torch.no_grad():
        torch.testing.assert_close(moe_bench.LoopMoE(moe)(x), moe(x), atol=1e-6, rtol=1e-5)


def test_bench_writes_one_row_per_batch(tmp_path: Path) -> None:
    out = tmp_path / "moe.json"
    argv = ["--batch", "1", "4", "--repeats", "2", "--tokens", "--out", str(out)]
    threads = torch.get_num_threads()
    try:
        assert moe_bench.main(argv) == 0  # sets one thread, as a benchmark run does
    finally:
        torch.set_num_threads(threads)
    result = json.loads(out.read_text())
    assert [r["batch"] for r in result["rows"]] == [1, 4]
    for row in result["rows"]:
        assert row["loop_ms"] > 0 and row["fused_ms"] > 0 and row["fused_packed_ms"] > 0
    assert result["dims"]["n_routed_experts"] == ModelConfig.tiny().n_routed_experts
    assert result["model_forward"] == []
