"""deploy/: the rendered overlays agree with the image and with each other.

``make lint-deploy`` validates the rendered manifests against the Kubernetes
schemas; these tests check what a schema cannot (probe paths, ports, GPU counts,
the SSD volume's mount). They need kubectl (or kustomize) to render, and skip
without it.
"""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml
from deploy_helpers import ROOT

if shutil.which("kubectl"):
    RENDER = ["kubectl", "kustomize"]
elif shutil.which("kustomize"):
    RENDER = ["kustomize", "build"]
else:
    RENDER = None
pytestmark = pytest.mark.skipif(
    RENDER is None, reason="NOTICE: kubectl/kustomize not installed; overlays not rendered"
)

OVERLAYS = sorted(p.name for p in (ROOT / "deploy/overlays").iterdir() if p.is_dir())


def render(overlay: str) -> dict[str, dict]:
    """kind/name -> resource of the rendered overlay."""
    run = subprocess.run(
        [*RENDER, str(ROOT / "deploy/overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    docs = [d for d in yaml.safe_load_all(run.stdout) if d]
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in docs}


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> tuple[str, dict[str, dict]]:
    return request.param, render(request.param)


def server(resources: dict[str, dict]) -> tuple[dict, dict, dict]:
    """(StatefulSet, its pod spec, its flashserve container)."""
    sts = resources["StatefulSet/flashserve"]
    pod = sts["spec"]["template"]["spec"]
    (container,) = [c for c in pod["containers"] if c["name"] == "flashserve"]
    return sts, pod, container


def config(resources: dict[str, dict]) -> dict[str, str]:
    (cm,) = [r for key, r in resources.items() if key.startswith("ConfigMap/flashserve-config")]
    return cm["data"]


def test_both_overlays_exist() -> None:
    assert OVERLAYS == ["cpu-demo", "gpu"]


def test_probes_ports_and_scrape_annotations_agree(rendered) -> None:
    _, resources = rendered
    sts, _, container = server(resources)
    port = int(config(resources)["FLASHSERVE_PORT"])
    (http,) = container["ports"]
    assert (http["name"], http["containerPort"]) == ("http", port)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    notes = sts["spec"]["template"]["metadata"]["annotations"]
    assert notes["prometheus.io/scrape"] == "true"
    assert notes["prometheus.io/port"] == str(port)
    assert notes["prometheus.io/path"] == "/metrics"
    for service in ("Service/flashserve", "Service/flashserve-headless"):
        svc = resources[service]["spec"]
        assert svc["ports"][0]["targetPort"] == "http"
        labels = sts["spec"]["template"]["metadata"]["labels"]
        assert svc["selector"].items() <= labels.items()
    assert sts["spec"]["serviceName"] == "flashserve-headless"
    assert sts["spec"]["selector"]["matchLabels"].items() <= labels.items()


def test_ssd_tier_is_a_persistent_volume_at_the_kv_dir(rendered) -> None:
    _, resources = rendered
    sts, _, container = server(resources)
    kv_dir = config(resources)["FLASHSERVE_KV_DIR"]
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["kv"] == kv_dir == "/var/lib/flashserve/kv"  # the image's VOLUME
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "kv"
    assert "ReadWriteOnce" in claim["spec"]["accessModes"]


def test_runs_as_the_image_user_with_a_read_only_root(rendered) -> None:
    _, resources = rendered
    _, pod, container = server(resources)
    dockerfile = (ROOT / "docker/Dockerfile").read_text()
    assert "USER 10001:10001" in dockerfile
    ctx = pod["securityContext"]
    assert ctx["runAsNonRoot"] is True
    assert (ctx["runAsUser"], ctx["runAsGroup"], ctx["fsGroup"]) == (10001, 10001, 10001)
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    # The writable places under the read-only root (Triton cache via XDG, /tmp).
    assert {"/var/lib/flashserve/.cache", "/tmp"} <= mounts
    assert "XDG_CACHE_HOME=/var/lib/flashserve/.cache" in dockerfile


def test_cpu_demo_needs_no_gpu_and_serves_tiny() -> None:
    resources = render("cpu-demo")
    _, _, container = server(resources)
    assert "nvidia.com/gpu" not in yaml.safe_dump(resources)
    assert "args" not in container  # no --device cuda
    assert container["image"].endswith("-cpu")
    assert config(resources)["FLASHSERVE_MODEL"] == "tiny"


def test_gpu_overlay_takes_eight_gpus_shared_memory_and_weights() -> None:
    resources = render("gpu")
    sts, pod, container = server(resources)
    for kind in ("requests", "limits"):
        assert container["resources"][kind]["nvidia.com/gpu"] == "8"
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert volumes[mounts["/dev/shm"]["name"]]["emptyDir"]["medium"] == "Memory"
    assert mounts["/models"]["readOnly"] is True
    assert config(resources)["FLASHSERVE_MODEL"].startswith("/models/")
    assert container["args"][:2] == ["--device", "cuda"]
    assert container["image"].endswith("-cuda")
    claim = sts["spec"]["volumeClaimTemplates"][0]["spec"]
    assert claim["storageClassName"] == "local-nvme"
