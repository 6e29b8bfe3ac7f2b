"""deploy/: the rendered overlays agree with the image and with each other.

``make lint-deploy`` validates the rendered manifests against the Kubernetes
schemas; these tests check what a schema cannot (probe paths, ports, GPU counts,
the SSD volume's mount, which pods a Service reaches; for the split overlay,
the shared volume and the router's URLs). They need kubectl (or kustomize) to
render, and skip without it.
"""

from __future__ import annotations

import subprocess
from urllib.parse import urlsplit

import pytest
import yaml
from deploy_helpers import RENDER, ROOT

pytestmark = pytest.mark.skipif(
    RENDER is None, reason="NOTICE: kubectl/kustomize not installed; overlays not rendered"
)

OVERLAYS = sorted(p.name for p in (ROOT / "deploy/overlays").iterdir() if p.is_dir())
KV_DIR = "/var/lib/flashserve/kv"  # the image's VOLUME
WORKLOAD_KINDS = ("StatefulSet", "Deployment", "LeaderWorkerSet")


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


def templates(workload: dict) -> dict[str, dict]:
    """The workload's pod templates: a LeaderWorkerSet's leader and worker, else its one."""
    if workload["kind"] == "LeaderWorkerSet":
        group = workload["spec"]["leaderWorkerTemplate"]
        return {"leader": group["leaderTemplate"], "worker": group["workerTemplate"]}
    return {"": workload["spec"]["template"]}


def serving_template(workload: dict) -> dict:
    """The pod template that serves HTTP (a LeaderWorkerSet's leader)."""
    pods = templates(workload)
    return pods.get("leader", pods.get(""))  # type: ignore[return-value]


def claim_templates(workload: dict) -> list[dict] | None:
    spec = workload["spec"]
    if workload["kind"] == "LeaderWorkerSet":
        return spec["leaderWorkerTemplate"].get("volumeClaimTemplates")
    return spec.get("volumeClaimTemplates")


def container_of(workload: dict, template: dict | None = None) -> dict:
    pod = serving_template(workload) if template is None else template
    (container,) = [c for c in pod["spec"]["containers"] if c["name"] == "flashserve"]
    return container


def workloads(resources: dict[str, dict]) -> dict[str, dict]:
    """kind/name -> every StatefulSet and Deployment running flashserve."""
    return {k: r for k, r in resources.items() if r["kind"] in WORKLOAD_KINDS}


def server(resources: dict[str, dict]) -> tuple[dict, dict, dict]:
    """(StatefulSet, its pod spec, its flashserve container) of a colocated overlay."""
    sts = resources["StatefulSet/flashserve"]
    return sts, sts["spec"]["template"]["spec"], container_of(sts)


def config(resources: dict[str, dict], workload: dict | None = None) -> dict[str, str]:
    """The environment ConfigMap of ``workload`` (default: the colocated server's)."""
    if workload is None:
        (cm,) = [r for k, r in resources.items() if k.startswith("ConfigMap/flashserve-config")]
        return cm["data"]
    (ref,) = [
        e["configMapRef"]["name"] for e in container_of(workload)["envFrom"] if "configMapRef" in e
    ]
    return resources[f"ConfigMap/{ref}"]["data"]


def role(resources: dict[str, dict], workload: dict) -> str:
    return config(resources, workload).get("FLASHSERVE_ROLE", "both")


def pod_labels(workload: dict) -> dict[str, str]:
    return serving_template(workload)["metadata"]["labels"]


def selected(resources: dict[str, dict], service: dict) -> list[str]:
    """The workloads whose pods a Service selects."""
    selector = service["spec"]["selector"].items()
    return [k for k, w in workloads(resources).items() if selector <= pod_labels(w).items()]


def test_overlays_exist() -> None:
    assert OVERLAYS == ["cpu-demo", "gpu", "gpu-dp-ep", "multinode-lws", "split"]


def test_probes_ports_and_scrape_annotations_agree(rendered) -> None:
    _, resources = rendered
    assert workloads(resources)
    for key, workload in workloads(resources).items():
        container = container_of(workload)
        port = int(config(resources, workload)["FLASHSERVE_PORT"])
        # One HTTP port (a multi-node leader also opens torch.distributed's, "dist", and
        # the engine core's step channel, "steps").
        (http,) = [p for p in container["ports"] if p["name"] not in ("dist", "steps")]
        assert (http["name"], http["containerPort"]) == ("http", port), key
        for probe in ("startupProbe", "readinessProbe"):
            assert container[probe]["httpGet"] == {"path": "/health", "port": "http"}, key
        liveness = {k: v for k, v in container["livenessProbe"].items() if "Seconds" not in k}
        liveness.pop("failureThreshold")
        assert liveness in (
            {"httpGet": {"path": "/health", "port": "http"}},
            {"tcpSocket": {"port": "http"}},
        ), key
        notes = serving_template(workload)["metadata"]["annotations"]
        assert notes["prometheus.io/scrape"] == "true"
        assert notes["prometheus.io/port"] == str(port)
        assert notes["prometheus.io/path"] == "/metrics"
        if "selector" in workload["spec"]:  # a LeaderWorkerSet selects its pods itself
            selector = workload["spec"]["selector"]["matchLabels"]
            assert selector.items() <= pod_labels(workload).items()
        if workload["kind"] == "StatefulSet":
            headless = resources[f"Service/{workload['spec']['serviceName']}"]
            assert headless["spec"]["clusterIP"] == "None"
            assert selected(resources, headless) == [key]


def test_each_service_selects_one_workload_by_its_http_port(rendered) -> None:
    """A Service over two workloads would send clients to prefill workers (split)."""
    _, resources = rendered
    services = [r for r in resources.values() if r["kind"] == "Service"]
    assert services
    for service in services:
        assert len(selected(resources, service)) == 1, service["metadata"]["name"]
        assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]
    assert "Service/flashserve" in resources  # the public name in every overlay


def test_ssd_tier_is_a_persistent_volume_at_the_kv_dir(rendered) -> None:
    _, resources = rendered
    for key, workload in workloads(resources).items():
        if role(resources, workload) == "router":
            continue  # no kv dir (test_split_router_has_no_gpu_model_or_volume)
        kv_dir = config(resources, workload)["FLASHSERVE_KV_DIR"]
        for pod in templates(workload).values():
            mounts = {
                m["name"]: m["mountPath"] for m in container_of(workload, pod)["volumeMounts"]
            }
            assert mounts["kv"] == kv_dir == KV_DIR, key
        claims = claim_templates(workload)
        if claims:  # a colocated server: a volume of its own
            (claim,) = claims
            assert claim["metadata"]["name"] == "kv"
            assert "ReadWriteOnce" in claim["spec"]["accessModes"]
        else:  # a split pool: the shared claim
            volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
            name = volumes["kv"]["persistentVolumeClaim"]["claimName"]
            assert f"PersistentVolumeClaim/{name}" in resources, key


def test_runs_as_the_image_user_with_a_read_only_root(rendered) -> None:
    _, resources = rendered
    dockerfile = (ROOT / "docker/Dockerfile").read_text()
    assert "USER 10001:10001" in dockerfile
    assert "XDG_CACHE_HOME=/var/lib/flashserve/.cache" in dockerfile
    for key, workload in workloads(resources).items():
        for template in templates(workload).values():
            pod, container = template["spec"], container_of(workload, template)
            ctx = pod["securityContext"]
            assert ctx["runAsNonRoot"] is True, key
            assert (ctx["runAsUser"], ctx["runAsGroup"], ctx["fsGroup"]) == (10001, 10001, 10001)
            assert container["securityContext"]["readOnlyRootFilesystem"] is True, key
            mounts = {m["mountPath"] for m in container["volumeMounts"]}
            # The writable places under the read-only root (Triton cache via XDG, /tmp).
            assert {"/var/lib/flashserve/.cache", "/tmp"} <= mounts, key


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


# ------------------------------------------------------------------ split


@pytest.fixture(scope="module")
def split() -> dict[str, dict]:
    return render("split")


def by_role(resources: dict[str, dict]) -> dict[str, dict]:
    out = {role(resources, w): w for w in workloads(resources).values()}
    assert len(out) == len(workloads(resources))
    return out


def test_split_has_a_prefill_pool_a_decode_pool_and_a_router(split) -> None:
    roles = by_role(split)
    assert set(roles) == {"prefill", "decode", "router"}
    assert roles["prefill"]["kind"] == roles["decode"]["kind"] == "StatefulSet"
    assert roles["router"]["kind"] == "Deployment"
    # One image for all three: router and workers move to a new version together.
    assert len({container_of(w)["image"] for w in roles.values()}) == 1


def test_split_pools_share_one_read_write_many_claim(split) -> None:
    roles = by_role(split)
    claims = set()
    for pool in ("prefill", "decode"):
        spec = roles[pool]["spec"]
        assert "volumeClaimTemplates" not in spec, pool
        volumes = {v["name"]: v for v in spec["template"]["spec"]["volumes"]}
        claims.add(volumes["kv"]["persistentVolumeClaim"]["claimName"])
    (claim,) = claims
    pvc = split[f"PersistentVolumeClaim/{claim}"]["spec"]
    assert pvc["accessModes"] == ["ReadWriteMany"]
    assert pvc["storageClassName"]  # an RWX class: the cluster default rarely is one
    # The same path on both pools (page files are found by name under it).
    assert {config(split, roles[p])["FLASHSERVE_KV_DIR"] for p in ("prefill", "decode")} == {KV_DIR}


def test_split_pools_are_the_gpu_overlays_pod_with_a_role(split) -> None:
    gpu = render("gpu")
    _, gpu_pod, gpu_container = server(gpu)
    roles = by_role(split)
    for pool in ("prefill", "decode"):
        pod = roles[pool]["spec"]["template"]["spec"]
        container = container_of(roles[pool])
        assert container["resources"] == gpu_container["resources"], pool
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "8"
        assert container["args"] == gpu_container["args"]
        assert pod["tolerations"] == gpu_pod["tolerations"]
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert {"/dev/shm", "/models"} <= mounts
        env = config(split, roles[pool])
        assert env["FLASHSERVE_MODEL"] == config(gpu)["FLASHSERVE_MODEL"]
    # The same model on both pools, or no page hash matches.
    assert (
        config(split, roles["prefill"])["FLASHSERVE_MODEL"]
        == config(split, roles["decode"])["FLASHSERVE_MODEL"]
    )


def test_split_router_has_no_gpu_model_or_volume(split) -> None:
    router = by_role(split)["router"]
    container = container_of(router)
    assert "nvidia.com/gpu" not in yaml.safe_dump(router)
    assert "tolerations" not in router["spec"]["template"]["spec"]
    env = config(split, router)
    assert "FLASHSERVE_MODEL" not in env and "FLASHSERVE_KV_DIR" not in env
    assert "kv" not in {m["name"] for m in container["volumeMounts"]}
    # The image's entry point with no args: the CUDA image's --device cuda is dropped.
    dockerfile = (ROOT / "docker/Dockerfile").read_text()
    assert f'ENTRYPOINT ["{container["command"][0]}"]' in dockerfile
    assert container["command"] == ["/usr/local/bin/flashserve-entrypoint"]
    assert "args" not in container
    # Not restarted when the decode pool is down (its /health says so).
    assert "tcpSocket" in container["livenessProbe"]


def test_split_router_urls_name_the_pools_services(split) -> None:
    roles = by_role(split)
    env = config(split, roles["router"])
    for pool in ("prefill", "decode"):
        urls = env[f"FLASHSERVE_{pool.upper()}_URL"].replace(",", " ").split()
        assert urls, pool
        for url in urls:
            parsed = urlsplit(url)
            assert parsed.scheme == "http"
            service = split[f"Service/{parsed.hostname}"]
            assert parsed.port in [p["port"] for p in service["spec"]["ports"]]
            (target,) = selected(split, service)
            assert role(split, split[target]) == pool, url
    # The public Service reaches routers only.
    (public,) = selected(split, split["Service/flashserve"])
    assert role(split, split[public]) == "router"


def test_split_gives_every_role_the_same_api_keys(split) -> None:
    secrets = {
        tuple(e["secretRef"]["name"] for e in container_of(w)["envFrom"] if "secretRef" in e)
        for w in workloads(split).values()
    }
    assert secrets == {("flashserve-api-keys",)}


def test_split_replicas_name_rendered_workloads() -> None:
    """Each pool and the router scale by the overlay's `replicas` (kustomize edit set replicas)."""
    kustomization = yaml.safe_load((ROOT / "deploy/overlays/split/kustomization.yaml").read_text())
    names = {w["metadata"]["name"]: w for w in workloads(render("split")).values()}
    for entry in kustomization["replicas"]:
        assert names[entry["name"]]["spec"]["replicas"] == entry["count"], entry
    assert {e["name"] for e in kustomization["replicas"]} == set(names)


# ------------------------------------------------------- parallel serving


def flag(args: list[str], name: str) -> str:
    """The value after ``name`` in a serve command line (the last one wins, as argparse)."""
    (i,) = [i for i, a in enumerate(args) if a == name][-1:]
    return args[i + 1]


def test_gpu_dp_ep_is_the_gpu_pod_serving_dp8_with_expert_parallelism() -> None:
    gpu, dp_ep = render("gpu"), render("gpu-dp-ep")
    _, gpu_pod, gpu_container = server(gpu)
    _, pod, container = server(dp_ep)
    args = container["args"]
    assert args[:2] == ["--device", "cuda"] and "--enable-expert-parallel" in args
    gpus = container["resources"]["limits"]["nvidia.com/gpu"]
    assert flag(args, "--data-parallel-size") == gpus == "8"  # one DP rank per GPU
    assert "--tensor-parallel-size" not in args
    # Everything but the serve flags is the gpu overlay's pod: GPUs, /dev/shm, weights.
    assert {k: v for k, v in container.items() if k != "args"} == {
        k: v for k, v in gpu_container.items() if k != "args"
    }
    assert {k: v for k, v in pod.items() if k != "containers"} == {
        k: v for k, v in gpu_pod.items() if k != "containers"
    }
    assert config(dp_ep) == config(gpu)


@pytest.fixture(scope="module")
def multinode() -> dict[str, dict]:
    return render("multinode-lws")


def test_multinode_is_a_leader_worker_set_of_two_8_gpu_nodes(multinode) -> None:
    (lws,) = [r for r in multinode.values() if r["kind"] == "LeaderWorkerSet"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    group = lws["spec"]["leaderWorkerTemplate"]
    size = group["size"]
    assert size == 2
    # A dead pod takes the group down: the others' collectives cannot go on without it.
    assert group["restartPolicy"] == "RecreateGroupOnPodRestart"
    pods = templates(lws)
    leader, worker = (container_of(lws, pods[r]) for r in ("leader", "worker"))
    for c in (leader, worker):
        args = c["args"]
        gpus = int(c["resources"]["limits"]["nvidia.com/gpu"])
        assert gpus == 8 and args[:2] == ["--device", "cuda"]
        assert flag(args, "--nnodes") == str(size)
        assert flag(args, "--data-parallel-size") == str(gpus * size)  # DP16 x EP16
        assert "--enable-expert-parallel" in args
        assert flag(args, "--master-addr") == "$(LWS_LEADER_ADDRESS)"
        assert flag(args, "--master-port") == flag(leader["args"], "--master-port")
    assert flag(leader["args"], "--node-rank") == "0"
    assert flag(worker["args"], "--node-rank") == "$(LWS_WORKER_INDEX)"
    (dist,) = [p for p in leader["ports"] if p["name"] == "dist"]
    assert str(dist["containerPort"]) == flag(leader["args"], "--master-port")
    # Node 1's ranks reach the engine core's step channel one port above it.
    (steps,) = [p for p in leader["ports"] if p["name"] == "steps"]
    assert steps["containerPort"] == int(flag(leader["args"], "--master-port")) + 1
    # The API, its probes and /metrics are the leader's; a worker serves nothing.
    assert "ports" not in worker and "readinessProbe" not in worker
    assert "prometheus.io/scrape" not in pods["worker"]["metadata"].get("annotations", {})
    (public,) = selected(multinode, multinode["Service/flashserve"])
    assert public == f"LeaderWorkerSet/{lws['metadata']['name']}"
    service_selector = multinode["Service/flashserve"]["spec"]["selector"].items()
    assert not service_selector <= pods["worker"]["metadata"]["labels"].items()
    # LWS names its own headless Service after the set: it must not take the public name.
    assert lws["metadata"]["name"] != "flashserve"


def test_multinode_pods_are_the_gpu_overlays_pod(multinode) -> None:
    gpu = render("gpu")
    sts, gpu_pod, gpu_container = server(gpu)
    (lws,) = [r for r in multinode.values() if r["kind"] == "LeaderWorkerSet"]
    for name, template in templates(lws).items():
        pod, container = template["spec"], container_of(lws, template)
        assert container["resources"] == gpu_container["resources"], name
        assert container["securityContext"] == gpu_container["securityContext"], name
        assert container["image"] == gpu_container["image"], name
        for key in ("securityContext", "tolerations", "terminationGracePeriodSeconds"):
            assert pod[key] == gpu_pod[key], (name, key)
        assert {v["name"]: v for v in pod["volumes"]} == {
            v["name"]: v for v in gpu_pod["volumes"]
        }, name
        mounts = sorted(container["volumeMounts"], key=lambda m: m["mountPath"])
        assert mounts == sorted(gpu_container["volumeMounts"], key=lambda m: m["mountPath"]), name
        assert config(multinode, lws)["FLASHSERVE_MODEL"] == config(gpu)["FLASHSERVE_MODEL"]
    # The leader's probes are the single-node server's.
    leader = container_of(lws)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert leader[probe] == gpu_container[probe], probe
    assert claim_templates(lws) == [
        {**c, "metadata": {"name": c["metadata"]["name"]}}
        for c in sts["spec"]["volumeClaimTemplates"]
    ]
