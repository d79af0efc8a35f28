"""The Helm chart: rendered for each values file, validated, and its manifests cross-checked."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from .etcd_access_checks import check_etcd_access
from .kvplane_code import (
    check_health_probe,
    connector_setting_names,
    host_port,
    load_settings,
    module_file,
    parse_front,
    parse_serve,
    parse_sim_engine,
    settings_has_section,
    without_section,
)
from .manifests import check_kubernetes_docs, container_ports, docs_of, matches, pod_templates
from .ops_checks import check_operations
from .pool_checks import check_inference_pool
from .report import CHART, Report


class Rendering:
    """One rendering of the chart: its documents, and the pods they run."""

    def __init__(self, docs: list[dict[str, Any]], values: dict[str, Any]) -> None:
        self.docs = docs
        self.pods = pod_templates(docs)
        self.accounts = {d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount"}
        self.engine_labels = values["engines"]["podLabels"]
        self.services_by_name = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
        # The pods of CronJobs (etcd backups) and Jobs (etcd's setup) are peers too, though no
        # Service or PDB covers them.
        self.job_pods = [d["spec"]["jobTemplate"]["spec"]["template"] for d in docs if d["kind"] == "CronJob"]
        self.job_pods += [d["spec"]["template"] for d in docs if d["kind"] == "Job"]

    def hpa_floor(self, deployment: str) -> int:
        """The minReplicas of the HPA that scales `deployment`; 1 if none does."""
        for d in self.docs:
            if d["kind"] == "HorizontalPodAutoscaler" and d["spec"]["scaleTargetRef"]["name"] == deployment:
                return int(d["spec"].get("minReplicas", 1))
        return 1

    def pods_for(self, selector: Mapping[str, str]) -> list[dict[str, Any]]:
        templates = [t for _, t in self.pods] + self.job_pods
        return [t for t in templates if matches(selector, t["metadata"]["labels"])]


def check_chart_semantics(
    label: str, docs: list[dict[str, Any]], values: dict[str, Any], report: Report
) -> None:
    r = Rendering(docs, values)
    _check_workloads(r, label, report)
    _check_services(r, label, report)
    _check_disruption_budgets(r, label, report)
    _check_network_policies(r, label, report)
    _check_service_monitors(r, label, report)
    _check_engine_isolation(r, label, values, report)
    _check_routing_targets(r, label, report)


def _check_workloads(r: Rendering, label: str, report: Report) -> None:
    """Selectors, ServiceAccounts, probes, mounted files and each container's own configuration."""
    for workload, template in r.pods:
        name = f"{label} {workload['kind']} {workload['metadata']['name']}"
        report.check(
            matches(workload["spec"]["selector"]["matchLabels"], template["metadata"]["labels"]),
            f"{name}: selector matches its pods",
        )
        report.check(
            template["spec"].get("serviceAccountName") in r.accounts,
            f"{name}: runs as a chart ServiceAccount",
        )
        ports = container_ports(template)
        for c in template["spec"]["containers"]:
            _check_container(r, name, c, ports, report)
        if workload["kind"] == "StatefulSet":
            report.check(
                workload["spec"]["serviceName"] in r.services_by_name
                and r.services_by_name[workload["spec"]["serviceName"]]["spec"].get("clusterIP") == "None",
                f"{name}: has its headless Service",
            )


def routing_replicas(r: Rendering) -> list[str]:
    """host:port of each routing replica by its own name (<pod>.<headless Service>.<namespace>.svc)."""
    workloads = [
        w
        for w, t in r.pods
        if w["kind"] == "StatefulSet"
        and t["metadata"]["labels"].get("app.kubernetes.io/component") == "routing"
    ]
    if len(workloads) != 1:
        return []
    sts = workloads[0]
    headless = r.services_by_name.get(sts["spec"]["serviceName"], {})
    ports = [p["port"] for p in headless.get("spec", {}).get("ports", []) if p.get("name") == "grpc"]
    namespace = sts["metadata"].get("namespace", "kvplane")
    name, svc = sts["metadata"]["name"], sts["spec"]["serviceName"]
    return [
        f"{name}-{i}.{svc}.{namespace}.svc:{port}"
        for i in range(int(sts["spec"]["replicas"]))
        for port in ports
    ]


def _routing_targets_of(c: dict[str, Any]) -> list[str] | None:
    """The routing replicas a gateway, sim-engine or vLLM container is given; None: not such a container."""
    env = {e["name"]: e.get("value") for e in c.get("env", [])}
    if "KVPLANE_GATEWAY__ROUTING" in env:
        return [str(t) for t in json.loads(env["KVPLANE_GATEWAY__ROUTING"])]
    args = [str(a) for a in c.get("args", [])]
    if c["name"] == "engine":
        given = [a.split("=", 1)[1] for a in args if a.startswith("--routing=")]
        return given[0].split(",") if given else []
    if c["name"] == "vllm":
        kv = [a.split("=", 1)[1] for a in args if a.startswith("--kv-transfer-config=")]
        section = json.loads(kv[0]).get("kv_connector_extra_config", {}).get("kvplane", {}) if kv else {}
        return [t for t in str(section.get("routing_targets", "")).split(",") if t]
    return None


def _check_routing_targets(r: Rendering, label: str, report: Report) -> None:
    """Every gateway and engine lists each routing replica by its own name, and nothing else: the
    home replica and hedging need the list, and each engine's stream must reach every replica."""
    replicas = routing_replicas(r)
    report.check(bool(replicas), f"{label}: routing is a StatefulSet with a headless Service and a grpc port")
    for workload, template in r.pods:
        for c in template["spec"]["containers"]:
            targets = _routing_targets_of(c)
            if targets is None:
                continue
            report.check(
                targets == replicas,
                f"{label} {workload['kind']} {workload['metadata']['name']}: "
                "routing targets are every routing replica",
                f"{targets} != {replicas}",
            )


def _check_container(
    r: Rendering, name: str, c: dict[str, Any], ports: dict[str | int, int], report: Report
) -> None:
    """A container's probes name its ports (or run `kvplane health`), its files are mounted, and
    kvplane's, the sim-engine's and vLLM's containers are configured as they must be."""
    for probe_kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = c.get(probe_kind)
        if not probe:
            continue
        if "exec" in probe:
            check_health_probe(f"{name}: {probe_kind}", probe["exec"]["command"], c, ports, report)
            continue
        port = (probe.get("grpc") or probe.get("httpGet") or probe.get("tcpSocket") or {}).get("port")
        report.check(port in ports, f"{name}: {probe_kind} port {port} is a container port")
    env = {e["name"]: e.get("value") for e in c.get("env", [])}
    # Certificates, tokens and keys named by a variable must be in a volume the pod mounts.
    mounts = [m["mountPath"].rstrip("/") + "/" for m in c.get("volumeMounts", [])]
    for var, value in env.items():
        if var.endswith("_FILE") and isinstance(value, str) and value.startswith("/"):
            report.check(
                any(value.startswith(m) for m in mounts),
                f"{name}: {var} ({value}) is in a mounted volume",
            )
    if c["name"] in ("metadata", "routing", "eviction", "gateway", "epp", "sidecar"):
        check_kvplane_container(name, c, env, r.docs, report)
    if c["name"] == "engine":
        check_sim_container(name, c, report)
    if c["name"] == "vllm":
        check_vllm_container(name, c, r.docs, report)


def _check_services(r: Rendering, label: str, report: Report) -> None:
    """Every Service selects pods, its ports are distinct, and its target ports exist."""
    for svc in r.services_by_name.values():
        name = f"{label} Service {svc['metadata']['name']}"
        ports = [(p["port"], p.get("protocol", "TCP")) for p in svc["spec"]["ports"]]
        names = [p.get("name") for p in svc["spec"]["ports"]]
        report.check(
            len(set(ports)) == len(ports) and len(set(names)) == len(names),
            f"{name}: ports and port names are distinct",
            str(ports),
        )
        selected = r.pods_for(svc["spec"]["selector"])
        if report.check(bool(selected), f"{name}: selects pods"):
            for port in svc["spec"]["ports"]:
                target = port.get("targetPort", port["port"])
                report.check(target in container_ports(selected[0]), f"{name}: targetPort {target} exists")


def _check_disruption_budgets(r: Rendering, label: str, report: Report) -> None:
    """Every PodDisruptionBudget covers one workload and leaves room for an eviction."""
    for pdb in (d for d in r.docs if d["kind"] == "PodDisruptionBudget"):
        name = f"{label} PodDisruptionBudget {pdb['metadata']['name']}"
        owners = [
            w for w, t in r.pods if matches(pdb["spec"]["selector"]["matchLabels"], t["metadata"]["labels"])
        ]
        if report.check(len(owners) == 1, f"{name}: covers one workload"):
            # An autoscaled Deployment leaves its replicas to its HPA: its floor is the HPA's.
            replicas = owners[0]["spec"].get("replicas") or r.hpa_floor(owners[0]["metadata"]["name"])
            if "minAvailable" in pdb["spec"]:
                report.check(
                    pdb["spec"]["minAvailable"] < replicas or replicas == 1,
                    f"{name}: leaves room for a voluntary eviction",
                    f"minAvailable={pdb['spec']['minAvailable']} replicas={replicas}",
                )


def _check_network_policies(r: Rendering, label: str, report: Report) -> None:
    """Every NetworkPolicy selects pods; its chart peers select pods; its ports are served."""
    for np in (d for d in r.docs if d["kind"] == "NetworkPolicy"):
        name = f"{label} NetworkPolicy {np['metadata']['name']}"
        selector = np["spec"]["podSelector"]["matchLabels"]
        external_engines = selector == r.engine_labels and not r.pods_for(selector)
        report.check(bool(r.pods_for(selector)) or external_engines, f"{name}: selects pods")
        for rule in np["spec"].get("ingress", []):
            for peer in rule.get("from", []):
                sel = peer.get("podSelector", {}).get("matchLabels")
                # Peers the chart itself names (values may add others, outside the chart).
                chart_peer = sel is not None and (
                    sel.get("app.kubernetes.io/name") == "kvplane" or sel == r.engine_labels
                )
                if chart_peer and "namespaceSelector" not in peer:
                    report.check(
                        bool(r.pods_for(sel)) or sel == r.engine_labels, f"{name}: peer {sel} selects pods"
                    )
            for port in rule.get("ports", []):
                targets = r.pods_for(selector)
                if targets:
                    report.check(
                        any(port["port"] in container_ports(t) for t in targets),
                        f"{name}: port {port['port']} is served",
                    )


def _check_service_monitors(r: Rendering, label: str, report: Report) -> None:
    """Every ServiceMonitor selects a Service and names its ports."""
    for sm in (d for d in r.docs if d["kind"] == "ServiceMonitor"):
        name = f"{label} ServiceMonitor {sm['metadata']['name']}"
        selected = [
            s
            for s in r.services_by_name.values()
            if matches(sm["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
        ]
        if report.check(len(selected) >= 1, f"{name}: selects a Service"):
            names = {p.get("name") for s in selected for p in s["spec"]["ports"]}
            for ep in sm["spec"]["endpoints"]:
                report.check(ep["port"] in names, f"{name}: endpoint port {ep['port']} is a Service port")


def engine_http_ports(values: dict[str, Any]) -> set[int]:
    """The ports on which engine pods serve HTTP: the engines' own, and with the InferencePool path
    the decode engines' beside their sidecars and the sidecars'."""
    ports = {int(values["engines"]["httpPort"])}
    pool = values.get("inferencePool", {})
    if pool.get("enabled"):
        ports |= {int(pool["sidecar"]["enginePort"]), int(pool["sidecar"]["port"])}
    return ports


def _check_engine_isolation(r: Rendering, label: str, values: dict[str, Any], report: Report) -> None:
    """No NetworkPolicy lets anyone but engines reach an engine pod beyond its HTTP ports (the NIXL
    side channel and transfers)."""
    engines_np = [
        d
        for d in r.docs
        if d["kind"] == "NetworkPolicy" and d["spec"]["podSelector"]["matchLabels"] == r.engine_labels
    ]
    if values["networkPolicy"]["enabled"]:
        http_ports = engine_http_ports(values)
        engine_pods = r.pods_for(r.engine_labels)
        ok = len(engines_np) == 1
        for np in (d for d in r.docs if d["kind"] == "NetworkPolicy"):
            selector = np["spec"]["podSelector"]["matchLabels"]
            if selector != r.engine_labels and not any(p in engine_pods for p in r.pods_for(selector)):
                continue
            for rule in np["spec"].get("ingress", []):
                peers = rule.get("from", [])
                if "ports" not in rule:
                    ok = (
                        ok
                        and bool(peers)
                        and all(
                            p.get("podSelector", {}).get("matchLabels") == r.engine_labels and len(p) == 1
                            for p in peers
                        )
                    )
                else:
                    ok = ok and {p["port"] for p in rule["ports"]} <= http_ports
        report.check(ok, f"{label}: only engines reach engines beyond the HTTP port (NIXL side channel)")


def check_kvplane_container(
    name: str, c: dict[str, Any], env: dict[str, Any], docs: list[dict[str, Any]], report: Report
) -> None:
    config_maps = [d for d in docs if d["kind"] == "ConfigMap" and "kvplane.yaml" in d.get("data", {})]
    config_text = config_maps[0]["data"]["kvplane.yaml"] if config_maps else None
    secret_env = {e["name"] for e in c.get("env", []) if "valueFrom" in e}
    plain_env = {k: v for k, v in env.items() if v is not None}
    # Secret-backed variables must still name real settings: give them a well-formed value.
    placeholders = {
        "KVPLANE_AUTH__TOKENS": "[]",
        "KVPLANE_GATEWAY__API_KEYS": "[]",
        "KVPLANE_GATEWAY__ROUTING_TOKEN": "a-token",
        "KVPLANE_GATEWAY__CACHE_SALT_KEY": "a-key",
        "KVPLANE_SIDECAR__ROUTE_KEY": "a-route-key",
    }
    for var in secret_env:
        report.check(var in placeholders, f"{name}: secret variable {var} is a known setting")
        plain_env[var] = placeholders.get(var, "")
    args = c.get("args", [])
    text = config_text
    if args[:1] == ["gateway"] and not settings_has_section("gateway"):
        report.note(f"{name}: settings have no gateway section yet; gateway settings not checked")
        text, plain_env = without_section(config_text, plain_env, "gateway")
    try:
        if args[:1] == ["serve"]:
            flags = parse_serve(args)[1]
        elif args[:1] in (["epp"], ["sidecar"]):
            flags = parse_front(args)
        else:
            flags = {}
        settings = load_settings(plain_env, text, flags)
        ok, detail = True, ""
    except (SystemExit, Exception) as exc:
        ok, detail, settings = False, repr(exc), None
    report.check(ok, f"{name}: `kvplane {' '.join(args)}` and its settings (ConfigMap + env) load", detail)
    if settings is None:
        return
    mounts = {m["mountPath"] for m in c.get("volumeMounts", [])}
    report.check(
        os.path.dirname(env.get("KVPLANE_CONFIG") or "/") in mounts, f"{name}: settings file is mounted"
    )
    sts = {d["metadata"]["name"]: d for d in docs if d["kind"] == "StatefulSet"}
    for endpoint in settings.etcd.endpoints:
        m = re.fullmatch(r"(.+)-(\d+)\.([^.]+)\.([^.]+)\.svc:2379", endpoint)
        if m and m.group(1) in sts:
            report.check(
                int(m.group(2)) < sts[m.group(1)]["spec"]["replicas"]
                and m.group(3) == sts[m.group(1)]["spec"]["serviceName"],
                f"{name}: etcd endpoint {endpoint} is a member of the StatefulSet",
            )


def check_sim_container(name: str, c: dict[str, Any], report: Report) -> None:
    args = [a.replace("$(POD_IP)", "10.0.0.1").replace("$(POD_NAME)", "pod-0") for a in c.get("args", [])]
    try:
        sim = parse_sim_engine(args)
        ok, detail = True, ""
    except (SystemExit, Exception) as exc:
        ok, detail, sim = False, repr(exc), None
    report.check(ok, f"{name}: `kvplane sim-engine` flags parse", detail)
    if sim is not None:
        report.check(
            sim.advertised_http_host == "10.0.0.1" and sim.advertised_side_channel_host == "10.0.0.1",
            f"{name}: advertises its pod IP",
        )
        report.check(
            sim.http_host in ("10.0.0.1", "0.0.0.0", "::")
            and sim.side_channel_host in ("10.0.0.1", "0.0.0.0", "::"),
            f"{name}: binds its pod IP or every interface",
        )
        ports = container_ports({"spec": {"containers": [c]}})
        report.check(
            sim.http_port in ports and sim.side_channel_port in ports,
            f"{name}: HTTP and side-channel ports declared",
        )


def check_vllm_container(name: str, c: dict[str, Any], docs: list[dict[str, Any]], report: Report) -> None:
    """A vLLM worker: its connector configuration, the addresses it registers, its ports."""
    args = c.get("args", [])
    kv = [a.split("=", 1)[1] for a in args if a.startswith("--kv-transfer-config=")]
    if not report.check(len(kv) == 1, f"{name}: one --kv-transfer-config"):
        return
    try:
        config = json.loads(kv[0])
    except json.JSONDecodeError as exc:
        report.check(False, f"{name}: --kv-transfer-config is JSON", str(exc))
        return
    module = config.get("kv_connector_module_path", "")
    report.check(module_file(module) is not None, f"{name}: connector module {module} exists")
    extra = config.get("kv_connector_extra_config", {})
    report.check(extra.get("bidirectional_kv_xfer") is True, f"{name}: bidirectional transfer on")
    section = extra.get("kvplane", {})
    unknown = set(section) - connector_setting_names()
    report.check(not unknown, f"{name}: kvplane connector settings are known", str(sorted(unknown)))
    services = {
        d["metadata"]["name"]: d["spec"]["selector"].get("app.kubernetes.io/component")
        for d in docs
        if d["kind"] == "Service"
    }
    for key, component in (("metadata_target", "metadata"), ("eviction_target", "eviction")):
        host, port = host_port(section.get(key, ":0"))
        report.check(
            services.get(host) == component and port > 0,
            f"{name}: {key} {host}:{port} is the {component} Service",
        )
    env = {e["name"]: e.get("value") for e in c.get("env", [])}
    ports = container_ports({"spec": {"containers": [c]}})
    report.check(
        env.get("KVPLANE_NODE_ID") == "$(POD_NAME)" and env.get("VLLM_NIXL_SIDE_CHANNEL_HOST") == "$(POD_IP)",
        f"{name}: registers under its pod name and advertises its pod IP",
    )
    http_port = [a.split("=", 1)[1] for a in args if a.startswith("--port=")]
    report.check(
        bool(http_port)
        and env.get("KVPLANE_HTTP_URL") == f"http://$(POD_IP):{http_port[0]}"
        and int(http_port[0]) in ports.values(),
        f"{name}: advertised HTTP URL is its serving port",
    )
    report.check(
        int(env.get("VLLM_NIXL_SIDE_CHANNEL_PORT") or 0) in ports.values(),
        f"{name}: side-channel port declared",
    )


def check_etcd_backup(label: str, docs: list[dict[str, Any]], values: dict[str, Any], report: Report) -> None:
    """The etcd backup CronJob (templates/etcd-backup.yaml): its identity, claim and etcdctl flags."""
    backup, tls = values["etcd"]["backup"], values["etcd"]["tls"]
    jobs = [d for d in docs if d["kind"] == "CronJob" and d["metadata"]["name"].endswith("-etcd-backup")]
    if not report.check(
        len(jobs) == int(bool(backup["enabled"])), f"{label}: etcd backup CronJob iff enabled"
    ):
        return
    for job in jobs:
        name = f"{label} CronJob {job['metadata']['name']}"
        pod = job["spec"]["jobTemplate"]["spec"]["template"]["spec"]
        accounts = {d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount"}
        report.check(pod.get("serviceAccountName") in accounts, f"{name}: runs as a chart ServiceAccount")
        claims = {d["metadata"]["name"] for d in docs if d["kind"] == "PersistentVolumeClaim"}
        volumes = {v["name"]: v for v in pod["volumes"]}
        claim = volumes["backup"]["persistentVolumeClaim"]["claimName"]
        report.check(
            claim == (backup["storage"]["existingClaim"] or claim)
            and (claim in claims) != bool(backup["storage"]["existingClaim"]),
            f"{name}: snapshots go to the chart's claim or the one given",
        )
        containers = pod["initContainers"] + pod["containers"]
        report.check(
            all(any(m["name"] == "backup" for m in c["volumeMounts"]) for c in containers),
            f"{name}: every step mounts the backup claim",
        )
        etcdctl = next(c["command"] for c in pod["initContainers"] if c["command"][0] == "etcdctl")
        endpoints = [a for a in etcdctl if a.startswith("--endpoints=")]
        report.check(len(endpoints) == 1 and "," not in endpoints[0], f"{name}: snapshots exactly one member")
        flags = {a.split("=", 1)[0] for a in etcdctl}
        wants_tls = bool(tls["enabled"])
        # root's certificate: with etcd's auth on, only root may take a snapshot.
        root = tls["clientSecrets"]["root"] or f"{job['metadata']['name'].removesuffix('-backup')}-root"
        report.check(
            endpoints[0].startswith("--endpoints=https://" if wants_tls else "--endpoints=http://")
            and ({"--cacert", "--cert", "--key"} <= flags) == wants_tls
            and (volumes.get("etcd-client-tls", {}).get("secret", {}).get("secretName") == root) == wants_tls,
            f"{name}: etcdctl speaks TLS with root's client certificate iff etcd.tls is on",
        )


def render_chart(values: dict[str, Any], release: str, namespace: str) -> list[dict[str, Any]]:
    import helm_python as helm

    with helm.Chart.load(str(CHART)) as chart:
        rendered = chart.render(values, name=release, namespace=namespace)
    docs: list[dict[str, Any]] = []
    for path in sorted(rendered):
        if path.endswith(".yaml"):
            docs.extend(docs_of(rendered[path]))
    return docs


def merged_values(overrides: dict[str, Any]) -> dict[str, Any]:
    def merge(base: Any, top: Any) -> Any:
        # As Helm coalesces values: maps merge, and null deletes a default.
        if isinstance(base, dict) and isinstance(top, dict):
            out = {**base, **{k: merge(base.get(k), v) for k, v in top.items()}}
            return {k: v for k, v in out.items() if v is not None}
        return top

    merged: dict[str, Any] = merge(yaml.safe_load((CHART / "values.yaml").read_text()), overrides)
    return merged


# The InferencePool path on, with sim-engines, the smallest values that render it.
POOL_ON: dict[str, Any] = {
    "engines": {"sim": {"enabled": True}},
    "inferencePool": {
        "enabled": True,
        "ingressFrom": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gateways"}}}],
    },
}


def check_helm(out: Path, report: Report) -> None:
    import helm_python as helm

    report.note(f"Helm SDK {helm.helm_sdk_version()} (helm-python-sdk)")
    lint = helm.lint(str(CHART))
    for message in lint["messages"]:
        report.note(f"helm lint: severity {message['severity']} {message['path']}: {message['error']}")
    report.check(not lint["errors"], "helm lint: no errors", "; ".join(lint["errors"]))

    crds: list[dict[str, Any]] = []
    value_files = [("default", {})] + [
        (p.stem, yaml.safe_load(p.read_text()) or {}) for p in sorted((CHART / "ci").glob("*-values.yaml"))
    ]
    for label, overrides in value_files:
        try:
            docs = render_chart(overrides, "kvp", "kvplane")
        except Exception as exc:
            report.check(False, f"helm render {label}", repr(exc))
            continue
        report.check(True, f"helm render {label}: {len(docs)} resources")
        (out / f"helm-{label}.yaml").write_text(yaml.safe_dump_all(docs, sort_keys=False))
        crds.extend(check_kubernetes_docs(f"[{label}]", docs, report))
        check_chart_semantics(f"[{label}]", docs, merged_values(overrides), report)
        check_etcd_backup(f"[{label}]", docs, merged_values(overrides), report)
        check_etcd_access(f"[{label}]", docs, merged_values(overrides), report)
        check_operations(f"[{label}]", docs, merged_values(overrides), report)
        check_inference_pool(f"[{label}]", docs, merged_values(overrides), report)

    # Values the chart must refuse.
    refusals: list[tuple[str, dict[str, Any]]] = [
        ("external etcd without endpoints", {"etcd": {"enabled": False, "external": {"endpoints": []}}}),
        ("the retired open header mode", {"auth": {"mode": "header"}}),
        ("unknown auth mode", {"auth": {"mode": "none"}}),
        ("a misspelt value", {"services": {"routing": {"replica": 2}}}),
        (
            "external etcd over TLS without its client certificates",
            {"etcd": {"enabled": False, "external": {"endpoints": ["etcd.infra:2379"]}}},
        ),
        (
            "etcd's setup without etcd TLS",
            {"etcd": {"allowInsecure": True, "tls": {"enabled": False}}},
        ),
        (
            "etcd's setup without client-cert-auth",
            {"etcd": {"tls": {"clientCertAuth": False}}},
        ),
        ("auth.mode mtls without gRPC TLS", {"auth": {"mode": "mtls"}}),
        (
            "auth.mode mtls without client certificates",
            {
                "auth": {"mode": "mtls"},
                "grpc": {"tls": {"enabled": True, "serverSecret": "s", "mutual": False}},
            },
        ),
        ("gRPC TLS without the services' Secret", {"grpc": {"tls": {"enabled": True}}}),
        (
            "an autoscaler whose minReplicas is above its maxReplicas",
            {"autoscaling": {"gateway": {"enabled": True, "minReplicas": 5, "maxReplicas": 4}}},
        ),
        # Gateways and engines list routing's replicas by name: one an autoscaler added would be in no list.
        ("an autoscaler for routing", {"autoscaling": {"routing": {"enabled": True}}}),
        ("an engine PDB with both bounds", {"engines": {"pdb": {"minAvailable": 1, "maxUnavailable": 1}}}),
        (
            "gRPC TLS without the gateway's Secret",
            {"grpc": {"tls": {"enabled": True, "serverSecret": "s"}}},
        ),
        # The InferencePool path.
        (
            "a decode sidecar on its engine's port",
            {
                **POOL_ON,
                "inferencePool": {**POOL_ON["inferencePool"], "sidecar": {"port": 8200, "enginePort": 8200}},
            },
        ),
        (
            "an InferencePool open to anyone while NetworkPolicies are on",
            {**POOL_ON, "inferencePool": {"enabled": True}},
        ),
        ("an InferencePool without decode engines", {"inferencePool": POOL_ON["inferencePool"]}),
        (
            "an unknown failure mode",
            {**POOL_ON, "inferencePool": {**POOL_ON["inferencePool"], "failureMode": "Open"}},
        ),
    ]
    for label, bad_values in refusals:
        try:
            render_chart(bad_values, "kvp", "kvplane")
            refused = False
        except Exception:
            refused = True
        report.check(refused, f"helm render refuses {label}")
    (out / "helm-crds.json").write_text(json.dumps(crds))
