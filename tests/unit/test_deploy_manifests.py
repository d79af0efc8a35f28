"""The deployment artifacts validate offline, and the validators catch what they are there for.

The whole of deploy/scripts/validate_deploy.sh runs once; the other tests break a manifest on
purpose and expect a validator to say so, so that a passing run means something.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from tests.support.deploy_validators import is_kvplane_workload, load_deploy_checks

ROOT = Path(__file__).resolve().parents[2]
VALIDATE = ROOT / "deploy" / "scripts" / "validate"
BIN = Path(sys.executable).parent


def _missing_validators() -> list[str]:
    missing = []
    for module in ("check_jsonschema", "kubernetes_validate", "helm_python", "dockerfile", "compose"):
        if importlib.util.find_spec(module) is None:
            missing.append(module)
    if not (BIN / "hadolint").exists():
        missing.append("hadolint")
    if shutil.which("node") is None:
        missing.append("node")
    return missing


MISSING = _missing_validators()
pytestmark = pytest.mark.skipif(
    bool(MISSING), reason=f"deploy validators not installed ({', '.join(MISSING)}): pip install -e '.[dev]'"
)


@pytest.fixture(scope="module")
def checks() -> ModuleType:
    return load_deploy_checks()


@pytest.fixture(scope="module")
def compose_bin() -> str:
    import compose

    return str(Path(compose.__file__).parent / "docker-compose")


@pytest.fixture(scope="module")
def default_chart(checks: ModuleType) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = checks.render_chart(
        {"engines": {"sim": {"enabled": True}}}, "kvp", "kvplane"
    )
    return docs


@pytest.fixture(scope="module")
def resolved_compose(compose_bin: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = subprocess.run(
        [compose_bin, "-f", str(ROOT / "deploy/compose/compose.yaml"), "config", "--format", "json"],
        env={**os.environ, "COMPOSE_PROFILES": "*"},
        capture_output=True,
        text=True,
        check=True,
    )
    project: dict[str, Any] = json.loads(out.stdout)
    return project


def _report(checks: ModuleType) -> Any:
    return checks.Report()


def test_validate_deploy_script_passes() -> None:
    env = {**os.environ, "VENV": str(BIN.parent)}
    result = subprocess.run(
        ["bash", str(ROOT / "deploy/scripts/validate_deploy.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "validate_deploy: all checks passed" in result.stdout


def test_compose_schema_rejects_a_misspelt_key(tmp_path: Path) -> None:
    bad = yaml.safe_load((ROOT / "deploy/compose/compose.yaml").read_text())
    bad["services"]["metadata"]["healthchek"] = bad["services"]["metadata"].pop("healthcheck")
    path = tmp_path / "compose.yaml"
    path.write_text(yaml.safe_dump(bad))
    result = subprocess.run(
        [str(BIN / "check-jsonschema"), "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0
    assert "healthchek" in result.stdout + result.stderr


def test_compose_config_rejects_a_dependency_on_an_undefined_service(
    compose_bin: str, tmp_path: Path
) -> None:
    bad = yaml.safe_load((ROOT / "deploy/compose/compose.yaml").read_text())
    bad["services"]["gateway"]["depends_on"]["routers"] = {"condition": "service_healthy"}
    path = tmp_path / "compose.yaml"
    path.write_text(yaml.safe_dump(bad))
    for name in ("kvplane.yaml", "otel-collector.yaml", "prometheus.yml", ".env"):
        shutil.copy(ROOT / "deploy/compose" / name, tmp_path / name)
    result = subprocess.run([compose_bin, "-f", str(path), "config", "-q"], capture_output=True, text=True)
    assert result.returncode != 0
    assert "routers" in result.stderr


def test_engine_advertising_all_interfaces_is_caught(
    checks: ModuleType, resolved_compose: dict[str, Any], tmp_path: Path
) -> None:
    bad = copy.deepcopy(resolved_compose)
    command = bad["services"]["sim-prefill"]["command"]
    bad["services"]["sim-prefill"]["command"] = [
        "--side-channel-host=0.0.0.0" if a.startswith("--side-channel-host=") else a for a in command
    ]
    path = tmp_path / "resolved.json"
    path.write_text(json.dumps(bad))
    report = _report(checks)
    checks.check_compose(path, report)
    assert report.failures == ["compose sim-prefill: binds and advertises its own name (sim-prefill)"]


def test_an_inline_code_health_check_is_caught(
    checks: ModuleType, resolved_compose: dict[str, Any], tmp_path: Path
) -> None:
    # Podman's Docker API splits this at spaces: the check never runs and the service never gets
    # healthy. `kvplane health` is in every image.
    bad = copy.deepcopy(resolved_compose)
    bad["services"]["gateway"]["healthcheck"]["test"] = [
        "CMD",
        "python",
        "-c",
        "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8080/health')",
    ]
    path = tmp_path / "resolved.json"
    path.write_text(json.dumps(bad))
    report = _report(checks)
    checks.check_compose(path, report)
    assert report.failures == [
        "compose gateway: health check is one argument list without spaces (no inline code)"
    ]


def test_every_compose_health_check_runs_kvplane_health_or_the_images_own_tool(
    resolved_compose: dict[str, Any],
) -> None:
    tools = {
        svc["healthcheck"]["test"][1] for svc in resolved_compose["services"].values() if "healthcheck" in svc
    }
    assert tools <= {"kvplane", "etcdctl", "wget"}, tools


def test_sim_engines_send_release_commands_to_the_eviction_service(resolved_compose: dict[str, Any]) -> None:
    for name in ("sim-prefill", "sim-decode"):
        assert "--eviction=eviction:50051" in resolved_compose["services"][name]["command"]


def test_compose_gateways_salt_ps_cache_with_one_key(resolved_compose: dict[str, Any]) -> None:
    # A key of each gateway's own would split every tenant's prefix cache in P between them: both
    # read the one key file, from the one volume the tokens service writes it to.
    keys = {
        name: (
            svc["environment"].get("KVPLANE_GATEWAY__CACHE_SALT_KEY_FILE"),
            {m["source"] for m in svc["volumes"] if m["target"] == "/run/kvplane/gateways"},
        )
        for name, svc in resolved_compose["services"].items()
        if svc.get("command") == ["gateway"]
    }
    assert len(keys) == 2 and all(file and volume == {"gateway-keys"} for file, volume in keys.values()), keys
    assert len({file for file, _ in keys.values()}) == 1, keys


def test_unknown_service_flag_in_compose_is_caught(
    checks: ModuleType, resolved_compose: dict[str, Any], tmp_path: Path
) -> None:
    bad = copy.deepcopy(resolved_compose)
    bad["services"]["routing"]["command"] = ["serve", "routing", "--listen-port", "50051"]
    path = tmp_path / "resolved.json"
    path.write_text(json.dumps(bad))
    report = _report(checks)
    checks.check_compose(path, report)
    assert (
        "compose routing: `kvplane serve routing --listen-port 50051` parses with its settings"
        in report.failures
    )


def test_strict_kubernetes_schema_rejects_a_misspelt_probe(
    checks: ModuleType, default_chart: list[dict[str, Any]]
) -> None:
    deployment = copy.deepcopy(next(d for d in default_chart if is_kvplane_workload(d)))
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["livenessprobe"] = container.pop("livenessProbe")
    assert "livenessprobe" in checks.kubernetes_validate(deployment, "1.37.0")
    assert checks.kubernetes_validate(default_chart[0], "1.37.0") == ""


def test_a_side_channel_opened_to_the_gateway_is_caught(
    checks: ModuleType, default_chart: list[dict[str, Any]]
) -> None:
    docs = copy.deepcopy(default_chart)
    policy = next(
        d for d in docs if d["kind"] == "NetworkPolicy" and d["metadata"]["name"].endswith("-engines")
    )
    # The gateway's rule loses its port list: the gateway could then reach the NIXL side channel.
    gateway_rule = next(r for r in policy["spec"]["ingress"] if "ports" in r)
    del gateway_rule["ports"]
    values = checks.merged_values({"engines": {"sim": {"enabled": True}}})
    report = _report(checks)
    checks.check_chart_semantics("[test]", docs, values, report)
    assert report.failures == ["[test]: only engines reach engines beyond the HTTP port (NIXL side channel)"]


def test_a_service_selecting_no_pods_is_caught(
    checks: ModuleType, default_chart: list[dict[str, Any]]
) -> None:
    docs = copy.deepcopy(default_chart)
    service = next(d for d in docs if d["kind"] == "Service" and d["metadata"]["name"].endswith("-routing"))
    service["spec"]["selector"]["app.kubernetes.io/component"] = "router"
    report = _report(checks)
    checks.check_chart_semantics(
        "[test]", docs, checks.merged_values({"engines": {"sim": {"enabled": True}}}), report
    )
    assert "[test] Service kvp-kvplane-routing: selects pods" in report.failures


def test_chart_runs_token_auth_by_default_with_its_own_secret(checks: ModuleType) -> None:
    import helm_python

    docs = checks.render_chart({"engines": {"sim": {"enabled": True}}}, "kvp", "kvplane")
    secret = next(d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"] == "kvp-kvplane-auth")
    entries = json.loads(secret["stringData"]["tokens.json"])
    assert {(e["kind"], e["name"]) for e in entries} == {
        ("operator", "gateway"),
        *{
            ("node", f"kvp-kvplane-{k}-*")
            for k in ("sim-prefill", "sim-decode", "vllm-prefill", "vllm-decode")
        },
    }
    assert len({e["token"] for e in entries}) == len(entries)
    # The gateway presents its token to routing, each engine its own: files from the Secret's
    # keys (read again when the Secret changes), each pod holding only its own.
    mounted = {
        d["metadata"]["name"]: [
            i["key"]
            for v in d["spec"]["template"]["spec"]["volumes"]
            if v["name"] == "auth"
            for i in v["secret"]["items"]
        ]
        for d in docs
        if is_kvplane_workload(d)
    }
    env = {
        (d["metadata"]["name"], e["name"]): e.get("value")
        for d in docs
        if is_kvplane_workload(d)
        for c in d["spec"]["template"]["spec"]["containers"]
        for e in c.get("env", [])
    }
    assert mounted["kvp-kvplane-gateway"] == ["gateway"]
    assert env[("kvp-kvplane-gateway", "KVPLANE_GATEWAY__ROUTING_TOKEN_FILE")] == "/etc/kvplane-auth/token"
    assert mounted["kvp-kvplane-sim-prefill"] == ["sim-prefill"]
    assert env[("kvp-kvplane-sim-prefill", "KVPLANE_SIM_AUTH_TOKEN_FILE")] == "/etc/kvplane-auth/token"
    assert mounted["kvp-kvplane-routing"] == ["tokens.json"]
    assert env[("kvp-kvplane-routing", "KVPLANE_AUTH__TOKENS_FILE")] == "/etc/kvplane-auth/tokens.json"
    # The open header mode is gone, and the experimental mesh mode is not offered.
    for mode in ("header", "mesh"):
        with pytest.raises(helm_python.HelmError):
            checks.render_chart({"auth": {"mode": mode}}, "kvp", "kvplane")


def test_istio_schema_rejects_an_unknown_action(tmp_path: Path) -> None:
    if not (VALIDATE / "node_modules" / "@kubernetes-models" / "istio").exists():
        pytest.skip("CRD schemas not installed: run deploy/scripts/validate_deploy.sh once (npm ci)")
    policy = {
        "apiVersion": "security.istio.io/v1",
        "kind": "AuthorizationPolicy",
        "metadata": {"name": "routing", "namespace": "kvplane"},
        "spec": {"action": "PERMIT"},
    }
    path = tmp_path / "crds.json"
    path.write_text(json.dumps([policy]))
    result = subprocess.run(
        ["node", str(VALIDATE / "crd_schemas.mjs"), str(path)], capture_output=True, text=True
    )
    assert result.returncode == 1
    assert "action" in result.stdout


def test_a_misspelt_istio_field_is_caught(checks: ModuleType) -> None:
    spec = {
        "action": "ALLOW",
        "rules": [{"from": [{"source": {"principal": ["cluster.local/ns/kvplane/sa/x"]}}]}],
    }
    assert checks.unknown_fields(spec, checks.ISTIO_FIELDS["AuthorizationPolicy"]) == [
        "spec.rules[0].from[0].source.principal"
    ]


def test_mesh_paths_name_the_services_in_the_protos(checks: ModuleType) -> None:
    assert checks.grpc_service_paths() >= {
        "/kvplane.v1.RoutingService/*",
        "/kvplane.v1.MetadataService/*",
        "/kvplane.v1.EvictionService/*",
    }


def test_a_misspelt_setting_in_chart_values_is_caught(checks: ModuleType) -> None:
    # kvplane's settings sections ignore unknown keys; the check must not.
    values = {"settings": {"routing": {"decode_kv_ttl": 480}}}
    docs = checks.render_chart(values, "kvp", "kvplane")
    report = _report(checks)
    checks.check_chart_semantics("[test]", docs, checks.merged_values(values), report)
    expected = "`kvplane serve routing` and its settings (ConfigMap + env) load"
    assert f"[test] StatefulSet kvp-kvplane-routing: {expected}" in report.failures


VLLM_VALUES: dict[str, Any] = {"engines": {"vllm": {"enabled": True}}}


def _worker(docs: list[dict[str, Any]], role: str) -> dict[str, Any]:
    deployment = next(d for d in docs if is_kvplane_workload(d) and d["metadata"]["name"].endswith(role))
    container: dict[str, Any] = deployment["spec"]["template"]["spec"]["containers"][0]
    return container


def test_vllm_workers_load_kvplanes_connector_pointed_at_the_releases_services(
    checks: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    docs = checks.render_chart(VLLM_VALUES, "kvp", "kvplane")
    for role in ("prefill", "decode"):
        args = _worker(docs, f"-vllm-{role}")["args"]
        config = json.loads(next(a for a in args if a.startswith("--kv-transfer-config=")).split("=", 1)[1])
        assert config["kv_connector_module_path"] == "kvplane.connector.vllm_nixl"
        assert config["kv_connector_extra_config"]["bidirectional_kv_xfer"] is True
        section = config["kv_connector_extra_config"]["kvplane"]
        assert section["role"] == role
        assert section["metadata_target"] == "kvp-kvplane-metadata:50051"
        assert section["eviction_target"] == "kvp-kvplane-eviction:50051"
    report = _report(checks)
    checks.check_chart_semantics("[test]", docs, checks.merged_values(VLLM_VALUES), report)
    assert [f for f in report.failures if "-vllm-" in f] == []
    out = capsys.readouterr().out
    for role in ("prefill", "decode"):
        assert (
            f"ok   [test] Deployment kvp-kvplane-vllm-{role}: advertised HTTP URL is its serving port" in out
        )


def test_vllm_worker_values_reach_the_engine_flags(checks: ModuleType) -> None:
    values = {
        "engines": {
            "vllm": {
                "enabled": True,
                "model": "org/model",
                "maxModelLen": 8192,
                "decode": {"tensorParallelSize": 4},
                "kv": {"bufferDevice": "cpu", "cpuKvCacheSpaceGb": 8, "decoderKvBlocksTtlS": 120},
            }
        }
    }
    docs = checks.render_chart(values, "kvp", "kvplane")
    decode = _worker(docs, "-vllm-decode")
    assert {"--model=org/model", "--max-model-len=8192", "--tensor-parallel-size=4"} <= set(decode["args"])
    assert not any(a.startswith("--gpu-memory-utilization") for a in decode["args"])
    assert {"name": "VLLM_CPU_KVCACHE_SPACE", "value": "8"} in decode["env"]
    config = json.loads(
        next(a for a in decode["args"] if a.startswith("--kv-transfer-config=")).split("=", 1)[1]
    )
    assert config["kv_buffer_device"] == "cpu"
    assert config["kv_connector_extra_config"]["decoder_kv_blocks_ttl"] == 120


def test_a_vllm_worker_pointed_at_the_wrong_service_is_caught(checks: ModuleType) -> None:
    docs = checks.render_chart(VLLM_VALUES, "kvp", "kvplane")
    container = _worker(docs, "-vllm-decode")
    index = next(i for i, a in enumerate(container["args"]) if a.startswith("--kv-transfer-config="))
    container["args"][index] = container["args"][index].replace("kvp-kvplane-eviction", "kvp-kvplane-routing")
    report = _report(checks)
    checks.check_chart_semantics("[test]", docs, checks.merged_values(VLLM_VALUES), report)
    assert (
        "[test] Deployment kvp-kvplane-vllm-decode: eviction_target kvp-kvplane-routing:50051 "
        "is the eviction Service" in report.failures
    )


def test_chart_refuses_an_unknown_kv_buffer_device(checks: ModuleType) -> None:
    import helm_python

    with pytest.raises(helm_python.HelmError, match="bufferDevice"):
        checks.render_chart(
            {"engines": {"vllm": {"enabled": True, "kv": {"bufferDevice": "tpu"}}}}, "kvp", "kvplane"
        )


def test_mesh_policies_take_the_releases_names_namespace_and_service_accounts(checks: ModuleType) -> None:
    docs = checks.render_chart({"mesh": {"enabled": True}}, "prod", "llm")
    policies = [d for d in docs if d["apiVersion"] == "security.istio.io/v1"]
    assert {d["metadata"]["name"] for d in policies} >= {
        "prod-kvplane-strict-mtls",
        "prod-kvplane-deny-by-default",
        "prod-kvplane-routing",
        "prod-kvplane-metadata",
        "prod-kvplane-eviction",
        "prod-kvplane-etcd",
        "prod-kvplane-gateway",
        "prod-kvplane-engines",
    }
    assert all(d["metadata"]["namespace"] == "llm" for d in policies)
    accounts = {d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount"}
    principals = {
        p
        for d in policies
        for rule in d["spec"].get("rules", [])
        for src in rule.get("from", [])
        for p in src["source"].get("principals", [])
    }
    in_release = {p for p in principals if p.startswith("cluster.local/ns/llm/sa/")}
    assert in_release - {"cluster.local/ns/llm/sa/prod-kvplane-operator"} == {
        f"cluster.local/ns/llm/sa/{a}" for a in accounts
    }
    routing = next(d for d in policies if d["metadata"]["name"] == "prod-kvplane-routing")
    assert routing["spec"]["selector"]["matchLabels"]["app.kubernetes.io/instance"] == "prod"


def test_mesh_policies_are_left_out_when_turned_off(checks: ModuleType) -> None:
    docs = checks.render_chart({"mesh": {"enabled": True, "policies": {"enabled": False}}}, "kvp", "kvplane")
    assert [d for d in docs if d["apiVersion"].startswith("security.istio.io")] == []
    pods = [t for _, t in checks.pod_templates(docs)]
    assert all(t["metadata"]["labels"]["sidecar.istio.io/inject"] == "true" for t in pods)
