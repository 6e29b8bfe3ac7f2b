"""deploy/inference-pool: flashserve behind the Gateway API inference extension.

The InferencePool is validated strictly against the CRD schema kept beside it
(kubernetes-validate knows only built-in kinds); the rest is checked for what
the endpoint picker needs: the pool selects the server's pods on their HTTP
port, and the server exposes the vLLM-named metrics it scrapes.
"""

from __future__ import annotations

import copy
import json
import subprocess

import jsonschema
import pytest
import yaml
from deploy_helpers import RENDER, ROOT

from server.metrics.vllm_metrics import GAUGES

POOL_DIR = ROOT / "deploy/inference-pool"
SCHEMA = json.loads((POOL_DIR / "inferencepool-v1.schema.json").read_text())
pytestmark = pytest.mark.skipif(
    RENDER is None, reason="NOTICE: kubectl/kustomize not installed; the pool not rendered"
)


@pytest.fixture(scope="module")
def rendered() -> dict[str, dict]:
    run = subprocess.run(
        [*(RENDER or []), str(POOL_DIR)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    docs = [d for d in yaml.safe_load_all(run.stdout) if d]
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in docs}


def test_pool_validates_strictly_and_the_schema_rejects_what_the_crd_does(rendered) -> None:
    pool = rendered["InferencePool/flashserve"]
    jsonschema.validate(pool, SCHEMA)
    for path, bad in (
        (("spec", "targetPorts"), []),
        (("spec", "endpointPickerRef", "failureMode"), "Sometimes"),
        (("spec", "extra"), 1),
        (("spec", "targetPorts", 0, "number"), 70000),
    ):
        broken = copy.deepcopy(pool)
        node = broken
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = bad
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, SCHEMA)


def test_pool_selects_the_server_pods_on_their_http_port(rendered) -> None:
    pool = rendered["InferencePool/flashserve"]["spec"]
    sts = rendered["StatefulSet/flashserve"]
    labels = sts["spec"]["template"]["metadata"]["labels"]
    assert pool["selector"]["matchLabels"].items() <= labels.items()
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    (port,) = container["ports"]
    assert [p["number"] for p in pool["targetPorts"]] == [port["containerPort"]]
    assert "--vllm-metric-aliases" in container["args"]
    # The picker's defaults read these gauges (server/metrics/vllm_metrics.py).
    assert {"num_requests_waiting", "num_requests_running", "kv_cache_usage_perc"} <= set(GAUGES)
