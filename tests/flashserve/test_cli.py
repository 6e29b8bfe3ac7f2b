"""The ``flashserve`` console script: ``inspect``, ``make-tiny`` and a light ``--help``."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flashserve.cli import main


def _inspect_json(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    assert main(["inspect", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _check_official(data: dict) -> None:
    assert data["global_kv_bytes_per_token"] == 890
    assert data["persistent_kv_bytes_per_token"] == 890
    assert data["swa_kv_bytes_per_request"] == 128 * 528 * 40
    assert abs(data["params_active_prefill"] / 8e9 - 1) < 0.10
    assert abs(data["params_active_decode"] / 16e9 - 1) < 0.10
    assert abs(data["params_backbone"] / 552e9 - 1) < 0.05
    assert data["ced_boundary"] == 20
    roles = [row["role"] for row in data["layers"]]
    assert len(roles) == 40
    assert [i for i, r in enumerate(roles) if r == "full"] == [2, 8, 14, 20]
    assert [i for i, r in enumerate(roles) if r == "reindex"] == [24, 28, 32, 36]
    assert roles[:2] == ["swa_only", "swa_only"]


def test_inspect_official_json(capsys: pytest.CaptureFixture[str]) -> None:
    data = _inspect_json(capsys, "official")
    _check_official(data)
    assert data["max_model_len"] == 1_048_576  # the release's max_position_embeddings


def test_inspect_prints_the_context_serve_defaults_to(
    capsys: pytest.CaptureFixture[str],
) -> None:
    demo = Path(__file__).resolve().parents[2] / "models" / "demo"
    written = json.loads((demo / "config.json").read_text(encoding="utf-8"))["text_config"]
    assert _inspect_json(capsys, str(demo))["max_model_len"] == written["max_position_embeddings"]
    for model in ("tiny", str(demo)):  # both serve a coding agent's 64K by default
        assert main(["inspect", model]) == 0
        rows = [r for r in capsys.readouterr().out.splitlines() if r.startswith("max_model_len")]
        assert len(rows) == 1 and rows[0].split()[1] == "65,536", rows


def test_inspect_tiny_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "global_kv_bytes_per_token" in out
    assert "534" in out  # 356 / 2 (layer 2, ratio 2) + 356 (layer 4, ratio 1)
    layer_rows = [
        line for line in out.splitlines() if line.split()[:2] in (["4", "full"], ["6", "reindex"])
    ]
    assert len(layer_rows) == 2


def test_make_tiny_then_inspect_the_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "tiny"
    assert main(["make-tiny", "--out", str(out), "--seed", "1"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).exists(), name
    data = _inspect_json(capsys, str(out))
    tiny = _inspect_json(capsys, "tiny")
    # The same text model; make-tiny adds a vision tower (its own count).
    assert {k: v for k, v in data.items() if k not in ("model", "checkpoint", "params_vision")} == {
        k: v for k, v in tiny.items() if k not in ("model", "params_vision")
    }
    assert tiny["params_vision"] == 0
    vision_names = ("vision.", "aligner.", "image_")
    from engine.loader.files import iter_checkpoint_tensors

    assert data["params_vision"] == sum(
        math.prod(t.shape) for t in iter_checkpoint_tensors(out) if t.name.startswith(vision_names)
    )
    ckpt = data["checkpoint"]
    assert set(ckpt["by_dtype"]) == {"BF16", "F32", "F8_E4M3", "F8_E8M0", "I8"}
    # make-tiny carries every kind the release holds, and the model serves each: the
    # DSpark drafter (mtp.*) and the vision tower are read, nothing is skipped.
    assert ckpt["skipped"] == {}
    # Logical sizes from the stored ones: scales aside, an I8 holds two MXFP4 values.
    assert data["params_dspark"] == sum(
        math.prod(t.shape) * (2 if t.dtype == "I8" else 1)
        for t in iter_checkpoint_tensors(out)
        if t.name.startswith("mtp.") and not t.name.endswith(".scale")
    )
    assert data["params_dspark"] > 0
    file_bytes = (out / "model.safetensors").stat().st_size
    assert 0 < file_bytes - ckpt["bytes"] < 200_000  # the rest is the JSON header
    # make-tiny writes the release's formats: the memory plan's packed bytes (device
    # and host) are exactly the bytes of the tensors the text model serves.
    from engine.model.deepseek_v41.weight_names import WEIGHTS

    served = sum(
        t.nbytes for t in iter_checkpoint_tensors(out) if WEIGHTS.skipped(t.name, True) is None
    )
    plan = _inspect_json(capsys, str(out), "--plan")
    assert plan["device_kinds"][0]["weights_bytes"] + plan["host_bytes"] == served


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "inspect" in capsys.readouterr().out


def test_inspect_official_in_a_subprocess() -> None:
    """The installed console script if there is one, else the same entry point via python."""
    script = shutil.which("flashserve") or (
        str(Path(sys.executable).parent / "flashserve")
        if (Path(sys.executable).parent / "flashserve").exists()
        else None
    )
    cmd = (
        [script]
        if script
        else [sys.executable, "-c", "from flashserve.cli import main; raise SystemExit(main())"]
    )
    done = subprocess.run(
        [*cmd, "inspect", "official", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[2],
        check=False,
    )
    assert done.returncode == 0, done.stderr
    _check_official(json.loads(done.stdout))


def test_inspect_plan_prints_and_serialises_the_official_plan(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from engine.model.deepseek_v41.config import ModelConfig
    from engine.planning.memory_plan import GIB, memory_plan

    argv = ["inspect", "official", "--plan", "--devices", "8", "--device-memory-gib", "141"]
    data = _inspect_json(capsys, *argv[1:])
    expected = memory_plan(ModelConfig.official(), 8, 141 * GIB).to_dict()
    assert data == {"model": "official", **json.loads(json.dumps(expected))}
    assert data["fits"] and data["refusal"] is None
    (kind,) = data["device_kinds"]
    assert kind["experts"] == 48 and data["kv_bytes_per_token"] == 890

    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "memory plan: 8 device(s) x 141.0 GiB" in out
    assert "devices 0-7 (each: 48 routed experts per layer)" in out
    for label, n in (
        ("routed experts, MXFP4 E2M1", kind["weights"]["experts_fp4"]),
        ("Engram tables, FP8 E4M3 (host)", data["host"]["engram_fp8"]),
        ("global-KV pool (what is left)", kind["kv_pool_bytes"]),
        ("global-KV pool capacity", kind["kv_pool_tokens"]),
    ):
        (line,) = [line for line in out.splitlines() if line.strip().startswith(label)]
        assert f"{n:,}" in line, line


def test_inspect_plan_on_one_device_says_it_does_not_fit(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["inspect", "official", "--plan", "--device-memory-gib", "141"]) == 0
    out = capsys.readouterr().out
    assert "does not fit: weights need 286.5 GiB per device, 141.0 GiB available" in out
    data = _inspect_json(capsys, "official", "--plan", "--devices", "1")
    assert data["fits"] is False and data["refusal"].startswith("weights need 286.5 GiB")


def test_inspect_plan_rejects_bad_device_counts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", "tiny", "--plan", "--devices", "0"]) == 2
    assert "--devices must be >= 1" in capsys.readouterr().err


def test_inspect_plan_topology_flags_reach_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    from engine.model.deepseek_v41.config import ModelConfig
    from engine.planning.memory_plan import GIB, Topology, memory_plan

    data = _inspect_json(
        capsys, "official", "--plan", "--tensor-parallel-size", "8", "--enable-expert-parallel"
    )
    expected = memory_plan(ModelConfig.official(), 8, 141 * GIB, topology=Topology(8, 1, True))
    assert data == {"model": "official", **json.loads(json.dumps(expected.to_dict()))}
    assert data["topology"]["name"] == "TP8 x EP8" and data["devices"] == 8
    # --data-parallel-size 8 without --enable-expert-parallel: every rank holds all experts.
    assert main(["inspect", "official", "--plan", "--data-parallel-size", "8"]) == 0
    out = capsys.readouterr().out
    assert "devices 0-7 (each: 384 routed experts per layer)" in out
    assert "does not fit: weights need 286.5 GiB per device" in out
    assert "without --enable-expert-parallel every rank holds all 384 routed experts" in out
    argv = ["inspect", "official", "--plan", "--devices", "8", "--tensor-parallel-size", "2"]
    assert main([*argv, "--data-parallel-size", "2"]) == 2
    assert "--devices 8 but --tensor-parallel-size 2 x --data-parallel-size 2 = 4" in (
        capsys.readouterr().err
    )


def test_inspect_plan_compare_prints_dp_and_tp_side_by_side(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["official", "--plan", "--devices", "16", "--nnodes", "2", "--device-memory-gib", "80"]
    data = _inspect_json(capsys, *argv, "--compare")
    names = [p["topology"]["name"] for p in data["plans"]]
    assert names == ["DP16 x EP16", "TP8 x DP2 x EP16"]
    dp, tp = data["plans"]
    assert data["ep_traffic"]["remote_copies"] == 6 * 15 / 16  # engine/planning/ep_traffic.py
    assert main(["inspect", *argv, "--compare"]) == 0
    lines = capsys.readouterr().out.splitlines()
    (header,) = [line for line in lines if "DP16 x EP16" in line]
    assert header.split() == ["DP16", "x", "EP16", "TP8", "x", "DP2", "x", "EP16"]
    (node,) = [line for line in lines if line.strip().startswith("global-KV tokens per node")]
    assert node.split()[-2:] == [f"{p['kv_tokens_per_node'][0]:,}" for p in (dp, tp)]
    (total,) = [line for line in lines if line.strip().startswith("global-KV tokens, all nodes")]
    assert total.split()[-2:] == [f"{p['kv_pool_tokens_total']:,}" for p in (dp, tp)]
    assert any(line.split()[:2] == ["16", "2"] and "29,700" in line for line in lines)


def test_building_the_parser_imports_no_heavy_library() -> None:
    """``flashserve --help`` reads the flags off the config dataclasses; their modules
    must not bring the web stack, pydantic or torch (each adds tens of milliseconds)."""
    heavy = ("torch", "numpy", "pydantic", "fastapi", "httpx", "uvicorn", "prometheus_client")
    code = (
        "import sys\n"
        "from flashserve.cli import build_parser\n"
        "build_parser().format_help()\n"
        f"print(' '.join(m for m in {heavy!r} if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert out.split() == []
