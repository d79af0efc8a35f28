"""The chart's operations objects: the Grafana dashboard, the alert rules, the autoscalers, the
gateway's drain on stop, and each engine Deployment's Service, budget, monitor and OTEL settings."""

from __future__ import annotations

import inspect
import json
import re
from typing import Any

from .manifests import matches, pod_templates
from .promql import PromQLError, metric_names
from .report import Report

_DURATION = re.compile(r"(\d+(ms|s|m|h|d|w|y))+")


def check_operations(label: str, docs: list[dict[str, Any]], values: dict[str, Any], report: Report) -> None:
    check_dashboard(label, docs, values, report)
    check_alert_rules(label, docs, values, report)
    check_autoscalers(label, docs, values, report)
    check_gateway_drain(label, docs, values, report)
    check_engines(label, docs, values, report)


def _exprs_ok(name: str, exprs: list[str], report: Report) -> None:
    """Each expression parses and reads at least one metric."""
    for expr in exprs:
        try:
            ok, detail = bool(metric_names(expr)), "names no metric"
        except PromQLError as exc:
            ok, detail = False, str(exc)
        flat = " ".join(expr.split())
        report.check(ok, f"{name}: query reads metrics: {flat[:70]}", detail)


def dashboard_queries(dashboard: dict[str, Any]) -> list[str]:
    """Every query of every panel (rows' nested panels too)."""
    out = []
    stack = list(dashboard.get("panels", []))
    while stack:
        panel = stack.pop()
        stack.extend(panel.get("panels", []))
        out.extend(t["expr"] for t in panel.get("targets", []) if "expr" in t)
    return out


def rule_expressions(rule_doc: dict[str, Any]) -> list[str]:
    return [str(r["expr"]) for g in rule_doc["spec"]["groups"] for r in g["rules"]]


def check_dashboard(label: str, docs: list[dict[str, Any]], values: dict[str, Any], report: Report) -> None:
    """The dashboard ConfigMap iff enabled, with the sidecar's label, holding one dashboard whose
    every panel queries metrics through the data source variable."""
    wanted = values["grafanaDashboard"]
    maps = [
        d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"].endswith("-grafana-dashboard")
    ]
    if not report.check(len(maps) == int(bool(wanted["enabled"])), f"{label}: Grafana dashboard iff enabled"):
        return
    for cm in maps:
        name = f"{label} ConfigMap {cm['metadata']['name']}"
        report.check(
            matches(wanted["labels"], cm["metadata"].get("labels", {})),
            f"{name}: carries the sidecar's label {wanted['labels']}",
        )
        files = {k: v for k, v in cm.get("data", {}).items() if k.endswith(".json")}
        if not report.check(len(files) == 1, f"{name}: holds one dashboard .json"):
            continue
        try:
            dashboard = json.loads(next(iter(files.values())))
        except json.JSONDecodeError as exc:
            report.check(False, f"{name}: dashboard is JSON", str(exc))
            continue
        panels = [p for p in dashboard.get("panels", []) if p.get("type") != "row"]
        ids = [p.get("id") for p in dashboard.get("panels", [])]
        report.check(
            bool(dashboard.get("uid")) and bool(panels) and len(ids) == len(set(ids)),
            f"{name}: has a uid and panels with distinct ids",
        )
        variables = {v["name"] for v in dashboard.get("templating", {}).get("list", [])}
        report.check(
            all(
                p.get("datasource", {}).get("uid", "").strip("${}") in variables and p.get("targets")
                for p in panels
            ),
            f"{name}: every panel queries through a data source variable",
        )
        _exprs_ok(name, dashboard_queries(dashboard), report)


def check_alert_rules(label: str, docs: list[dict[str, Any]], values: dict[str, Any], report: Report) -> None:
    """The PrometheusRule iff enabled: each rule alerts with a severity and a summary, waits a valid
    duration, and reads metrics."""
    rules = [d for d in docs if d["kind"] == "PrometheusRule"]
    if not report.check(
        len(rules) == int(bool(values["prometheusRule"]["enabled"])), f"{label}: PrometheusRule iff enabled"
    ):
        return
    for doc in rules:
        name = f"{label} PrometheusRule {doc['metadata']['name']}"
        report.check(
            matches(values["prometheusRule"]["labels"], doc["metadata"].get("labels", {})),
            f"{name}: carries prometheusRule.labels",
        )
        alerts = [r for g in doc["spec"]["groups"] for r in g["rules"]]
        names = [r.get("alert") for r in alerts]
        report.check(all(names) and len(names) == len(set(names)), f"{name}: every rule is a distinct alert")
        for rule in alerts:
            what = f"{name} {rule.get('alert')}"
            report.check(
                rule.get("labels", {}).get("severity") in ("critical", "warning", "info")
                and bool(rule.get("annotations", {}).get("summary")),
                f"{what}: has a severity and a summary",
            )
            if "for" in rule:
                report.check(bool(_DURATION.fullmatch(str(rule["for"]))), f"{what}: `for` is a duration")
        _exprs_ok(name, rule_expressions(doc), report)


def check_autoscalers(label: str, docs: list[dict[str, Any]], values: dict[str, Any], report: Report) -> None:
    """An HPA per enabled autoscaler, scaling a chart Deployment that requests CPU and leaves its
    replicas to the HPA, within bounds that keep its PDB satisfiable."""
    hpas = {d["metadata"]["name"]: d for d in docs if d["kind"] == "HorizontalPodAutoscaler"}
    deployments = {w["metadata"]["name"]: (w, t) for w, t in pod_templates(docs) if w["kind"] == "Deployment"}
    pdbs = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    wanted = [n for n, a in values["autoscaling"].items() if a["enabled"]]
    if not values["gateway"]["enabled"]:
        wanted = [n for n in wanted if n != "gateway"]
    report.check(
        sorted(n.rsplit("-", 1)[-1] for n in hpas) == sorted(wanted),
        f"{label}: an HPA for each enabled autoscaler",
    )
    for hpa in hpas.values():
        name = f"{label} HorizontalPodAutoscaler {hpa['metadata']['name']}"
        spec = hpa["spec"]
        target = spec["scaleTargetRef"]
        if not report.check(
            target["kind"] == "Deployment" and target["name"] in deployments,
            f"{name}: scales a chart Deployment",
        ):
            continue
        workload, template = deployments[target["name"]]
        report.check(
            "replicas" not in workload["spec"], f"{name}: the Deployment leaves its replicas to the HPA"
        )
        report.check(
            1 <= spec.get("minReplicas", 1) <= spec["maxReplicas"], f"{name}: minReplicas <= maxReplicas"
        )
        cpu_metrics = [m for m in spec.get("metrics", []) if m.get("resource", {}).get("name") == "cpu"]
        report.check(
            bool(cpu_metrics)
            and all(
                c.get("resources", {}).get("requests", {}).get("cpu") for c in template["spec"]["containers"]
            ),
            f"{name}: scales on CPU, which every container requests",
        )
        for pdb in pdbs:
            if matches(pdb["spec"]["selector"]["matchLabels"], template["metadata"]["labels"]):
                floor = pdb["spec"].get("minAvailable")
                report.check(
                    not isinstance(floor, int)
                    or floor < spec.get("minReplicas", 1)
                    or spec.get("minReplicas") == 1,
                    f"{name}: minReplicas leaves room for its PDB's evictions",
                )


def gateway_drain_s(values: dict[str, Any]) -> float:
    """How long the gateway may take to stop after SIGTERM: its HTTP server's shutdown timeout (for
    the streams in flight), then its turn reports' timeout."""
    from aiohttp import web

    shutdown = inspect.signature(web.BaseRunner.__init__).parameters["shutdown_timeout"].default
    from kvplane.services.gateway.settings import GatewaySection

    configured = values.get("settings", {}).get("gateway", {}).get("report_timeout_s")
    reports = (
        configured if configured is not None else GatewaySection.model_fields["report_timeout_s"].default
    )
    return float(shutdown) + float(reports)


def check_gateway_drain(
    label: str, docs: list[dict[str, Any]], values: dict[str, Any], report: Report
) -> None:
    """The gateway sleeps before SIGTERM (preStop) and its grace period covers the sleep and the drain."""
    gateways = [t for w, t in pod_templates(docs) if w["metadata"]["name"].endswith("-gateway")]
    for template in gateways:
        name = f"{label} gateway"
        container = next(c for c in template["spec"]["containers"] if c["name"] == "gateway")
        command = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        sleep_s = values["gateway"]["preStopSleepSeconds"]
        ok = (command == ["sleep", str(sleep_s)]) if sleep_s else not command
        report.check(ok, f"{name}: preStop sleeps gateway.preStopSleepSeconds ({sleep_s} s)", str(command))
        grace = template["spec"].get("terminationGracePeriodSeconds", 30)
        needed = sleep_s + gateway_drain_s(values)
        report.check(
            grace >= needed,
            f"{name}: terminationGracePeriodSeconds covers the preStop sleep and the drain",
            f"{grace} s < {needed:g} s",
        )


def check_engines(label: str, docs: list[dict[str, Any]], values: dict[str, Any], report: Report) -> None:
    """Each engine Deployment: a headless Service, a PDB and a ServiceMonitor as the values ask, and
    OpenTelemetry's variables naming it and, with telemetry.otlpEndpoint, the collector."""
    engines = values["engines"]
    services = [d for d in docs if d["kind"] == "Service"]
    monitors = [d for d in docs if d["kind"] == "ServiceMonitor"]
    pdbs = [d for d in docs if d["kind"] == "PodDisruptionBudget"]
    endpoint = values["telemetry"]["otlpEndpoint"]
    for workload, template in pod_templates(docs):
        labels = template["metadata"]["labels"]
        if not matches(engines["podLabels"], labels):
            continue
        component = labels["app.kubernetes.io/component"]
        name = f"{label} {workload['kind']} {workload['metadata']['name']}"
        own = [s for s in services if s["spec"].get("selector") and matches(s["spec"]["selector"], labels)]
        want_service = bool(engines["service"]["enabled"])
        report.check(
            (len(own) == 1 and own[0]["spec"].get("clusterIP") == "None") if want_service else not own,
            f"{name}: a headless Service iff engines.service.enabled",
        )
        watched = [
            m
            for m in monitors
            for s in own
            if matches(m["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
        ]
        report.check(
            bool(watched) == (want_service and bool(values["serviceMonitor"]["enabled"])),
            f"{name}: a ServiceMonitor iff engines.service and serviceMonitor are on",
        )
        budgets = [p for p in pdbs if matches(p["spec"]["selector"]["matchLabels"], labels)]
        report.check(
            len(budgets) == int(bool(engines["pdb"]["enabled"])),
            f"{name}: a PodDisruptionBudget iff engines.pdb.enabled",
        )
        container = template["spec"]["containers"][0]
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        report.check(
            env.get("OTEL_SERVICE_NAME") == f"kvplane-{component}"
            and env.get("OTEL_EXPORTER_OTLP_ENDPOINT") == (f"http://{endpoint}" if endpoint else None),
            f"{name}: OTEL_SERVICE_NAME, and OTEL_EXPORTER_OTLP_ENDPOINT iff telemetry.otlpEndpoint",
        )
