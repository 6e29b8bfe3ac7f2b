"""``flashserve serve`` flags -> EngineConfig and ServerSettings; the tiny checkpoint cache.

The live server itself is exercised by tests/server/test_api_*.py (it is started
through this command).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.config import EngineConfig
from flashserve import serve_cmd
from flashserve.cli import build_parser, main


def _args(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_flag_defaults_are_the_engine_defaults() -> None:
    assert serve_cmd.engine_config(_args()) == EngineConfig()


def test_parallel_flags_default_to_torchruns_environment(monkeypatch) -> None:
    """One serve process per node under torchrun: its rank and world size are the
    node's rank and the node count; MASTER_ADDR / MASTER_PORT name node 0."""
    for name, value in {"MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29511"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    config = serve_cmd.engine_config(_args("--data-parallel-size", "4"))
    assert (config.master_addr, config.master_port) == ("10.1.2.3", 29511)
    assert (config.node_rank, config.nnodes, config.world_size) == (1, 2, 4)


def test_a_topology_that_cannot_be_is_refused() -> None:
    with pytest.raises(ValueError, match="do not split over 3 nodes"):
        serve_cmd.engine_config(
            _args("--data-parallel-size", "4", "--nnodes", "3", "--master-port", "1")
        )
    with pytest.raises(ValueError, match="needs more than one rank"):
        serve_cmd.engine_config(_args("--enable-expert-parallel"))
    with pytest.raises(ValueError, match="master-port"):
        serve_cmd.engine_config(_args("--data-parallel-size", "2", "--nnodes", "2"))


def test_quantization_flag_names_the_packed_path(capsys: pytest.CaptureFixture[str]) -> None:
    assert serve_cmd.engine_config(_args()).quantization == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--quantization {auto,none}" in help_text
    assert "auto: keep the checkpoint's FP8/FP4 weights packed" in help_text
    with pytest.raises(SystemExit):
        _args("--quantization", "fp8")


def test_server_settings_from_flags_and_environment() -> None:
    args = _args(
        *("--api-key", "k1", "--api-key", "k2", "--served-model-name", "flash"),
        *("--max-body-bytes", "1000", "--keep-alive-seconds", "2.5"),
        *("--max-concurrent-requests", "9", "--default-max-tokens", "64"),
    )
    settings = serve_cmd.server_settings(args, "fp_x", env={"FLASHSERVE_API_KEYS": "k3, k1,,"})
    assert settings.api_keys == ("k1", "k2", "k3")
    assert settings.served_model_name == "flash"
    assert (settings.max_body_bytes, settings.keep_alive_s) == (1000, 2.5)
    assert (settings.max_concurrent_requests, settings.default_max_tokens) == (9, 64)
    assert settings.system_fingerprint == "fp_x"
    assert serve_cmd.server_settings(_args(), "fp", env={}).api_keys == ()


def test_price_and_metric_flags(tmp_path: Path) -> None:
    from datetime import UTC, datetime

    from server.openai.pricing import Rates

    plain = serve_cmd.server_settings(_args(), "fp", env={})
    assert plain.prices is None and not plain.vllm_metric_aliases
    args = _args(
        *("--prices", "0.07,0.27,1.10", "--off-peak-window", "16:30-00:30"),
        *("--off-peak-discount", "0.5", "--currency", "USD", "--vllm-metric-aliases"),
    )
    settings = serve_cmd.server_settings(args, "fp", env={})
    assert settings.vllm_metric_aliases
    prices = settings.prices
    assert prices is not None and prices.standard == Rates(0.07, 0.27, 1.10)
    assert prices.rates_at(datetime(2026, 1, 1, 17, tzinfo=UTC)) == (
        Rates(0.035, 0.135, 0.55),
        True,
    )
    table = tmp_path / "prices.json"
    table.write_text('{"cache_hit_input": 1, "cache_miss_input": 2, "output": 3}')
    from_file = serve_cmd.server_settings(_args("--price-file", str(table)), "fp", env={})
    assert from_file.prices is not None and from_file.prices.standard == Rates(1, 2, 3)
    for bad in (("--prices", "1,2"), ("--prices", "1,2,3", "--price-file", str(table))):
        with pytest.raises(ValueError):
            serve_cmd.server_settings(_args(*bad), "fp", env={})


def test_cache_dir_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    assert serve_cmd.cache_dir({"FLASHSERVE_CACHE": "/a", "XDG_CACHE_HOME": "/b"}) == Path("/a")
    assert serve_cmd.cache_dir({"XDG_CACHE_HOME": "/b"}) == Path("/b/flashserve")
    monkeypatch.setenv("HOME", "/home/u")
    assert serve_cmd.cache_dir({}) == Path("/home/u/.cache/flashserve")


def test_tiny_checkpoint_is_written_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import engine.loader.checkpoint_writer as writer

    calls: list[tuple[Path, int]] = []

    def fake_make_tiny(out: Path, seed: int = 0, **_: object) -> Path:
        calls.append((Path(out), seed))
        Path(out).mkdir(parents=True)
        (Path(out) / "config.json").write_text("{}")
        return Path(out)

    monkeypatch.setattr(writer, "make_tiny", fake_make_tiny)
    first = serve_cmd.tiny_checkpoint(3, tmp_path)
    assert first == tmp_path / "tiny-seed3" and (first / "config.json").is_file()
    # Written under a temporary name, then renamed into place.
    assert len(calls) == 1 and calls[0][0] != first and calls[0][1] == 3
    assert serve_cmd.tiny_checkpoint(3, tmp_path) == first
    assert len(calls) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny-seed3"]


def test_serve_refuses_a_directory_without_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "--model", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "problem"),
    [
        (("--role", "prefill"), "--role prefill needs --kv-dir"),
        (("--role", "decode"), "--role decode needs --kv-dir"),
        (("--role", "router", "--decode-url", "http://d"), "needs at least one --prefill-url"),
        (("--role", "router", "--prefill-url", "http://p"), "one --decode-url"),
        (("--prefill-url", "http://p"), "flags of --role router"),
    ],
)
def test_serve_refuses_flags_a_role_cannot_use(
    argv: tuple[str, ...], problem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", *argv]) == 2
    assert problem in capsys.readouterr().err


def test_role_flags_reach_the_settings() -> None:
    args = _args("--role", "prefill", "--kv-dir", "/kv", "--publish-timeout", "7.5")
    settings = serve_cmd.server_settings(args, "fp", env={})
    assert (settings.role, settings.publish_timeout_s) == ("prefill", 7.5)
    assert serve_cmd.server_settings(_args(), "fp", env={}).role == "both"
    assert serve_cmd.engine_config(_args("--dtype", "float64")).dtype == "float64"
    router = _args(
        *("--role", "router", "--prefill-url", "http://p1", "--prefill-url", "http://p2"),
        *("--decode-url", "http://d", "--prefill-timeout", "3", "--decode-timeout", "9"),
    )
    settings = serve_cmd.router_settings(router)
    assert (settings.prefill_urls, settings.decode_urls) == (
        ("http://p1", "http://p2"),
        ("http://d",),
    )
    assert (settings.prefill_timeout_s, settings.decode_timeout_s) == (3.0, 9.0)


def _plan(path: Path, *argv: str) -> str | None:
    """``check_memory_plan`` of serving ``path`` with these flags."""
    args = _args("--model", str(path), *argv)
    options = serve_cmd.serve_options(args)
    return serve_cmd.check_memory_plan(
        serve_cmd.engine_config(args), path, options.device_memory_gib
    )


def _config_dir(tmp_path: Path, config) -> Path:
    import json

    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    return tmp_path


def test_serve_refuses_weights_that_do_not_fit_before_loading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The official config on one 141 GiB device: refused from config.json alone (no weights
    in the directory, so reaching the loader would fail differently)."""
    from engine.model.deepseek_v41.config import ModelConfig

    path = _config_dir(tmp_path, ModelConfig.official())
    argv = ["serve", "--model", str(path), "--device", "cuda", "--device-memory-gib", "141"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == (
        "flashserve serve: cuda: weights need 286.5 GiB per device, 141.0 GiB available: "
        "use more devices"
    )
    assert "memory plan: 1 device(s) x 141.0 GiB" in captured.out
    assert "routed experts, MXFP4 E2M1" in captured.out


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (("--prices", "5,1,3"), "cache_hit_input must not exceed cache_miss_input"),
        (("--prices", "1,1,1e400"), "prices: output must be from 0 to 1e+09"),
        (("--prices", "1,2,3", "--off-peak-window", "25:00-01:00"), "off-peak window"),
        (
            ("--max-concurrent-sequences", "4", "--max-sequences-per-request", "8"),
            "max_concurrent_sequences must be >= max_sequences_per_request",
        ),
    ],
)
def test_serve_refuses_bad_server_settings_before_loading(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: tuple[str, ...], says: str
) -> None:
    """One line and exit 2 from config.json alone (the directory has no weights, so
    reaching the loader would fail differently); these used to pass start-up, load
    the model, and then fail every request or die with a traceback."""
    from engine.model.deepseek_v41.config import ModelConfig

    path = _config_dir(tmp_path, ModelConfig.tiny())
    assert main(["serve", "--model", str(path), "--device-memory-gib", "4", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("flashserve serve: ") and says in err
    assert len(err.splitlines()) == 1


def test_serve_prints_the_plan_of_a_model_that_fits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from engine.model.deepseek_v41.config import ModelConfig
    from engine.planning.memory_plan import GIB, weight_bytes

    tiny = ModelConfig.tiny()
    path = _config_dir(tmp_path, tiny)
    assert _plan(path, "--device-memory-gib", "4", "--kv-cache-bytes", str(GIB)) is None
    out = capsys.readouterr().out
    assert "flashserve: memory plan: 1 device(s) x 4.0 GiB" in out
    assert "warning" not in out
    # --kv-cache-bytes beyond what the plan leaves: a warning, not a refusal.
    assert _plan(path, "--device-memory-gib", "3", "--kv-cache-bytes", str(GIB)) is None
    assert "warning: --kv-cache-bytes 1,073,741,824 exceeds" in capsys.readouterr().out
    # cpu without --device-memory-gib: the host's memory, less the Engram tables it holds.
    assert _plan(path) is None
    from engine.planning.memory_plan import detected_memory_bytes

    host = detected_memory_bytes("cpu")
    assert host is not None
    shown = (host - sum(weight_bytes(tiny).host.values())) / GIB
    assert f"memory plan: 1 device(s) x {shown:.1f} GiB" in capsys.readouterr().out


def test_serve_reserve_shortfall_is_refused(tmp_path: Path) -> None:
    from engine.model.deepseek_v41.config import ModelConfig

    path = _config_dir(tmp_path, ModelConfig.tiny())
    message = _plan(path, "--device-memory-gib", "1")
    assert message is not None and message.startswith("cpu: weights (0.1 GiB), activation")
    bad_page = _plan(path, "--page-tokens", "3")
    assert bad_page is not None and "not a multiple" in bad_page


def test_the_engine_core_runs_in_its_own_process_unless_asked() -> None:
    assert serve_cmd.in_process_engine(_args(), env={}) is False
    assert serve_cmd.in_process_engine(_args("--in-process-engine"), env={}) is True
    for value, expected in (("1", True), ("true", True), ("YES", True), ("0", False), ("", False)):
        env = {serve_cmd.IN_PROCESS_ENV: value}
        assert serve_cmd.in_process_engine(_args(), env=env) is expected, value


def test_open_requests_end_before_uvicorns_deadline() -> None:
    """The ended requests get the drain's last 2 s (half of a short one) to answer; the
    drain itself stays --shutdown-timeout, uvicorn's deadline."""
    assert [serve_cmd.drain_before_ending(t) for t in (20.0, 4.0, 2.0, 1.0, 0.0)] == [
        18.0,
        2.0,
        1.0,
        0.5,
        0.0,
    ]
    config = serve_cmd.uvicorn_config(object(), serve_cmd.serve_options(_args()))
    assert config.timeout_graceful_shutdown == 20.0
