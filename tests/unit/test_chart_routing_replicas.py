"""The Helm chart's routing replicas: a StatefulSet behind a headless Service, listed by name in every
gateway and engine, so that conversations have a home replica, Routes hedge, and every engine streams
its load and prefix cache (from P's KV events) to each replica."""

from __future__ import annotations

import copy
import importlib.util
import json
from types import ModuleType
from typing import Any

import pytest

from tests.support.deploy_validators import load_deploy_checks

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("helm_python") is None,
    reason="deploy validators not installed: pip install -e '.[dev]'",
)

VALUES: dict[str, Any] = {
    "engines": {"sim": {"enabled": True}, "vllm": {"enabled": True}},
    "services": {"routing": {"replicas": 2}},
}
REPLICAS = [
    "kvp-kvplane-routing-0.kvp-kvplane-routing-pods.kvplane.svc:50051",
    "kvp-kvplane-routing-1.kvp-kvplane-routing-pods.kvplane.svc:50051",
]
CHECK = "routing targets are every routing replica"


@pytest.fixture(scope="module")
def checks() -> ModuleType:
    return load_deploy_checks()


@pytest.fixture(scope="module")
def chart(checks: ModuleType) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = checks.render_chart(VALUES, "kvp", "kvplane")
    return docs


def _named(docs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def _container(docs: list[dict[str, Any]], name: str) -> dict[str, Any]:
    container: dict[str, Any] = _named(docs, "Deployment", name)["spec"]["template"]["spec"]["containers"][0]
    return container


def _failures(checks: ModuleType, docs: list[dict[str, Any]]) -> list[str]:
    report = checks.Report()
    checks.check_chart_semantics("[test]", docs, checks.merged_values(VALUES), report)
    failures: list[str] = report.failures
    return failures


def test_routing_is_a_stateful_set_whose_replicas_every_client_lists(chart: list[dict[str, Any]]) -> None:
    sts = _named(chart, "StatefulSet", "kvp-kvplane-routing")
    assert sts["spec"]["replicas"] == 2 and sts["spec"]["serviceName"] == "kvp-kvplane-routing-pods"
    headless = _named(chart, "Service", "kvp-kvplane-routing-pods")
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    # The ClusterIP Service stays, for monitors and one-off callers.
    assert _named(chart, "Service", "kvp-kvplane-routing")["spec"]["type"] == "ClusterIP"

    gateway = {e["name"]: e.get("value") for e in _container(chart, "kvp-kvplane-gateway")["env"]}
    assert json.loads(gateway["KVPLANE_GATEWAY__ROUTING"]) == REPLICAS
    for role in ("prefill", "decode"):
        sim = _container(chart, f"kvp-kvplane-sim-{role}")["args"]
        assert f"--routing={','.join(REPLICAS)}" in sim
        vllm = _container(chart, f"kvp-kvplane-vllm-{role}")["args"]
        (kv,) = [a.split("=", 1)[1] for a in vllm if a.startswith("--kv-transfer-config=")]
        assert json.loads(kv)["kv_connector_extra_config"]["kvplane"]["routing_targets"] == ",".join(REPLICAS)
        # P publishes its KV-cache events on ipc sockets in the pod: they open no port.
        for args in (sim, vllm):
            events = [json.loads(a.split("=", 1)[1]) for a in args if a.startswith("--kv-events-config=")]
            if role == "decode":
                assert events == []
            else:
                assert events[0]["enable_kv_cache_events"] is True
                assert events[0]["endpoint"].startswith("ipc://")
                assert events[0]["replay_endpoint"].startswith("ipc://")


def test_the_rendered_chart_passes_the_routing_target_checks(
    checks: ModuleType, chart: list[dict[str, Any]]
) -> None:
    failures = _failures(checks, chart)
    assert not [f for f in failures if CHECK in f or "headless Service" in f], failures


def test_a_client_given_the_service_or_a_missing_replica_is_caught(
    checks: ModuleType, chart: list[dict[str, Any]]
) -> None:
    docs = copy.deepcopy(chart)
    for e in _container(docs, "kvp-kvplane-gateway")["env"]:
        if e["name"] == "KVPLANE_GATEWAY__ROUTING":
            e["value"] = json.dumps(["kvp-kvplane-routing:50051"])
    args = _container(docs, "kvp-kvplane-sim-prefill")["args"]
    args[:] = [f"--routing={REPLICAS[0]}" if a.startswith("--routing=") else a for a in args]
    failures = [f for f in _failures(checks, docs) if CHECK in f]
    assert failures == [
        f"[test] Deployment kvp-kvplane-gateway: {CHECK}",
        f"[test] Deployment kvp-kvplane-sim-prefill: {CHECK}",
    ]


def test_the_chart_refuses_an_autoscaler_for_routing(checks: ModuleType) -> None:
    import helm_python

    with pytest.raises(helm_python.HelmError, match="routing"):
        checks.render_chart({"autoscaling": {"routing": {"enabled": True}}}, "kvp", "kvplane")
