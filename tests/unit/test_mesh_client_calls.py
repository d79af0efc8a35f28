"""The chart's mesh policies allow every call kvplane's clients make, read from their code.

The calls come from the source (`deploy_checks/client_calls.py`): a health check or a `/tokenize`
that a hand-written list forgets is still there. Each is decided as Istio decides it
(`deploy_checks/istio_authz.py`) against the rendered policies.
"""

from __future__ import annotations

import copy
import importlib.util
from types import ModuleType
from typing import Any

import pytest

from tests.support.deploy_validators import load_deploy_checks

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("helm_python") is None,
    reason="helm_python not installed: pip install -e '.[dev]'",
)
NS = "kvplane"
EVERY_ENGINE = {"engines": {"sim": {"enabled": True}, "vllm": {"enabled": True}}, "mesh": {"enabled": True}}


@pytest.fixture(scope="module")
def checks() -> ModuleType:
    return load_deploy_checks()


@pytest.fixture(scope="module")
def chart(checks: ModuleType) -> list[dict[str, Any]]:
    return checks.render_chart(EVERY_ENGINE, "kvplane", NS)


def _authz() -> ModuleType:
    load_deploy_checks()
    import deploy_checks.istio_authz as authz

    return authz


def _request(path: str, principal: str = "cluster.local/ns/kvplane/sa/a", **kw: Any) -> Any:
    authz = _authz()
    return authz.Request(principal, NS, kw.pop("labels", {"app": "x"}), kw.pop("port", 50051), path, **kw)


def test_the_code_is_read_for_the_calls_policies_forget(
    checks: ModuleType, chart: list[dict[str, Any]]
) -> None:
    labels = {label for label, _ in checks.client_requests(chart)}
    assert "gateway -> routing /grpc.health.v1.Health/Check" in labels
    assert "gateway -> routing /kvplane.v1.RoutingService/Route" in labels
    assert "gateway -> sim-prefill HTTP /tokenize" in labels
    assert "engine -> metadata /kvplane.v1.MetadataService/RegisterNode" in labels
    assert "engine -> eviction /kvplane.v1.EvictionService/Commands" in labels
    # Paths the gateway serves are not calls it makes.
    assert not any(label.endswith("HTTP /metrics") for label in labels)


def test_every_client_call_is_allowed_by_the_rendered_policies(
    checks: ModuleType, chart: list[dict[str, Any]]
) -> None:
    report = checks.Report()
    checks.check_client_calls(chart, report)
    assert report.failures == [] and report.passed >= 10


def test_a_policy_that_denies_the_routing_health_check_fails_the_check(
    checks: ModuleType, chart: list[dict[str, Any]]
) -> None:
    planted = copy.deepcopy(chart)
    for doc in planted:
        if doc["kind"] == "AuthorizationPolicy" and doc["metadata"]["name"] == "kvplane-routing":
            for rule in doc["spec"]["rules"]:
                for to in rule.get("to", []):
                    paths = to["operation"].get("paths", [])
                    to["operation"]["paths"] = [p for p in paths if "Health" not in p]
    report = checks.Report()
    checks.check_client_calls(planted, report)
    assert report.failures == ["mesh allows gateway -> routing /grpc.health.v1.Health/Check"]


def test_a_node_call_without_its_role_header_is_denied(
    checks: ModuleType, chart: list[dict[str, Any]]
) -> None:
    authz = _authz()
    policies = [d for d in chart if d["kind"] == "AuthorizationPolicy"]
    (register,) = [r for label, r in checks.client_requests(chart) if label.endswith("/RegisterNode")]
    assert authz.allowed(policies, register)
    assert not authz.allowed(policies, authz.Request(**{**register.__dict__, "headers": {}}))


def test_a_namespace_default_deny_denies_what_no_rule_allows() -> None:
    authz = _authz()
    deny_all = {"kind": "AuthorizationPolicy", "spec": {}}
    allow = {
        "kind": "AuthorizationPolicy",
        "spec": {
            "selector": {"matchLabels": {"app": "x"}},
            "action": "ALLOW",
            "rules": [{"to": [{"operation": {"paths": ["/svc.A/*"], "ports": ["50051"]}}]}],
        },
    }
    assert not authz.allowed([deny_all], _request("/svc.A/Get"))
    assert authz.allowed([deny_all, allow], _request("/svc.A/Get"))
    assert not authz.allowed([deny_all, allow], _request("/svc.B/Get"))
    assert not authz.allowed([deny_all, allow], _request("/svc.A/Get", port=9464))
    assert not authz.allowed([deny_all, allow], _request("/svc.A/Get", labels={"app": "y"}))
    assert authz.allowed([], _request("/anything"))


def test_deny_wins_and_strings_match_by_prefix_suffix_or_whole() -> None:
    authz = _authz()
    allow_all = {"kind": "AuthorizationPolicy", "spec": {"rules": [{}]}}
    deny = {
        "kind": "AuthorizationPolicy",
        "spec": {
            "action": "DENY",
            "rules": [
                {
                    "from": [{"source": {"principals": ["*/sa/engine"]}}],
                    "when": [{"key": "request.headers[x-kvplane-tenant]", "values": ["*"]}],
                }
            ],
        },
    }
    engine = "cluster.local/ns/kvplane/sa/engine"
    assert authz.allowed([allow_all, deny], _request("/p", principal=engine))
    assert not authz.allowed(
        [allow_all, deny], _request("/p", principal=engine, headers={"x-kvplane-tenant": "t"})
    )
    assert authz.allowed([allow_all, deny], _request("/p", headers={"x-kvplane-tenant": "t"}))
    only_get = {
        "kind": "AuthorizationPolicy",
        "spec": {"rules": [{"to": [{"operation": {"methods": ["GET"], "notPaths": ["/admin*"]}}]}]},
    }
    assert authz.allowed([only_get], _request("/metrics", method="GET"))
    assert not authz.allowed([only_get], _request("/metrics", method="POST"))
    assert not authz.allowed([only_get], _request("/admin/x", method="GET"))


# The InferencePool path: the picker and the decode sidecars run parts of the gateway's code, and the
# inference gateway's Envoy calls them.
WITH_POOL = {
    **EVERY_ENGINE,
    "inferencePool": {
        "enabled": True,
        "ingressFrom": [
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "istio-system"}}}
        ],
    },
}


@pytest.fixture(scope="module")
def pool_chart(checks: ModuleType) -> list[dict[str, Any]]:
    return checks.render_chart(WITH_POOL, "kvplane", NS)


def test_the_pickers_and_sidecars_calls_are_read_from_the_code_they_reach(
    checks: ModuleType, pool_chart: list[dict[str, Any]]
) -> None:
    labels = {label for label, _ in checks.client_requests(pool_chart)}
    assert {
        "epp -> routing /kvplane.v1.RoutingService/Route",
        "epp -> routing /kvplane.v1.RoutingService/ReportTurn",
        "epp -> routing /grpc.health.v1.Health/Check",
        "epp -> vllm-prefill HTTP /tokenize",
        "sidecar -> sim-prefill HTTP /v1/completions",
        "sidecar -> vllm-prefill HTTP /v1/chat/completions",
        "inference gateway -> epp /envoy.service.ext_proc.v3.ExternalProcessor/Process",
        "inference gateway -> epp /grpc.health.v1.Health/Check",
        "inference gateway -> vllm-decode sidecar HTTP /v1/completions",
    } <= labels
    # The sidecar borrows gateway functions, not the gateway's routing client: it calls no service,
    # and its P leg goes to prefill engines only.
    assert not [label for label in labels if label.startswith("sidecar -> ") and "prefill HTTP" not in label]


def test_reachable_code_follows_names_not_whole_modules() -> None:
    load_deploy_checks()
    import deploy_checks.client_calls as calls

    root = calls.ROOT
    sidecar = calls.reachable_code(
        sorted((root / "services/sidecar").glob("*.py")),
        ("services/gateway", "services/client", "services/sidecar"),
    )
    names = {getattr(u, "name", None) for u in sidecar}
    # gateway/app.py gives the sidecar split_host_port; its routing client is not reached.
    assert "split_host_port" in names and "routing_client" not in names and "RoutingClient" not in names
    assert "leg_path" in names  # the legs' paths, from gateway/legs.py


def test_every_call_of_the_pool_path_is_allowed_and_let_in(
    checks: ModuleType, pool_chart: list[dict[str, Any]]
) -> None:
    report = checks.Report()
    checks.check_client_calls(pool_chart, report)
    assert report.failures == [] and report.passed >= 100


def test_a_routing_policy_without_the_picker_fails_the_check(
    checks: ModuleType, pool_chart: list[dict[str, Any]]
) -> None:
    planted = copy.deepcopy(pool_chart)
    for doc in planted:
        if doc["kind"] == "AuthorizationPolicy" and doc["metadata"]["name"] == "kvplane-routing":
            for rule in doc["spec"]["rules"]:
                for src in rule.get("from", []):
                    principals = src["source"].get("principals", [])
                    src["source"]["principals"] = [p for p in principals if not p.endswith("/kvplane-epp")]
    report = checks.Report()
    checks.check_client_calls(planted, report)
    assert report.failures == [
        f"mesh allows epp -> routing {path}"
        for path in (
            "/grpc.health.v1.Health/Check",
            "/kvplane.v1.RoutingService/EndConversation",
            "/kvplane.v1.RoutingService/ReportTurn",
            "/kvplane.v1.RoutingService/ReportTurns",
            "/kvplane.v1.RoutingService/Route",
        )
    ]


def test_a_sidecar_network_policy_that_keeps_the_gateway_out_fails_the_check(
    checks: ModuleType, pool_chart: list[dict[str, Any]]
) -> None:
    planted = copy.deepcopy(pool_chart)
    for doc in planted:
        if doc["kind"] == "NetworkPolicy" and doc["metadata"]["name"] == "kvplane-decode-sidecars":
            doc["spec"]["ingress"][0]["from"] = [
                {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "other"}}}
            ]
    report = checks.Report()
    checks.check_client_calls(planted, report)
    assert report.failures == [
        f"mesh: NetworkPolicies let in inference gateway -> {role} sidecar HTTP {path}"
        for role in ("sim-decode", "vllm-decode")
        for path in ("/v1/chat/completions", "/v1/completions")
    ]


def test_network_policies_admit_as_kubernetes_does() -> None:
    load_deploy_checks()
    from deploy_checks.network_policy import Connection, admitted

    def conn(port: int = 8000, ns: str = NS, labels: dict[str, str] | None = None) -> Any:
        return Connection(labels or {"app": "gw"}, ns, {"app": "engine"}, NS, port, {"http": 8000})

    policy = {
        "kind": "NetworkPolicy",
        "spec": {
            "podSelector": {"matchLabels": {"app": "engine"}},
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": {"app": "gw"}}}], "ports": [{"port": "http"}]}
            ],
        },
    }
    assert admitted([], conn())  # no policy selects the pod
    assert admitted([policy], conn())  # a named port
    assert not admitted([policy], conn(port=5600))
    assert not admitted([policy], conn(labels={"app": "other"}))
    assert not admitted([policy], conn(ns="elsewhere"))  # a podSelector alone: the policy's namespace
    from_ns = copy.deepcopy(policy)
    from_ns["spec"]["ingress"][0]["from"] = [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "elsewhere"}}}
    ]
    assert admitted([from_ns], conn(ns="elsewhere")) and not admitted([from_ns], conn())
    egress_only = {**policy, "spec": {**policy["spec"], "policyTypes": ["Egress"], "ingress": []}}
    assert admitted([egress_only], conn(port=5600))
