"""The Helm chart's InferencePool path (inferencePool.enabled): kvplane's endpoint picker behind a
Gateway API inference gateway, and a sidecar in every decode pod.

The wiring an inference gateway depends on is checked on the rendered chart: the pool selects the
decode pods that run a sidecar, on the sidecar's port; its endpointPickerRef reaches the picker;
each sidecar calls the engine beside it; the picker and the sidecars share one route key, and the
picker the gateway's cache-salt key, API keys and routing replicas. Each check of
`deploy_checks/pool_checks.py` is then shown to catch the fault it is there for.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import shutil
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.support.deploy_validators import load_deploy_checks

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("helm_python") is None,
    reason="helm_python not installed: pip install -e '.[dev]'",
)
ROOT = Path(__file__).resolve().parents[2]
VALIDATE = ROOT / "deploy" / "scripts" / "validate"
GATEWAY_NS = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "inference-gateway"}}}
VALUES: dict[str, Any] = {
    "engines": {"sim": {"enabled": True}, "vllm": {"enabled": True}},
    "gateway": {"apiKeysSecret": {"name": "keys"}},
    "inferencePool": {
        "enabled": True,
        "failureMode": "FailClose",
        "ingressFrom": [GATEWAY_NS],
        "httpRoute": {"gateway": {"name": "inference-gateway", "namespace": "inference-gateway"}},
    },
}
POOL = "kvp-kvplane-pool"
DECODE = ("kvp-kvplane-sim-decode", "kvp-kvplane-vllm-decode")


@pytest.fixture(scope="module")
def checks() -> ModuleType:
    return load_deploy_checks()


@pytest.fixture(scope="module")
def chart(checks: ModuleType) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = checks.render_chart(VALUES, "kvp", "kvplane")
    return docs


def _one(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def _container(docs: list[dict[str, Any]], deployment: str, name: str) -> dict[str, Any]:
    (found,) = [
        c
        for c in _one(docs, "Deployment", deployment)["spec"]["template"]["spec"]["containers"]
        if c["name"] == name
    ]
    return found


def _env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def _ports(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def _pool_failures(
    checks: ModuleType, docs: list[dict[str, Any]], values: dict[str, Any] = VALUES
) -> list[str]:
    report = checks.Report()
    checks.check_inference_pool("[test]", docs, checks.merged_values(values), report)
    failures: list[str] = report.failures
    return failures


def test_the_path_is_off_by_default_and_the_switch_renders_nothing_when_off(checks: ModuleType) -> None:
    for values in ({}, {"engines": {"sim": {"enabled": True}}, "inferencePool": {"enabled": False}}):
        docs = checks.render_chart(values, "kvp", "kvplane")
        assert not [d for d in docs if d["kind"] in ("InferencePool", "HTTPRoute")]
        names = {d["metadata"]["name"] for d in docs}
        assert not {"kvp-kvplane-epp", "kvp-kvplane-route-key", "kvp-kvplane-decode-sidecars"} & names
        containers = {c["name"] for _, t in checks.pod_templates(docs) for c in t["spec"]["containers"]}
        assert not {"epp", "sidecar"} & containers
        assert _pool_failures(checks, docs, values) == []
    # Without the path the sim decode engine keeps engines.httpPort and binds its pod IP.
    engine = _container(docs, "kvp-kvplane-sim-decode", "engine")
    assert _ports(engine)["http"] == 8000 and "--host=$(POD_IP)" in engine["args"]


def test_the_rendered_path_passes_every_check(checks: ModuleType, chart: list[dict[str, Any]]) -> None:
    assert _pool_failures(checks, chart) == []
    report = checks.Report()
    checks.check_chart_semantics("[test]", chart, checks.merged_values(VALUES), report)
    assert report.failures == []


def test_the_pool_selects_the_decode_pods_on_their_sidecars_port(
    checks: ModuleType, chart: list[dict[str, Any]]
) -> None:
    pool = _one(chart, "InferencePool", POOL)
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    selector = pool["spec"]["selector"]["matchLabels"]
    selected = {
        w["metadata"]["name"]
        for w, t in checks.pod_templates(chart)
        if all(t["metadata"]["labels"].get(k) == v for k, v in selector.items())
    }
    assert selected == set(DECODE)
    (target,) = pool["spec"]["targetPorts"]
    for deployment in DECODE:
        sidecar = _container(chart, deployment, "sidecar")
        assert _ports(sidecar) == {"sidecar": target["number"]} == {"sidecar": 8000}
        assert _env(sidecar)["KVPLANE_SIDECAR__LISTEN"] == "0.0.0.0:8000"
        assert sidecar["args"] == ["sidecar"]


def test_the_endpoint_picker_ref_names_the_pickers_service_and_port(chart: list[dict[str, Any]]) -> None:
    ref = _one(chart, "InferencePool", POOL)["spec"]["endpointPickerRef"]
    assert ref == {
        "group": "",
        "kind": "Service",
        "name": "kvp-kvplane-epp",
        "port": {"number": 9002},
        "failureMode": "FailClose",
    }
    service = _one(chart, "Service", ref["name"])
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    picker = _container(chart, "kvp-kvplane-epp", "epp")
    assert _ports(picker)[port["targetPort"]] == 9002
    assert _env(picker)["KVPLANE_EPP__LISTEN"] == "0.0.0.0:9002"
    # D's sidecar is answered on the pool's target port.
    assert _env(picker)["KVPLANE_EPP__SIDECAR_PORT"] == "8000"
    # With the release named kvplane, the picker is kvplane-epp (the issue's name).
    docs = load_deploy_checks().render_chart(VALUES, "kvplane", "kvplane")
    assert _one(docs, "InferencePool", "kvplane-pool")["spec"]["endpointPickerRef"]["name"] == "kvplane-epp"
    assert _one(docs, "Service", "kvplane-epp")


def test_each_sidecar_calls_the_engine_beside_it_on_loopback(chart: list[dict[str, Any]]) -> None:
    sim = _container(chart, "kvp-kvplane-sim-decode", "engine")
    vllm = _container(chart, "kvp-kvplane-vllm-decode", "vllm")
    for deployment, engine in (("kvp-kvplane-sim-decode", sim), ("kvp-kvplane-vllm-decode", vllm)):
        assert "--port=8200" in engine["args"] and _ports(engine)["http"] == 8200
        assert (
            _env(_container(chart, deployment, "sidecar"))["KVPLANE_SIDECAR__DECODE_URL"]
            == "http://127.0.0.1:8200"
        )
    # The engine binds every interface for its sidecar, and advertises its pod IP, which the picker
    # turns into the sidecar's address.
    assert {"--host=0.0.0.0", "--advertise-host=$(POD_IP)"} <= set(sim["args"])
    assert _env(vllm)["KVPLANE_HTTP_URL"] == "http://$(POD_IP):8200"
    # Prefill engines keep engines.httpPort and run no sidecar.
    prefill = _one(chart, "Deployment", "kvp-kvplane-sim-prefill")["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in prefill] == ["engine"] and "--port=8000" in prefill[0]["args"]


def test_the_picker_and_every_sidecar_read_one_route_key_secret(
    checks: ModuleType, chart: list[dict[str, Any]]
) -> None:
    refs = [_env(_container(chart, "kvp-kvplane-epp", "epp"))["KVPLANE_SIDECAR__ROUTE_KEY"]] + [
        _env(_container(chart, d, "sidecar"))["KVPLANE_SIDECAR__ROUTE_KEY"] for d in DECODE
    ]
    assert all(r == {"secretKeyRef": {"name": "kvp-kvplane-route-key", "key": "route-key"}} for r in refs)
    assert len(_one(chart, "Secret", "kvp-kvplane-route-key")["stringData"]["route-key"]) >= 32
    # A Secret named in the values is used, and the chart makes none.
    values = copy.deepcopy(VALUES)
    values["inferencePool"]["routeKeySecret"] = {"name": "mine", "key": "k"}
    docs = checks.render_chart(values, "kvp", "kvplane")
    assert _env(_container(docs, "kvp-kvplane-sim-decode", "sidecar"))["KVPLANE_SIDECAR__ROUTE_KEY"] == {
        "secretKeyRef": {"name": "mine", "key": "k"}
    }
    assert not [d for d in docs if d["kind"] == "Secret" and d["metadata"]["name"].endswith("-route-key")]


def test_the_picker_routes_salts_and_admits_as_the_gateway_does(
    checks: ModuleType, chart: list[dict[str, Any]]
) -> None:
    picker = _container(chart, "kvp-kvplane-epp", "epp")
    gateway = _container(chart, "kvp-kvplane-gateway", "gateway")
    for name in (
        "KVPLANE_GATEWAY__CACHE_SALT_KEY",
        "KVPLANE_GATEWAY__ROUTING",
        "KVPLANE_GATEWAY__ROUTING_TOKEN_FILE",
        "KVPLANE_GATEWAY__API_KEYS_FILE",
    ):
        assert _env(picker)[name] == _env(gateway)[name], name
    assert _env(picker)["KVPLANE_GATEWAY__CACHE_SALT_KEY"]["secretKeyRef"]["name"] == "kvp-kvplane-cache-salt"
    assert len(json.loads(_env(picker)["KVPLANE_GATEWAY__ROUTING"])) == 3
    volumes = {
        v["name"]: v
        for v in _one(chart, "Deployment", "kvp-kvplane-epp")["spec"]["template"]["spec"]["volumes"]
    }
    assert volumes["auth"]["secret"]["items"] == [{"key": "gateway", "path": "token"}]
    assert volumes["api-keys"]["secret"]["secretName"] == "keys"
    # The salt Secret is made for the picker even with kvplane's own gateway off.
    values = copy.deepcopy(VALUES)
    values["gateway"]["enabled"] = False
    docs = checks.render_chart(values, "kvp", "kvplane")
    assert _one(docs, "Secret", "kvp-kvplane-cache-salt")
    assert _pool_failures(checks, docs, values) == []


def test_the_http_route_sends_the_gateways_paths_to_the_pool_only_when_a_gateway_is_named(
    checks: ModuleType, chart: list[dict[str, Any]]
) -> None:
    route = _one(chart, "HTTPRoute", POOL)
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["spec"]["parentRefs"] == [
        {
            "group": "gateway.networking.k8s.io",
            "kind": "Gateway",
            "name": "inference-gateway",
            "namespace": "inference-gateway",
        }
    ]
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": POOL}
    ]
    assert [m["path"]["value"] for m in rule["matches"]] == ["/v1/completions", "/v1/chat/completions"]
    values = copy.deepcopy(VALUES)
    values["inferencePool"]["httpRoute"]["gateway"]["name"] = ""
    assert not [d for d in checks.render_chart(values, "kvp", "kvplane") if d["kind"] == "HTTPRoute"]


def test_only_the_inference_gateway_reaches_the_picker_and_the_sidecars(chart: list[dict[str, Any]]) -> None:
    for name, port in (("kvp-kvplane-epp", 9002), ("kvp-kvplane-decode-sidecars", 8000)):
        policy = _one(chart, "NetworkPolicy", name)
        assert policy["spec"]["ingress"][0] == {
            "from": [GATEWAY_NS],
            "ports": [{"port": port, "protocol": "TCP"}],
        }
    # The gateway and the picker reach the decode engines' own port too.
    engines = _one(chart, "NetworkPolicy", "kvp-kvplane-engines")
    assert {p["port"] for p in engines["spec"]["ingress"][1]["ports"]} == {8000, 8200}


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"inferencePool": {"sidecar": {"port": 8200, "enginePort": 8200}}}, "must differ"),
        ({"inferencePool": {"ingressFrom": []}}, "ingressFrom"),
        ({"engines": {"sim": {"enabled": False}, "vllm": {"enabled": False}}}, "decode pods"),
    ],
)
def test_the_chart_refuses_a_path_that_cannot_work(
    checks: ModuleType, values: dict[str, Any], message: str
) -> None:
    import helm_python

    merged = copy.deepcopy(VALUES)
    for key, value in values.items():
        merged[key] = {**merged[key], **value}
    with pytest.raises(helm_python.HelmError, match=message):
        checks.render_chart(merged, "kvp", "kvplane")


# Planted faults: each check of pool_checks.py catches its own.


def test_a_pool_that_selects_no_decode_pod_is_caught(checks: ModuleType, chart: list[dict[str, Any]]) -> None:
    docs = copy.deepcopy(chart)
    _one(docs, "InferencePool", POOL)["spec"]["selector"]["matchLabels"]["kvplane.io/inference-pool"] = (
        "other"
    )
    assert _pool_failures(checks, docs) == [
        f"[test] InferencePool {POOL}: selects exactly the pods that run a decode sidecar"
    ]


def test_a_pool_that_also_selects_prefill_pods_is_caught(
    checks: ModuleType, chart: list[dict[str, Any]]
) -> None:
    docs = copy.deepcopy(chart)
    _one(docs, "InferencePool", POOL)["spec"]["selector"]["matchLabels"] = {"kvplane.io/engine": "true"}
    failures = _pool_failures(checks, docs)
    assert f"[test] InferencePool {POOL}: selects exactly the pods that run a decode sidecar" in failures


def test_a_target_port_that_is_not_the_sidecars_is_caught(
    checks: ModuleType, chart: list[dict[str, Any]]
) -> None:
    docs = copy.deepcopy(chart)
    _one(docs, "InferencePool", POOL)["spec"]["targetPorts"] = [{"number": 8200}]
    member = f"[test] InferencePool {POOL} member"
    assert _pool_failures(checks, docs) == [
        *[
            failure
            for d in DECODE
            for failure in (
                f"{member} {d}: the pool's target port 8200 is the sidecar's, and it listens there",
                f"{member} {d}: the sidecar's decode_url is the engine beside it (http://127.0.0.1:8200)",
            )
        ],
        f"[test] InferencePool {POOL}: the picker answers D's sidecar on the pool's target port (8200)",
    ]


def test_an_endpoint_picker_ref_that_names_no_service_or_port_is_caught(
    checks: ModuleType, chart: list[dict[str, Any]]
) -> None:
    docs = copy.deepcopy(chart)
    _one(docs, "InferencePool", POOL)["spec"]["endpointPickerRef"]["name"] = "kvp-kvplane-picker"
    assert _pool_failures(checks, docs) == [
        f"[test] InferencePool {POOL}: endpointPickerRef names a Service of the chart (kvp-kvplane-picker)"
    ]
    docs = copy.deepcopy(chart)
    _one(docs, "InferencePool", POOL)["spec"]["endpointPickerRef"]["port"]["number"] = 9464
    assert _pool_failures(checks, docs) == [
        f"[test] InferencePool {POOL}: endpointPickerRef port 9464 reaches the picker's ext_proc port, "
        "where it listens"
    ]


def test_a_route_key_not_shared_by_the_picker_and_a_sidecar_is_caught(
    checks: ModuleType, chart: list[dict[str, Any]]
) -> None:
    docs = copy.deepcopy(chart)
    sidecar = _container(docs, "kvp-kvplane-vllm-decode", "sidecar")
    for e in sidecar["env"]:
        if e["name"] == "KVPLANE_SIDECAR__ROUTE_KEY":
            e["valueFrom"]["secretKeyRef"]["name"] = "another-key"
    assert _pool_failures(checks, docs) == ["[test]: the picker and every sidecar read one route key Secret"]


def test_a_sidecar_pointed_at_the_wrong_engine_port_is_caught(
    checks: ModuleType, chart: list[dict[str, Any]]
) -> None:
    docs = copy.deepcopy(chart)
    for e in _container(docs, "kvp-kvplane-sim-decode", "sidecar")["env"]:
        if e["name"] == "KVPLANE_SIDECAR__DECODE_URL":
            e["value"] = "http://127.0.0.1:8000"
    assert _pool_failures(checks, docs) == [
        f"[test] InferencePool {POOL} member kvp-kvplane-sim-decode: the sidecar's decode_url is the engine "
        "beside it (http://127.0.0.1:8000)"
    ]


def test_a_picker_with_a_salt_key_of_its_own_is_caught(
    checks: ModuleType, chart: list[dict[str, Any]]
) -> None:
    docs = copy.deepcopy(chart)
    for e in _container(docs, "kvp-kvplane-epp", "epp")["env"]:
        if e["name"] == "KVPLANE_GATEWAY__CACHE_SALT_KEY":
            e["valueFrom"]["secretKeyRef"]["name"] = "epp-salt"
    assert _pool_failures(checks, docs) == ["[test] picker epp: salts with the gateway's cache-salt key"]


def test_an_http_route_to_another_backend_is_caught(checks: ModuleType, chart: list[dict[str, Any]]) -> None:
    docs = copy.deepcopy(chart)
    _one(docs, "HTTPRoute", POOL)["spec"]["rules"][0]["backendRefs"] = [
        {"kind": "Service", "name": "kvp-kvplane-gateway"}
    ]
    assert _pool_failures(checks, docs) == [
        f"[test] HTTPRoute {POOL}: every backend is the InferencePool {POOL}"
    ]


def test_a_sidecar_policy_opening_the_side_channel_is_caught(
    checks: ModuleType, chart: list[dict[str, Any]]
) -> None:
    docs = copy.deepcopy(chart)
    _one(docs, "NetworkPolicy", "kvp-kvplane-decode-sidecars")["spec"]["ingress"][0]["ports"].append(
        {"port": 5600, "protocol": "TCP"}
    )
    report = checks.Report()
    checks.check_chart_semantics("[test]", docs, checks.merged_values(VALUES), report)
    assert report.failures == ["[test]: only engines reach engines beyond the HTTP port (NIXL side channel)"]


def test_a_service_with_two_ports_of_one_number_is_caught(
    checks: ModuleType, chart: list[dict[str, Any]]
) -> None:
    # The decode engines' headless Service names the engine's port and the sidecar's: one number for
    # both is refused by the API server.
    docs = copy.deepcopy(chart)
    _one(docs, "Service", "kvp-kvplane-sim-decode")["spec"]["ports"][0]["port"] = 8000
    report = checks.Report()
    checks.check_chart_semantics("[test]", docs, checks.merged_values(VALUES), report)
    assert report.failures == ["[test] Service kvp-kvplane-sim-decode: ports and port names are distinct"]


def test_the_inference_pool_schema_refuses_what_the_crd_refuses(
    chart: list[dict[str, Any]], tmp_path: Path
) -> None:
    if shutil.which("node") is None or not (VALIDATE / "node_modules" / "ajv").exists():
        pytest.skip("CRD schemas not installed: run deploy/scripts/validate_deploy.sh once (npm ci)")
    pool = _one(chart, "InferencePool", POOL)
    route = _one(chart, "HTTPRoute", POOL)
    bad_pools = {
        "two target ports": {"targetPorts": [{"number": 8000}, {"number": 8001}]},
        "a Service ref without a port": {"endpointPickerRef": {"name": "kvp-kvplane-epp"}},
        "an unknown failure mode": {
            "endpointPickerRef": {**pool["spec"]["endpointPickerRef"], "failureMode": "Open"}
        },
        "a misspelt field": {"targetPort": [{"number": 8000}]},
        "an empty selector": {"selector": {"matchLabels": {}}},
    }
    resources = [pool, route] + [
        {**pool, "metadata": {"name": f"bad-{i}"}, "spec": {**pool["spec"], **change}}
        for i, change in enumerate(bad_pools.values())
    ]
    path = tmp_path / "crds.json"
    path.write_text(json.dumps(resources))
    result = subprocess.run(
        ["node", str(VALIDATE / "crd_schemas.mjs"), str(path)], capture_output=True, text=True
    )
    assert result.returncode == 1
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"ok   InferencePool inference.networking.k8s.io/v1 {POOL}")
    assert lines[1].startswith(f"ok   HTTPRoute gateway.networking.k8s.io/v1 {POOL}")
    assert [line.split(":")[0] for line in lines[2:-1]] == [
        f"FAIL InferencePool inference.networking.k8s.io/v1 bad-{i}" for i in range(len(bad_pools))
    ]
    assert lines[-1] == f"2 valid, {len(bad_pools)} invalid"


def test_the_http_route_retries_on_another_decode_pod_only_when_asked(
    checks: ModuleType, chart: list[dict[str, Any]], tmp_path: Path
) -> None:
    (rule,) = _one(chart, "HTTPRoute", POOL)["spec"]["rules"]
    assert "retry" not in rule  # the standard channel's CRDs would refuse the field
    values = copy.deepcopy(VALUES)
    values["inferencePool"]["httpRoute"]["retry"] = {"codes": [503], "attempts": 1}
    route = _one(checks.render_chart(values, "kvp", "kvplane"), "HTTPRoute", POOL)
    (rule,) = route["spec"]["rules"]
    assert rule["retry"] == {"codes": [503], "attempts": 1}
    if shutil.which("node") is None or not (VALIDATE / "node_modules" / "ajv").exists():
        pytest.skip("CRD schemas not installed: run deploy/scripts/validate_deploy.sh once (npm ci)")
    path = tmp_path / "route.json"
    path.write_text(json.dumps([route]))
    result = subprocess.run(
        ["node", str(VALIDATE / "crd_schemas.mjs"), str(path)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout
