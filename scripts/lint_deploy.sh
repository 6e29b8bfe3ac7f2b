#!/usr/bin/env bash
# Checks of the packaging files, each by the tool that owns its format
# (docs/deploy.md, "What CI checks"). Run by `make lint-deploy`.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-.venv/bin}

step() { printf '== %s\n' "$*"; }
missing() {
    echo "lint_deploy: $1 not found; run 'make setup' as root (scripts/install_tools.sh)" >&2
    exit 1
}

step "hadolint: docker/Dockerfile docker/Dockerfile.cpu"
"$BIN/hadolint" docker/Dockerfile docker/Dockerfile.cpu

step "docker-compose config: docker/compose.yaml (+ compose.gpu.yaml, + profile split)"
command -v docker-compose >/dev/null 2>&1 || missing docker-compose
docker-compose -f docker/compose.yaml config -q
docker-compose -f docker/compose.yaml -f docker/compose.gpu.yaml config -q
docker-compose -f docker/compose.yaml --profile split config -q

step "promtool: config, alert rules, rule unit tests"
command -v promtool >/dev/null 2>&1 || missing promtool
promtool check config --syntax-only docker/prometheus.yml >/dev/null
promtool check rules deploy/prometheus/alerts.yaml >/dev/null
promtool test rules deploy/prometheus/alerts_test.yaml

# kubernetes-validate only warns (exit 0) on a kind it has no schema for:
# any output under --quiet is a failure here.
validate() {
    local out
    out=$("$BIN/kubernetes-validate" --strict --quiet "$@") || { echo "$out" >&2; return 1; }
    if [ -n "$out" ]; then
        echo "$out" >&2
        return 1
    fi
}

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if command -v kubectl >/dev/null 2>&1; then
    render=(kubectl kustomize)
elif command -v kustomize >/dev/null 2>&1; then
    render=(kustomize build)
else
    render=()
fi
# Custom resources (InferencePool, LeaderWorkerSet) against the schemas beside their
# kustomizations, their embedded pod templates and claims through kubernetes-validate
# with the built-in kinds (scripts/validate_crds.py).
schemas=(deploy/inference-pool/*.schema.json deploy/overlays/*/*.schema.json)
crds() { "$BIN/python" scripts/validate_crds.py "$1" "$2" "${schemas[@]}" "${@:3}"; }
if [ "${#render[@]}" -gt 0 ]; then
    for overlay in deploy/overlays/*/; do
        name=$(basename "$overlay")
        step "${render[*]} deploy/overlays/$name | CRD schemas + kubernetes-validate --strict"
        "${render[@]}" "$overlay" >"$tmp/$name.yaml"
        # An overlay with a schema beside it must render that kind.
        crds "$tmp/$name.yaml" "$tmp/$name-builtin.yaml" --expect-schemas-in "$overlay"
        validate "$tmp/$name-builtin.yaml"
    done
    # The InferencePool example: built-in kinds by kubernetes-validate, the CRD kind
    # against the schema beside it (kubernetes-validate has none for it).
    step "${render[*]} deploy/inference-pool | kubernetes-validate --strict + CRD schema"
    "${render[@]}" deploy/inference-pool >"$tmp/inference-pool.yaml"
    crds "$tmp/inference-pool.yaml" "$tmp/inference-pool-builtin.yaml" --expect InferencePool
    validate "$tmp/inference-pool-builtin.yaml"
else
    echo "NOTICE: neither kubectl nor kustomize is installed: the overlays are NOT" \
        "rendered; validating the base manifests as written instead." >&2
    step "kubernetes-validate --strict deploy/base (unrendered)"
    validate deploy/base/statefulset.yaml deploy/base/service.yaml
fi
step "deploy lint passed"
