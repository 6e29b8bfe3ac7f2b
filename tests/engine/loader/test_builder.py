"""checkpoint_fingerprint: same bytes, same id; a change anywhere it samples, a new id."""

from __future__ import annotations

from pathlib import Path

from engine.loader.builder import checkpoint_fingerprint


def _checkpoint(root: Path, name: str, weights: bytes, config: bytes = b"{}") -> Path:
    path = root / name
    path.mkdir()
    (path / "config.json").write_bytes(config)
    (path / "model.safetensors").write_bytes(weights)
    return path


def test_fingerprint_follows_config_and_sampled_weight_bytes(tmp_path: Path) -> None:
    weights = bytes(range(256)) * 64  # 16 KiB; samples of 4 KiB leave a middle unread
    base = checkpoint_fingerprint(_checkpoint(tmp_path, "a", weights), sample_bytes=4096)
    assert len(base) == 32
    same = checkpoint_fingerprint(_checkpoint(tmp_path, "b", weights), sample_bytes=4096)
    assert same == base

    last = bytearray(weights)
    last[-1] ^= 1
    assert checkpoint_fingerprint(_checkpoint(tmp_path, "c", bytes(last)), 4096) != base
    config = _checkpoint(tmp_path, "d", weights, config=b'{"x": 1}')
    assert checkpoint_fingerprint(config, 4096) != base
    # Outside the sampled head and tail the bytes are not read (the cost bound).
    middle = bytearray(weights)
    middle[8192] ^= 1
    assert checkpoint_fingerprint(_checkpoint(tmp_path, "e", bytes(middle)), 4096) == base
