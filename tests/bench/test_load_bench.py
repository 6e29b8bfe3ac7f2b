"""Peak host memory of a streaming load (docs/design/checkpoints.md): a ~300 MB synthetic
checkpoint in the official topology, loaded in a fresh interpreter.

Bound: peak RSS <= 1.3 x the largest shard + the model's resident bytes + the
interpreter's RSS just before the load (bench/load_bench.py). Loading whole
tensors with every shard mapped to the end (the loader before streaming) peaks
about 300 MB above it at this size. The 2 GB run is ``python bench/load_bench.py``
(docs/BENCHMARKS.md).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from bench.load_bench import SHARD_SLACK, run_child, synthetic_config, write_synthetic

TARGET_BYTES = 300_000_000
SHARD_BYTES = 100_000_000


def test_peak_rss_stays_near_one_shard_above_the_model(tmp_path: Path) -> None:
    config = synthetic_config(TARGET_BYTES)
    ckpt = tmp_path / "ckpt"
    try:
        write_synthetic(ckpt, config, SHARD_BYTES)
        shards = sorted(ckpt.glob("*.safetensors"))
        assert len(shards) >= 3
        result, stderr = run_child(ckpt, "bfloat16", progress=True)
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)
    assert not ckpt.exists()
    assert 0.8 * TARGET_BYTES < result["checkpoint_bytes"] < 1.3 * TARGET_BYTES
    # Every stored byte is resident at least once (packed experts as stored, the
    # rest as stored or widened to bf16): the bound below is not met by dropping weights.
    assert result["resident_bytes"] > 0.9 * result["checkpoint_bytes"]
    bound = (
        SHARD_SLACK * result["largest_shard_bytes"]
        + result["resident_bytes"]
        + result["baseline_rss_bytes"]
    )
    assert result["peak_rss_bytes"] <= bound, result
    bar = stderr.replace("\r", "\n").splitlines()
    assert any(line.startswith("loading weights: 100%") for line in bar), stderr[-2000:]
    assert f"({result['checkpoint_bytes']} B) from {len(shards)} shard(s)" in stderr
