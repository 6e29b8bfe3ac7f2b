"""scripts/validate_crds.py and the LeaderWorkerSet schema: strict where a CRD is.

make lint-deploy trusts these two to keep the multi-node overlay under strict
validation although kubernetes-validate has no LeaderWorkerSet: the schema must
refuse what the LWS API refuses, and the pod templates inside must reach
kubernetes-validate --strict as PodTemplates.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml
from deploy_helpers import RENDER, ROOT

LWS_DIR = ROOT / "deploy/overlays/multinode-lws"
SCHEMA_PATH = LWS_DIR / "leaderworkerset-v1.schema.json"
SCHEMA = json.loads(SCHEMA_PATH.read_text())
VALIDATE = Path(sys.executable).parent / "kubernetes-validate"

pytestmark = pytest.mark.skipif(
    RENDER is None, reason="NOTICE: kubectl/kustomize not installed; overlay not rendered"
)


def _load_script():
    spec = importlib.util.spec_from_file_location(
        "validate_crds", ROOT / "scripts/validate_crds.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    run = subprocess.run(
        [*(RENDER or []), str(LWS_DIR)], capture_output=True, text=True, timeout=60, check=True
    )
    return [d for d in yaml.safe_load_all(run.stdout) if d]


def _lws(docs: list[dict]) -> dict:
    (lws,) = [d for d in docs if d["kind"] == "LeaderWorkerSet"]
    return lws


@pytest.mark.parametrize(
    ("path", "bad"),
    [
        (("spec", "extra"), 1),
        (("spec", "leaderWorkerTemplate", "size"), 0),
        (("spec", "leaderWorkerTemplate", "restartPolicy"), "Always"),
        (("spec", "leaderWorkerTemplate", "workerTemplates"), {}),
        (("spec", "startupPolicy"), "WorkersFirst"),
        (("spec", "networkConfig", "subdomainPolicy"), "Private"),
        (("spec", "rolloutStrategy", "rollingUpdateConfiguration", "maxSurge"), "ten"),
        (("apiVersion",), "leaderworkerset.x-k8s.io/v2"),
    ],
)
def test_the_schema_accepts_the_overlay_and_refuses_what_the_api_does(
    docs: list[dict], path: tuple[str, ...], bad: object
) -> None:
    lws = _lws(docs)
    jsonschema.validate(lws, SCHEMA)
    broken = copy.deepcopy(lws)
    node = broken
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = bad
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, SCHEMA)


def test_embedded_templates_become_core_documents(docs: list[dict], tmp_path: Path) -> None:
    script = _load_script()
    rendered, out = tmp_path / "in.yaml", tmp_path / "out.yaml"
    rendered.write_text(yaml.safe_dump_all(docs))
    assert script.main([str(rendered), str(out), str(SCHEMA_PATH)]) == 0
    written = list(yaml.safe_load_all(out.read_text()))
    kinds = sorted(d["kind"] for d in written)
    assert kinds == ["ConfigMap", "PersistentVolumeClaim", "PodTemplate", "PodTemplate", "Service"]
    group = _lws(docs)["spec"]["leaderWorkerTemplate"]
    templates = [d["template"] for d in written if d["kind"] == "PodTemplate"]
    assert templates == [group["leaderTemplate"], group["workerTemplate"]]
    # A kind whose schema is expected (--expect-schemas-in) but not given: refused.
    args = [
        str(rendered),
        str(out),
        str(ROOT / "deploy/inference-pool/inferencepool-v1.schema.json"),
    ]
    assert script.main([*args, "--expect-schemas-in", str(LWS_DIR)]) == 1


@pytest.mark.skipif(not VALIDATE.exists(), reason="kubernetes-validate not installed")
def test_an_unknown_pod_field_inside_the_lws_fails_strict_validation(
    docs: list[dict], tmp_path: Path
) -> None:
    script = _load_script()
    broken = copy.deepcopy(docs)
    _lws(broken)["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containerz"] = []
    for name, case in (("good", docs), ("bad", broken)):
        rendered, out = tmp_path / f"{name}.yaml", tmp_path / f"{name}-builtin.yaml"
        rendered.write_text(yaml.safe_dump_all(case))
        assert script.main([str(rendered), str(out), str(SCHEMA_PATH)]) == 0  # a pod is core
        run = subprocess.run(
            [str(VALIDATE), "--strict", "--quiet", str(out)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if name == "good":
            assert run.returncode == 0 and not run.stdout.strip(), run.stdout + run.stderr
        else:
            assert run.returncode != 0 and "containerz" in run.stdout + run.stderr
