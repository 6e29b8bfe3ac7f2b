"""Flags generated from the config dataclasses (flashserve/config_args.py): every field
reaches a flag, and each command line parses to the settings the hand-written parser gave.

The expected values are literal: they are what ``flashserve serve`` produced before its
flags were generated, so a default or a flag that drifts fails here.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Literal

import pytest

from engine.config import EngineConfig
from flashserve import serve_cmd
from flashserve.cli import build_parser
from flashserve.config_args import add_flags, flags_of, from_args
from server.disagg.settings import RouterSettings
from server.settings import ServerSettings

# Fields without a flag of their own, and what sets them instead.
INTERNAL = {
    ServerSettings: {
        "system_fingerprint": "the checkpoint's fingerprint",
        "disconnect_poll_s": "fixed",
        "role": "--role (router serves as both)",
        "prices": "--prices, --off-peak-*, --currency, --price-file",
    },
    EngineConfig: {},
    serve_cmd.ServeOptions: {},
    RouterSettings: {"connect_timeout_s": "fixed"},
}

# Every option of ``flashserve serve --help`` before the flags were generated.
OPTIONS = " ".join(
    (
        "--role --model --host --port --served-model-name --api-key --max-body-bytes",
        "--keep-alive-seconds --max-concurrent-requests --default-max-tokens --log-level",
        "--vllm-metric-aliases --prices --off-peak-window --off-peak-discount --currency",
        "--price-file --max-sequences-per-request --max-concurrent-sequences",
        "--preprocess-workers --preprocess-timeout --grammar-timeout",
        "--max-grammar-schema-bytes --grammar-cache-bytes --grammar-workers",
        "--max-grammar-bytes",
        "--health-stall-timeout --header-timeout --body-timeout --shutdown-timeout",
        "--prefill-url --decode-url --prefill-timeout --decode-timeout --routing",
        "--affinity-slack --publish-timeout --in-process-engine --max-num-seqs",
        "--max-num-batched-tokens --prefill-chunk-tokens --page-tokens --kv-cache-bytes",
        "--kv-dir --kv-dir-bytes --replay-tokens --disable-ced --kv-dtype --device",
        "--device-memory-gib --dtype --quantization --max-model-len --runner --enforce-eager",
        "--cuda-graph-sizes --seed --tensor-parallel-size --data-parallel-size",
        "--enable-expert-parallel --nnodes --node-rank --master-addr --master-port",
        "--worker-timeout --worker-threads",
        # Added since: the chat page at / (server/playground/).
        "--no-playground",
        # Added since: the vision tower's outputs per image (docs/design/images.md).
        "--encoder-cache-bytes",
        # Added since: images through the APIs (README "Images").
        "--allowed-media-domains --limit-mm-per-prompt --max-image-bytes",
        "--max-image-pixels --media-fetch-timeout",
        # Speculative decoding (docs/design/engine.md).
        "--speculative-config",
    )
).split()

ENGINE_DEFAULTS = {
    "max_num_seqs": 64,
    "max_num_batched_tokens": 2048,
    "prefill_chunk_tokens": 512,
    "page_tokens": 64,
    "kv_cache_bytes": 1 << 30,
    "kv_dir": None,
    "kv_dir_bytes": None,
    "replay_tokens": None,
    "enable_ced": True,
    "kv_dtype": "fp4",
    "device": "cpu",
    "dtype": "float32",
    "quantization": "auto",
    "max_model_len": None,
    "runner": "paged",
    "seed": 0,
    "enforce_eager": False,
    "cuda_graph_sizes": None,
    "tensor_parallel_size": 1,
    "data_parallel_size": 1,
    "enable_expert_parallel": False,
    "nnodes": 1,
    "node_rank": 0,
    "master_addr": "127.0.0.1",
    "master_port": 0,
    "worker_timeout_s": 120.0,
    "worker_threads": None,
    "grammar_timeout_s": 10.0,
    "grammar_cache_bytes": 256 << 20,
    "encoder_cache_bytes": 256 << 20,
    "grammar_workers": 2,
    "max_grammar_bytes": 64 << 20,
    "speculative_config": None,
}

SERVER_DEFAULTS = {
    "served_model_name": "deepseek-flash",
    "api_keys": (),
    "max_body_bytes": 32 << 20,
    "keep_alive_s": 10.0,
    "max_concurrent_requests": None,
    "default_max_tokens": None,
    "system_fingerprint": "fp_test",
    "disconnect_poll_s": 0.5,
    "role": "both",
    "publish_timeout_s": 60.0,
    "max_sequences_per_request": 256,
    "max_concurrent_sequences": 4096,
    "preprocess_workers": 4,
    "preprocess_timeout_s": 30.0,
    "max_grammar_schema_bytes": 256 << 10,
    "health_stall_s": 30.0,
    "body_read_timeout_s": 60.0,
    "prices": None,
    "vllm_metric_aliases": False,
    "allowed_media_domains": (),
    "limit_mm_per_prompt": '{"image": 16}',
    "max_image_bytes": 20 << 20,
    "max_image_pixels": 50_000_000,
    "media_fetch_timeout_s": 10.0,
    "playground": True,
}

# With the two URLs a router cannot go without.
ROUTER_DEFAULTS = {
    "prefill_urls": ("http://p",),
    "decode_urls": ("http://d",),
    "prefill_timeout_s": 120.0,
    "decode_timeout_s": 600.0,
    "connect_timeout_s": 5.0,
    "routing": "affinity",
    "affinity_slack": 4,
}

SERVE_DEFAULTS = {
    "role": "both",
    "model": "tiny",
    "host": "127.0.0.1",
    "port": 8000,
    "log_level": "info",
    "header_timeout_s": 10.0,
    "shutdown_timeout_s": 20.0,
    "in_process_engine": False,
    "device_memory_gib": None,
}

TORCHRUN_ENV = ("NNODES", "WORLD_SIZE", "NODE_RANK", "RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _no_torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in TORCHRUN_ENV:
        monkeypatch.delenv(name, raising=False)


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def _settings(*argv: str) -> dict[str, object]:
    return dataclasses.asdict(serve_cmd.server_settings(_args(*argv), "fp_test", env={}))


def _engine(*argv: str) -> dict[str, object]:
    return dataclasses.asdict(serve_cmd.engine_config(_args(*argv)))


def _serve_actions() -> list[argparse.Action]:
    serve = argparse.ArgumentParser()
    serve_cmd.add_arguments(serve)
    return [a for a in serve._actions if a.dest != "help"]


def test_the_options_are_those_of_before() -> None:
    options = [o for a in _serve_actions() for o in a.option_strings]
    assert sorted(options) == sorted(OPTIONS)


def test_no_two_flags_write_one_setting() -> None:
    dests = [a.dest for a in _serve_actions()]
    assert len(dests) == len(set(dests))


@pytest.mark.parametrize("cls", list(INTERNAL))
def test_every_field_has_a_flag_or_is_listed_internal(cls: type) -> None:
    """A new field with a ``help`` gets its flag without more code; one without is
    deliberate, and listed above."""
    flagged = {flag.field for flag in flags_of(cls)}
    names = {f.name for f in dataclasses.fields(cls)}
    assert names - flagged == set(INTERNAL[cls])
    # Each generated flag sets its field: given a value other than the default,
    # the parsed value differs.
    for flag in flags_of(cls):
        kwargs = flag.kwargs
        if kwargs.get("action") in ("store_true", "store_false"):
            argv = [flag.option]
        elif "choices" in kwargs:
            argv = [flag.option, next(c for c in kwargs["choices"] if c != kwargs["default"])]
        else:
            argv = [flag.option, "3"]
        parsed = getattr(_args(*argv), flag.field)
        assert parsed != kwargs["default"], flag.option


def test_defaults_are_those_of_before() -> None:
    assert _engine() == ENGINE_DEFAULTS
    assert _settings() == SERVER_DEFAULTS
    assert dataclasses.asdict(serve_cmd.serve_options(_args())) == SERVE_DEFAULTS
    assert serve_cmd.in_process_engine(_args(), env={}) is False
    router = _args("--role", "router", "--prefill-url", "http://p", "--decode-url", "http://d")
    assert dataclasses.asdict(serve_cmd.router_settings(router)) == ROUTER_DEFAULTS


def test_engine_flags() -> None:
    engine = _engine(
        *("--max-num-seqs", "3", "--max-num-batched-tokens", "100"),
        *("--prefill-chunk-tokens", "32", "--page-tokens", "128", "--kv-cache-bytes", "12345"),
        *("--kv-dir", "/tmp/kv", "--kv-dir-bytes", "999", "--replay-tokens", "16"),
        *("--disable-ced", "--kv-dtype", "bf16", "--device", "cuda", "--dtype", "bfloat16"),
        *("--quantization", "none", "--max-model-len", "4096", "--runner", "reference"),
        *("--enforce-eager", "--cuda-graph-sizes", "1", "2", "8", "--seed", "7"),
    )
    assert engine == {
        **ENGINE_DEFAULTS,
        "max_num_seqs": 3,
        "max_num_batched_tokens": 100,
        "prefill_chunk_tokens": 32,
        "page_tokens": 128,
        "kv_cache_bytes": 12345,
        "kv_dir": "/tmp/kv",
        "kv_dir_bytes": 999,
        "replay_tokens": 16,
        "enable_ced": False,
        "kv_dtype": "bf16",
        "device": "cuda",
        "dtype": "bfloat16",
        "quantization": "none",
        "max_model_len": 4096,
        "runner": "reference",
        "enforce_eager": True,
        "cuda_graph_sizes": (1, 2, 8),
        "seed": 7,
    }
    with pytest.raises(SystemExit):
        _args("--dtype", "int8")
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    assert _engine("--speculative-config", spec)["speculative_config"] == spec


def test_parallel_flags() -> None:
    engine = _engine(
        *("--tensor-parallel-size", "2", "--data-parallel-size", "4"),
        *("--enable-expert-parallel", "--nnodes", "2", "--node-rank", "1"),
        *("--master-addr", "10.0.0.1", "--master-port", "29500"),
        *("--worker-timeout", "30", "--worker-threads", "4"),
    )
    assert engine == {
        **ENGINE_DEFAULTS,
        "tensor_parallel_size": 2,
        "data_parallel_size": 4,
        "enable_expert_parallel": True,
        "nnodes": 2,
        "node_rank": 1,
        "master_addr": "10.0.0.1",
        "master_port": 29500,
        "worker_timeout_s": 30.0,
        "worker_threads": 4,
    }


def test_torchrun_environment_is_the_default_and_flags_win(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    env = {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29511"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    engine = _engine("--data-parallel-size", "2")
    assert (engine["nnodes"], engine["node_rank"]) == (2, 1)
    assert (engine["master_addr"], engine["master_port"]) == ("10.1.2.3", 29511)
    assert _engine("--nnodes", "1", "--node-rank", "0")["nnodes"] == 1
    # The dataclass itself never reads the environment.
    assert EngineConfig().master_addr == "127.0.0.1"


def test_http_flags_and_api_key_alias() -> None:
    argv = (
        *("--served-model-name", "flash", "--api-key", "k1", "--api-key", "k2"),
        *("--max-body-bytes", "1000", "--keep-alive-seconds", "2.5"),
        *("--max-concurrent-requests", "9", "--default-max-tokens", "64"),
        "--vllm-metric-aliases",
        "--no-playground",
    )
    assert _settings(*argv) == {
        **SERVER_DEFAULTS,
        "served_model_name": "flash",
        "api_keys": ("k1", "k2"),
        "max_body_bytes": 1000,
        "keep_alive_s": 2.5,
        "max_concurrent_requests": 9,
        "default_max_tokens": 64,
        "vllm_metric_aliases": True,
        "playground": False,
    }
    env = {"FLASHSERVE_API_KEYS": "k3,k1"}
    settings = serve_cmd.server_settings(_args("--api-key", "k1"), "fp", env=env)
    assert settings.api_keys == ("k1", "k3")


def test_limit_flags_and_zero_means_no_limit() -> None:
    argv = (
        *("--max-sequences-per-request", "8", "--max-concurrent-sequences", "0"),
        *("--preprocess-workers", "2", "--preprocess-timeout", "5"),
        *("--grammar-timeout", "1.5", "--max-grammar-schema-bytes", "100"),
        *("--grammar-cache-bytes", "1000", "--grammar-workers", "3"),
        *("--max-grammar-bytes", "5000"),
        *("--health-stall-timeout", "4", "--body-timeout", "3"),
    )
    assert _settings(*argv) == {
        **SERVER_DEFAULTS,
        "max_sequences_per_request": 8,
        "max_concurrent_sequences": None,
        "preprocess_workers": 2,
        "preprocess_timeout_s": 5.0,
        "max_grammar_schema_bytes": 100,
        "health_stall_s": 4.0,
        "body_read_timeout_s": 3.0,
    }
    # The grammar limits are the engine's: it compiles the grammars.
    engine = _engine(*argv)
    assert (engine["grammar_timeout_s"], engine["grammar_cache_bytes"]) == (1.5, 1000)
    assert (engine["grammar_workers"], engine["max_grammar_bytes"]) == (3, 5000)
    assert _settings("--max-concurrent-sequences", "300")["max_concurrent_sequences"] == 300


def test_image_flags() -> None:
    argv = (
        *("--allowed-media-domains", "Images.Example.com", "127.0.0.1"),
        *("--limit-mm-per-prompt", '{"image": 4}', "--max-image-bytes", "1000"),
        *("--max-image-pixels", "5000", "--media-fetch-timeout", "2.5"),
    )
    assert _settings(*argv) == {
        **SERVER_DEFAULTS,
        "allowed_media_domains": ("images.example.com", "127.0.0.1"),  # host names: case-blind
        "limit_mm_per_prompt": '{"image": 4}',
        "max_image_bytes": 1000,
        "max_image_pixels": 5000,
        "media_fetch_timeout_s": 2.5,
    }
    from server.settings import ServerSettings

    assert ServerSettings(limit_mm_per_prompt='{"image": 4}').max_images == 4
    assert ServerSettings(limit_mm_per_prompt="3").max_images == 3  # a plain number too
    for bad in ('{"video": 1}', '{"image": -1}', "many", '{"image": true}'):
        with pytest.raises(ValueError, match="--limit-mm-per-prompt"):
            ServerSettings(limit_mm_per_prompt=bad)


def test_serve_options() -> None:
    args = _args(
        *("--model", "demo", "--host", "0.0.0.0", "--port", "0", "--log-level", "debug"),
        *("--header-timeout", "2", "--shutdown-timeout", "7", "--in-process-engine"),
        *("--device-memory-gib", "80.5"),
    )
    assert dataclasses.asdict(serve_cmd.serve_options(args)) == {
        **SERVE_DEFAULTS,
        "model": "demo",
        "host": "0.0.0.0",
        "port": 0,
        "log_level": "debug",
        "header_timeout_s": 2.0,
        "shutdown_timeout_s": 7.0,
        "in_process_engine": True,
        "device_memory_gib": 80.5,
    }
    assert serve_cmd.in_process_engine(args, env={}) is True


def test_roles() -> None:
    prefill = _args("--role", "prefill", "--kv-dir", "/kv", "--publish-timeout", "7.5")
    assert serve_cmd.serve_options(prefill).role == "prefill"
    settings = serve_cmd.server_settings(prefill, "fp", env={})
    assert (settings.role, settings.publish_timeout_s) == ("prefill", 7.5)
    router = _args(
        *("--role", "router", "--prefill-url", "http://p1", "--prefill-url", "http://p2"),
        *("--decode-url", "http://d", "--prefill-timeout", "3", "--decode-timeout", "9"),
        *("--routing", "least-loaded", "--affinity-slack", "2"),
    )
    assert serve_cmd.serve_options(router).role == "router"
    assert serve_cmd.server_settings(router, "fp", env={}).role == "both"
    assert dataclasses.asdict(serve_cmd.router_settings(router)) == {
        **ROUTER_DEFAULTS,
        "prefill_urls": ("http://p1", "http://p2"),
        "decode_urls": ("http://d",),
        "prefill_timeout_s": 3.0,
        "decode_timeout_s": 9.0,
        "routing": "least-loaded",
        "affinity_slack": 2,
    }


def test_cost_flags_compose_one_price_table() -> None:
    from datetime import time

    from server.openai.pricing import PriceTable, Rates

    argv = ("--prices", "0.07,0.27,1.10", "--off-peak-window", "16:30-00:30")
    prices = serve_cmd.server_settings(
        _args(*argv, "--off-peak-discount", "0.5", "--currency", "EUR"), "fp", env={}
    ).prices
    assert prices == PriceTable(
        Rates(0.07, 0.27, 1.10),
        currency="EUR",
        off_peak_start=time(16, 30),
        off_peak_end=time(0, 30),
        off_peak_discount=0.5,
    )


# ----------------------------------------------------------------- the generator itself


@dataclass(slots=True)
class _Toy:
    """A config the generator has never seen: what any new field gets."""

    count: int = field(default=2, metadata={"help": "how many (default %(default)s)"})
    ratio: float | None = field(default=None, metadata={"help": "a ratio", "group": "other"})
    mode: Literal["a", "b"] = field(default="a", metadata={"help": "which"})
    on: bool = field(default=True, metadata={"flag": "--off", "help": "turn off"})
    verbose: bool = field(default=False, metadata={"help": "more"})
    sizes: tuple[int, ...] | None = field(default=None, metadata={"nargs": "+", "help": "sizes"})
    names: tuple[str, ...] = field(
        default=(), metadata={"flag": "--name", "action": "append", "help": "a name"}
    )
    hidden: str = "kept"


def _toy_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_flags({None: parser, "other": parser.add_argument_group("other")}, flags_of(_Toy))
    return parser


def test_a_new_dataclass_gets_flags_from_its_fields() -> None:
    parser = _toy_parser()
    assert from_args(_Toy, parser.parse_args([])) == _Toy()
    argv = "--count 5 --ratio 0.5 --mode b --off --verbose --sizes 1 2 --name x --name y"
    args = parser.parse_args(argv.split())
    assert from_args(_Toy, args) == _Toy(5, 0.5, "b", False, True, (1, 2), ("x", "y"))
    assert from_args(_Toy, args, count=9, hidden="given") == _Toy(
        9, 0.5, "b", False, True, (1, 2), ("x", "y"), "given"
    )
    assert not hasattr(args, "hidden")
    with pytest.raises(SystemExit):
        parser.parse_args(["--mode", "c"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--count", "many"])
    text = parser.format_help()
    assert "how many (default 2)" in text
    assert "other:" in text and "--mode {a,b}" in text and "--name NAME" in text


def test_the_generator_refuses_what_it_cannot_express() -> None:
    @dataclass
    class OnByDefault:
        on: bool = field(default=True, metadata={"help": "no flag to clear it"})

    @dataclass
    class Typo:
        n: int = field(default=1, metadata={"help": "n", "hlep": "typo"})

    with pytest.raises(TypeError, match="needs the 'flag'"):
        flags_of(OnByDefault)
    with pytest.raises(TypeError, match="unknown flag metadata"):
        flags_of(Typo)
    with pytest.raises(KeyError, match="no argument group"):
        add_flags({None: argparse.ArgumentParser()}, flags_of(_Toy))
