"""docker/: what the images promise (user, health check, volume, entry point) and
that compose, Prometheus and Grafana provisioning point at each other.

No Docker engine runs here: hadolint and ``docker-compose config`` (make
lint-deploy) check the syntax; these tests check the meaning.
"""

from __future__ import annotations

import fnmatch
import http.server
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import yaml
from deploy_helpers import ROOT

DOCKER = ROOT / "docker"
DOCKERFILES = [DOCKER / "Dockerfile", DOCKER / "Dockerfile.cpu"]
KV_DIR = "/var/lib/flashserve/kv"


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        word, _, rest = (pending + line).partition(" ")
        out.append((word.upper(), " ".join(rest.split())))
        pending = ""
    return out


def final_stage(path: Path) -> list[tuple[str, str]]:
    steps = instructions(path)
    last_from = max(i for i, (word, _) in enumerate(steps) if word == "FROM")
    return steps[last_from:]


def base_images(path: Path) -> list[str]:
    steps = instructions(path)
    args = dict(
        arg.split("=", 1) for word, arg in steps if word == "ARG" and "=" in arg
    )  # defaults of global ARGs
    images = []
    for word, arg in steps:
        if word == "FROM":
            image = arg.split()[0]
            images.append(re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image))
    return images


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_base_images_are_pinned_by_tag(path: Path) -> None:
    for image in base_images(path):
        name, _, tag = image.rpartition(":")
        assert name and tag and tag != "latest", image
        assert re.search(r"\d+\.\d+", tag), f"{image}: pin a version, not a moving tag"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_image_runs_as_a_fixed_non_root_user(path: Path) -> None:
    users = [arg for word, arg in final_stage(path) if word == "USER"]
    assert users, "no USER: the container would run as root"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) != 0, users[-1]
    assert gid.isdigit() and int(gid) != 0, users[-1]
    run_steps = " ".join(arg for word, arg in final_stage(path) if word == "RUN")
    assert f"--uid {uid}" in run_steps and f"--gid {gid}" in run_steps


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_image_serves_health_metrics_port_and_ssd_volume(path: Path) -> None:
    stage = final_stage(path)
    text = " ".join(f"{w} {a}" for w, a in stage)
    assert any(w == "HEALTHCHECK" and "flashserve-healthcheck" in a for w, a in stage)
    assert "COPY --chmod=0755 docker/healthcheck.py /usr/local/bin/flashserve-healthcheck" in text
    assert "COPY --chmod=0755 docker/entrypoint.sh /usr/local/bin/flashserve-entrypoint" in text
    assert ("ENTRYPOINT", '["/usr/local/bin/flashserve-entrypoint"]') in stage
    assert ("VOLUME", f'["{KV_DIR}"]') in stage
    assert ("EXPOSE", "8000") in stage
    env = " ".join(a for w, a in stage if w == "ENV")
    assert f"FLASHSERVE_KV_DIR={KV_DIR}" in env
    assert "FLASHSERVE_PORT=8000" in env
    assert "FLASHSERVE_MODEL=tiny" in env


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_torch_is_pinned(path: Path) -> None:
    runs = " ".join(a for w, a in instructions(path) if w == "RUN")
    assert "torch==2.13.0" in runs


def test_cpu_image_takes_the_cpu_torch_and_gpu_image_the_cuda_one() -> None:
    cpu = " ".join(a for w, a in instructions(DOCKER / "Dockerfile.cpu") if w == "RUN")
    gpu = " ".join(a for w, a in instructions(DOCKER / "Dockerfile") if w == "RUN")
    assert "download.pytorch.org/whl/cpu torch==2.13.0" in cpu
    assert "download.pytorch.org/whl/cu130 torch==2.13.0" in gpu
    assert base_images(DOCKER / "Dockerfile")[0].startswith("nvidia/cuda:13.0")
    # Triton builds its launcher at run time: compiler and headers in the final image.
    assert "gcc" in gpu and "python3-dev" in gpu


# ------------------------------------------------------------------ .dockerignore


def dockerignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; "!" re-includes."""
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        p = pattern.removeprefix("!").rstrip("/")
        if fnmatch.fnmatch(path, p) or path.startswith(p + "/"):
            ignored = not negate
    return ignored


def test_dockerignore_keeps_every_copied_path_and_drops_the_rest() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    copied = set()
    for path in DOCKERFILES:
        for word, arg in instructions(path):
            if word == "COPY" and "--from" not in arg:
                sources = [a for a in arg.split() if not a.startswith("--")][:-1]
                copied.update(sources)
    assert {"pyproject.toml", "engine", "docker/entrypoint.sh"} <= copied
    for source in copied:
        assert (ROOT / source).exists(), source
        assert not dockerignored(source, patterns), source
    for sample in ("engine/model/deepseek_v41/config.py", "kvstore/manager.py"):
        assert not dockerignored(sample, patterns)
    for junk in (".venv", ".git", "tests/engine", "bench", "deploy/base", "engine/__pycache__"):
        assert dockerignored(junk, patterns), junk


# ------------------------------------------------------------------ entry point


def entrypoint(
    tmp_path: Path, args: list[str], env: dict[str, str]
) -> subprocess.CompletedProcess[str]:
    """The entry point run with a stand-in ``flashserve`` that prints its argv."""
    fake = tmp_path / "bin" / "flashserve"
    fake.parent.mkdir(exist_ok=True)
    fake.write_text('#!/bin/sh\nfor a in flashserve "$@"; do printf "%s\\n" "$a"; done\n')
    fake.chmod(0o755)
    base = {"PATH": f"{fake.parent}:/usr/bin:/bin"}
    return subprocess.run(
        ["sh", str(DOCKER / "entrypoint.sh"), *args],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=10,
    )


def run_entrypoint(tmp_path: Path, args: list[str], env: dict[str, str]) -> list[str]:
    """argv the entry point execs."""
    run = entrypoint(tmp_path, args, env)
    assert run.returncode == 0, run.stderr
    return run.stdout.splitlines()


def test_entrypoint_defaults_to_the_tiny_model_command_line(tmp_path: Path) -> None:
    argv = run_entrypoint(tmp_path, [], {})
    assert argv == [
        "flashserve",
        "serve",
        "--model",
        "tiny",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--kv-dir",
        "/var/lib/flashserve/kv",
    ]


def test_entrypoint_takes_environment_and_extra_flags(tmp_path: Path) -> None:
    env = {
        "FLASHSERVE_MODEL": "/models/DeepSeek-V4.1-Flash",
        "FLASHSERVE_PORT": "9000",
        "FLASHSERVE_KV_DIR": "/mnt/nvme/kv dir",
    }
    argv = run_entrypoint(tmp_path, ["--device", "cuda"], env)
    assert argv == [
        "flashserve",
        "serve",
        "--model",
        "/models/DeepSeek-V4.1-Flash",
        "--host",
        "0.0.0.0",
        "--port",
        "9000",
        "--kv-dir",
        "/mnt/nvme/kv dir",
        "--device",
        "cuda",
    ]


@pytest.mark.parametrize("role", ["both", "prefill", "decode"])
def test_entrypoint_gives_a_worker_its_role_model_and_kv_dir(tmp_path: Path, role: str) -> None:
    env = {"FLASHSERVE_ROLE": role, "FLASHSERVE_MODEL": "/models/m", "FLASHSERVE_KV_DIR": "/kv"}
    argv = run_entrypoint(tmp_path, ["--device", "cuda"], env)
    assert argv == [
        "flashserve",
        "serve",
        "--role",
        role,
        "--model",
        "/models/m",
        "--host",
        "0.0.0.0",
        "--port",
        "8000",
        "--kv-dir",
        "/kv",
        "--device",
        "cuda",
    ]


def test_entrypoint_gives_a_router_its_urls_and_no_model(tmp_path: Path) -> None:
    env = {
        "FLASHSERVE_ROLE": "router",
        # Commas, blanks or both; the image's own FLASHSERVE_MODEL and KV_DIR are ignored.
        "FLASHSERVE_PREFILL_URL": "http://p0:8000, http://p1:8000",
        "FLASHSERVE_DECODE_URL": "http://d0:8000 http://d1:8000,http://d2:8000",
        "FLASHSERVE_MODEL": "tiny",
        "FLASHSERVE_KV_DIR": "/var/lib/flashserve/kv",
        "FLASHSERVE_PORT": "9000",
    }
    argv = run_entrypoint(tmp_path, ["--prefill-timeout", "30"], env)
    assert argv == [
        "flashserve",
        "serve",
        "--role",
        "router",
        "--prefill-url",
        "http://p0:8000",
        "--prefill-url",
        "http://p1:8000",
        "--decode-url",
        "http://d0:8000",
        "--decode-url",
        "http://d1:8000",
        "--decode-url",
        "http://d2:8000",
        "--host",
        "0.0.0.0",
        "--port",
        "9000",
        "--prefill-timeout",
        "30",
    ]


def test_entrypoint_never_globs_a_url(tmp_path: Path) -> None:
    (tmp_path / "decoy").touch()
    env = {"FLASHSERVE_ROLE": "router", "FLASHSERVE_PREFILL_URL": "*", "FLASHSERVE_DECODE_URL": "?"}
    entrypoint(tmp_path, [], {})  # writes the stand-in flashserve
    run = subprocess.run(
        ["sh", str(DOCKER / "entrypoint.sh")],
        cwd=tmp_path,
        env={"PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin", **env},
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert run.returncode == 0, run.stderr
    argv = run.stdout.splitlines()
    assert argv[4:8] == ["--prefill-url", "*", "--decode-url", "?"]


def test_entrypoint_rejects_an_unknown_role(tmp_path: Path) -> None:
    run = entrypoint(tmp_path, [], {"FLASHSERVE_ROLE": "decoder"})
    assert run.returncode != 0
    assert "FLASHSERVE_ROLE=decoder" in run.stderr
    assert run.stdout == ""  # flashserve was never started


def test_entrypoint_runs_another_command_as_given(tmp_path: Path) -> None:
    argv = run_entrypoint(tmp_path, ["flashserve", "inspect", "--model", "tiny"], {})
    assert argv == ["flashserve", "inspect", "--model", "tiny"]


# ------------------------------------------------------------------ health check


class _Health(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.status if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def healthcheck(port: int) -> int:
    env = {**os.environ, "FLASHSERVE_PORT": str(port)}
    run = subprocess.run(
        [sys.executable, str(DOCKER / "healthcheck.py")], env=env, capture_output=True, timeout=20
    )
    return run.returncode


@pytest.mark.parametrize(("status", "healthy"), [(200, True), (503, False)])
def test_healthcheck_follows_the_health_endpoint(status: int, healthy: bool) -> None:
    handler = type("Handler", (_Health,), {"status": status})
    server = http.server.HTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        assert (healthcheck(server.server_address[1]) == 0) is healthy
    finally:
        server.shutdown()
        server.server_close()


def test_healthcheck_fails_when_nothing_listens() -> None:
    server = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    port = server.server_address[1]
    server.server_close()  # the port is free again: connection refused
    assert healthcheck(port) == 1


# ------------------------------------------------------------------ compose stack


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def scrape_jobs() -> dict[str, dict]:
    return {job["job_name"]: job for job in load(DOCKER / "prometheus.yml")["scrape_configs"]}


def test_compose_mounts_exist_and_prometheus_scrapes_the_server() -> None:
    compose = load(DOCKER / "compose.yaml")
    services = compose["services"]
    # `docker compose up` without a profile: the colocated stack alone.
    default = {name for name, service in services.items() if not service.get("profiles")}
    assert default == {"flashserve", "prometheus", "grafana"}
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (DOCKER / source).exists(), volume
    assert f"flashserve-kv:{KV_DIR}" in services["flashserve"]["volumes"]
    assert "8000:8000" in services["flashserve"]["ports"]

    prometheus = load(DOCKER / "prometheus.yml")
    job = scrape_jobs()["flashserve"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"][0]["targets"] == ["flashserve:8000"]
    # The alert rules are mounted where the rule_files glob looks.
    mounts = [v.split(":") for v in services["prometheus"]["volumes"]]
    rules_target = next(t for s, t, *_ in mounts if s.endswith("deploy/prometheus/alerts.yaml"))
    assert any(fnmatch.fnmatch(rules_target, g) for g in prometheus["rule_files"])


def split_services() -> dict[str, dict]:
    services = load(DOCKER / "compose.yaml")["services"]
    return {n: s for n, s in services.items() if "split" in s.get("profiles", [])}


def test_compose_split_profile_shares_one_kv_volume_between_the_workers() -> None:
    compose = load(DOCKER / "compose.yaml")
    colocated = compose["services"]["flashserve"]
    split = split_services()
    assert set(split) == {"router", "prefill", "decode"}
    for name, service in split.items():
        # The same CPU image as the colocated server; the image's health check
        # (GET /health on FLASHSERVE_PORT, 8000) is left to work for every role.
        assert (service["build"], service["image"]) == (colocated["build"], colocated["image"])
        assert service["environment"]["FLASHSERVE_ROLE"] == name
        assert "healthcheck" not in service and "FLASHSERVE_PORT" not in service["environment"]
    kv = {name: split[name]["volumes"] for name in ("prefill", "decode")}
    assert kv["prefill"] == kv["decode"]
    (volume,) = kv["prefill"]
    source, target = volume.split(":")
    assert target == KV_DIR
    assert source in compose["volumes"]
    assert f"{source}:{KV_DIR}" not in colocated["volumes"]  # not the colocated server's cache
    env = {name: s["environment"] for name, s in split.items()}
    assert env["prefill"]["FLASHSERVE_MODEL"] == env["decode"]["FLASHSERVE_MODEL"]
    assert len({e["FLASHSERVE_API_KEYS"] for e in env.values()}) == 1
    # Workers publish nothing; the router is the entry, beside the colocated :8000.
    assert "ports" not in split["prefill"] and "ports" not in split["decode"]
    assert split["router"]["ports"] == ["8001:8000"]
    assert "volumes" not in split["router"] and "FLASHSERVE_MODEL" not in env["router"]


def test_compose_router_urls_name_the_worker_services() -> None:
    split = split_services()
    router = split["router"]["environment"]
    for role in ("prefill", "decode"):
        urls = router[f"FLASHSERVE_{role.upper()}_URL"].replace(",", " ").split()
        assert urls == [f"http://{role}:8000"]
        assert role in split["router"]["depends_on"]


def test_prometheus_discovers_the_split_services_without_static_targets() -> None:
    """Without the profile their names do not resolve: no target, so nothing is down."""
    job = scrape_jobs()["flashserve-split"]
    assert job["metrics_path"] == "/metrics"
    assert "static_configs" not in job
    (sd,) = job["dns_sd_configs"]
    assert set(sd["names"]) == set(split_services())
    assert (sd["type"], sd["port"]) == ("A", 8000)
    for other in scrape_jobs().values():
        for static in other.get("static_configs", []):
            hosts = {t.split(":")[0] for t in static["targets"]}
            assert not hosts & set(split_services()), other["job_name"]


def test_grafana_provisioning_finds_the_dashboard_and_datasource() -> None:
    grafana = load(DOCKER / "compose.yaml")["services"]["grafana"]
    mounts = {s: t for s, t, *_ in (v.split(":") for v in grafana["volumes"])}
    provisioning = mounts["./grafana/provisioning"]
    assert provisioning == "/etc/grafana/provisioning"
    dashboard_file = mounts["../deploy/grafana/flashserve.json"]

    providers = load(DOCKER / "grafana/provisioning/dashboards/flashserve.yaml")["providers"]
    assert Path(dashboard_file).parent == Path(providers[0]["options"]["path"])
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == dashboard_file

    (source,) = load(DOCKER / "grafana/provisioning/datasources/prometheus.yaml")["datasources"]
    assert source["type"] == "prometheus" and source["isDefault"] is True
    assert source["url"] == "http://prometheus:9090"
    assert "9090:9090" in load(DOCKER / "compose.yaml")["services"]["prometheus"]["ports"]
