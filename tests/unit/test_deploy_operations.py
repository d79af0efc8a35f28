"""The chart's operations objects (Grafana dashboard, alert rules, autoscalers, the gateway's drain,
the engines' Services, budgets, monitors and OTEL settings) validate, and each of their checks
catches the fault it is there for."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.support.deploy_validators import load_deploy_checks

ROOT = Path(__file__).resolve().parents[2]
VALIDATE = ROOT / "deploy" / "scripts" / "validate"
helm_python = pytest.importorskip(
    "helm_python", reason="deploy validators not installed: pip install -e '.[dev]'"
)

VALUES: dict[str, Any] = {
    "engines": {"sim": {"enabled": True}, "vllm": {"enabled": True}},
    "telemetry": {"otlpEndpoint": "otel-collector.observability:4317"},
    "autoscaling": {"gateway": {"enabled": True}},
}


@pytest.fixture(scope="module")
def checks() -> ModuleType:
    return load_deploy_checks()


@pytest.fixture(scope="module")
def chart(checks: ModuleType) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = checks.render_chart(VALUES, "kvp", "kvplane")
    return docs


def _failures(
    checks: ModuleType, docs: list[dict[str, Any]], values: dict[str, Any] | None = None
) -> list[str]:
    report = checks.Report()
    checks.check_operations("[test]", docs, checks.merged_values(values or VALUES), report)
    failures: list[str] = report.failures
    return failures


def _one(docs: list[dict[str, Any]], kind: str, suffix: str = "") -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix)]
    assert len(found) == 1, [d["metadata"]["name"] for d in found]
    return found[0]


def test_the_rendered_operations_objects_pass(checks: ModuleType, chart: list[dict[str, Any]]) -> None:
    assert _failures(checks, chart) == []
    report = checks.Report()
    checks.check_chart_semantics("[test]", chart, checks.merged_values(VALUES), report)
    assert report.failures == []


def test_promql_metric_names_skip_functions_labels_ranges_and_grouping(checks: ModuleType) -> None:
    names = checks.metric_names(
        'histogram_quantile(0.99, sum by (le, op) (rate(kvplane_etcd_request_seconds_bucket{op="txn",'
        'job=~"a}b"}[$__rate_interval])))'
        " / on (job) group_left (node) max without (pod) (vllm:kv_cache_usage_perc offset 5m) > bool 0.5"
    )
    assert names == {"kvplane_etcd_request_seconds_bucket", "vllm:kv_cache_usage_perc"}
    with pytest.raises(checks.PromQLError):
        checks.metric_names("sum(rate(kvplane_gateway_turns_total[5m])")


def test_a_dashboard_without_the_sidecars_label_is_caught(
    checks: ModuleType, chart: list[dict[str, Any]]
) -> None:
    docs = copy.deepcopy(chart)
    del _one(docs, "ConfigMap", "-grafana-dashboard")["metadata"]["labels"]["grafana_dashboard"]
    assert _failures(checks, docs) == [
        "[test] ConfigMap kvp-kvplane-grafana-dashboard: carries the sidecar's label "
        "{'grafana_dashboard': '1'}"
    ]


def test_a_broken_dashboard_query_is_caught(checks: ModuleType, chart: list[dict[str, Any]]) -> None:
    docs = copy.deepcopy(chart)
    cm = _one(docs, "ConfigMap", "-grafana-dashboard")
    dashboard = json.loads(cm["data"]["kvplane.json"])
    panel = next(p for p in dashboard["panels"] if p.get("targets"))
    panel["targets"][0]["expr"] = "sum(rate(kvplane_gateway_turns_total[5m])"
    cm["data"]["kvplane.json"] = json.dumps(dashboard)
    failures = _failures(checks, docs)
    assert len(failures) == 1 and "query reads metrics: sum(rate(kvplane_gateway_turns_total" in failures[0]


def test_an_alert_without_a_severity_is_caught(checks: ModuleType, chart: list[dict[str, Any]]) -> None:
    docs = copy.deepcopy(chart)
    rule = _one(docs, "PrometheusRule")["spec"]["groups"][0]["rules"][0]
    del rule["labels"]["severity"]
    assert _failures(checks, docs) == [
        "[test] PrometheusRule kvp-kvplane KvplaneRoutingUnavailable: has a severity and a summary"
    ]


@pytest.mark.skipif(shutil.which("node") is None, reason="node not installed")
def test_the_prometheus_rule_crd_schema_rejects_a_rule_without_an_expression(
    chart: list[dict[str, Any]], tmp_path: Path
) -> None:
    if not (VALIDATE / "node_modules" / "@kubernetes-models" / "prometheus-operator").exists():
        pytest.skip("CRD schemas not installed: run deploy/scripts/validate_deploy.sh once (npm ci)")
    good = _one(chart, "PrometheusRule")
    bad = copy.deepcopy(good)
    del bad["spec"]["groups"][0]["rules"][0]["expr"]
    path = tmp_path / "crds.json"
    for rule, code in ((good, 0), (bad, 1)):
        path.write_text(json.dumps([rule]))
        result = subprocess.run(
            ["node", str(VALIDATE / "crd_schemas.mjs"), str(path)], capture_output=True, text=True
        )
        assert result.returncode == code, result.stdout + result.stderr
    assert "expr" in result.stdout


def test_an_autoscaler_of_a_deployment_that_keeps_its_replicas_is_caught(
    checks: ModuleType, chart: list[dict[str, Any]]
) -> None:
    docs = copy.deepcopy(chart)
    _one(docs, "Deployment", "-gateway")["spec"]["replicas"] = 3
    assert _failures(checks, docs) == [
        "[test] HorizontalPodAutoscaler kvp-kvplane-gateway: the Deployment leaves its replicas to the HPA"
    ]
    _one(docs, "HorizontalPodAutoscaler", "-gateway")["spec"]["scaleTargetRef"]["name"] = "kvp-kvplane-gw"
    assert "[test] HorizontalPodAutoscaler kvp-kvplane-gateway: scales a chart Deployment" in _failures(
        checks, docs
    )


def test_the_autoscaler_passes_the_strict_kubernetes_schema_and_a_misspelt_field_does_not(
    checks: ModuleType, chart: list[dict[str, Any]]
) -> None:
    hpa = copy.deepcopy(_one(chart, "HorizontalPodAutoscaler", "-gateway"))
    assert checks.kubernetes_validate(hpa, "1.29.0") == ""
    hpa["spec"]["minReplica"] = hpa["spec"].pop("minReplicas")
    assert "minReplica" in checks.kubernetes_validate(hpa, "1.37.0")


def test_the_gateway_sleeps_before_sigterm_within_its_grace_period(
    checks: ModuleType, chart: list[dict[str, Any]]
) -> None:
    gateway = _one(chart, "Deployment", "-gateway")["spec"]["template"]["spec"]
    assert gateway["containers"][0]["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "5"]
    assert gateway["terminationGracePeriodSeconds"] == 70
    docs = copy.deepcopy(chart)
    _one(docs, "Deployment", "-gateway")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 60
    assert _failures(checks, docs) == [
        "[test] gateway: terminationGracePeriodSeconds covers the preStop sleep and the drain"
    ]
    # A grace period the values shorten is refused the same way.
    short = checks.render_chart(
        {**VALUES, "gateway": {"terminationGracePeriodSeconds": 30}}, "kvp", "kvplane"
    )
    assert (
        "[test] gateway: terminationGracePeriodSeconds covers the preStop sleep and the drain"
        in _failures(checks, short, {**VALUES, "gateway": {"terminationGracePeriodSeconds": 30}})
    )


def test_engines_get_a_headless_service_a_budget_a_monitor_and_otel_settings(
    chart: list[dict[str, Any]],
) -> None:
    for component in ("sim-prefill", "sim-decode", "vllm-prefill", "vllm-decode"):
        service = _one(chart, "Service", f"-{component}")
        assert service["spec"]["clusterIP"] == "None"
        assert _one(chart, "ServiceMonitor", f"-{component}")["spec"]["endpoints"][0]["path"] == "/metrics"
        assert _one(chart, "PodDisruptionBudget", f"-{component}")["spec"]["maxUnavailable"] == 1
        pod = _one(chart, "Deployment", f"-{component}")["spec"]["template"]["spec"]
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        assert env["OTEL_SERVICE_NAME"] == f"kvplane-{component}"
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.observability:4317"


def test_an_engine_without_its_otel_endpoint_or_budget_is_caught(
    checks: ModuleType, chart: list[dict[str, Any]]
) -> None:
    docs = copy.deepcopy(chart)
    container = _one(docs, "Deployment", "-vllm-decode")["spec"]["template"]["spec"]["containers"][0]
    container["env"] = [e for e in container["env"] if e["name"] != "OTEL_EXPORTER_OTLP_ENDPOINT"]
    docs.remove(_one(docs, "PodDisruptionBudget", "-sim-prefill"))
    assert sorted(_failures(checks, docs)) == [
        "[test] Deployment kvp-kvplane-sim-prefill: a PodDisruptionBudget iff engines.pdb.enabled",
        "[test] Deployment kvp-kvplane-vllm-decode: OTEL_SERVICE_NAME, and OTEL_EXPORTER_OTLP_ENDPOINT iff "
        "telemetry.otlpEndpoint",
    ]


def test_every_operations_object_is_left_out_when_turned_off(checks: ModuleType) -> None:
    values = {
        "engines": {"sim": {"enabled": True}, "service": {"enabled": False}, "pdb": {"enabled": False}},
        "prometheusRule": {"enabled": False},
        "grafanaDashboard": {"enabled": False},
        "gateway": {"preStopSleepSeconds": 0},
    }
    docs = checks.render_chart(values, "kvp", "kvplane")
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert not {k for k, _ in names} & {"PrometheusRule", "HorizontalPodAutoscaler"}
    assert ("ConfigMap", "kvp-kvplane-grafana-dashboard") not in names
    assert not [
        n for k, n in names if k in ("Service", "PodDisruptionBudget", "ServiceMonitor") and "-sim-" in n
    ]
    gateway = _one(docs, "Deployment", "-gateway")
    assert "lifecycle" not in gateway["spec"]["template"]["spec"]["containers"][0]
    assert gateway["spec"]["replicas"] == 2
    assert _failures(checks, docs, values) == []
