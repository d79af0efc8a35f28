"""The chart's Istio manifests, against the chart."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from .chart_checks import render_chart
from .client_calls import CallerCode, grpc_calls, http_paths, served_http_paths
from .istio_authz import Request, allowed
from .manifests import container_ports, matches, pod_templates
from .network_policy import Connection, admitted
from .report import ROOT, Report

# Istio security.istio.io/v1 fields kvplane's manifests may use; the CRD schemas accept unknown
# fields (the API server prunes them), so a misspelt field would otherwise pass unnoticed.
ISTIO_FIELDS: dict[str, Any] = {
    "PeerAuthentication": {"selector": {"matchLabels": None}, "mtls": {"mode": None}, "portLevelMtls": None},
    "AuthorizationPolicy": {
        "selector": {"matchLabels": None},
        "action": None,
        "rules": [
            {
                "from": [
                    {
                        "source": {
                            k: None
                            for k in (
                                "principals",
                                "notPrincipals",
                                "requestPrincipals",
                                "notRequestPrincipals",
                                "namespaces",
                                "notNamespaces",
                                "ipBlocks",
                                "notIpBlocks",
                                "remoteIpBlocks",
                                "notRemoteIpBlocks",
                            )
                        }
                    }
                ],
                "to": [
                    {
                        "operation": {
                            k: None
                            for k in (
                                "hosts",
                                "notHosts",
                                "ports",
                                "notPorts",
                                "methods",
                                "notMethods",
                                "paths",
                                "notPaths",
                            )
                        }
                    }
                ],
                "when": [{"key": None, "values": None, "notValues": None}],
            }
        ],
    },
}
# Principals outside the chart that the policies name on purpose (see authorization-policies.yaml).
EXTERNAL_PRINCIPALS = {
    "cluster.local/ns/kvplane/sa/kvplane-operator",
    "cluster.local/ns/istio-system/sa/istio-ingressgateway-service-account",
}


def unknown_fields(value: Any, shape: Any, path: str = "spec") -> list[str]:
    if shape is None:
        return []
    if isinstance(shape, list):
        return [
            e for i, item in enumerate(value or []) for e in unknown_fields(item, shape[0], f"{path}[{i}]")
        ]
    if not isinstance(value, dict):
        return [f"{path}: expected a mapping"]
    out = [f"{path}.{k}" for k in value if k not in shape]
    for k, v in value.items():
        if k in shape:
            out.extend(unknown_fields(v, shape[k], f"{path}.{k}"))
    return out


def grpc_service_paths() -> set[str]:
    out = set()
    for proto in (ROOT / "protos" / "kvplane" / "v1").glob("*.proto"):
        text = proto.read_text()
        package = re.search(r"^package\s+([\w.]+);", text, re.M)
        prefix = package.group(1) if package else ""
        for service, body in re.findall(r"^service\s+(\w+)\s*\{(.*?)^\}", text, re.M | re.S):
            out.add(f"/{prefix}.{service}/*")
            # A policy may also allow one method alone (engines may call routing's
            # StreamPrefixCache and nothing else of it).
            out.update(f"/{prefix}.{service}/{rpc}" for rpc in re.findall(r"^\s*rpc\s+(\w+)", body, re.M))
    return out


# The inference gateway's Envoy, outside the chart, in the checks' renderings: the mesh's ingress
# gateway (mesh.policies.gatewayClients' default), let in by the NetworkPolicies from its namespace.
ENVOY_PRINCIPAL = "cluster.local/ns/istio-system/sa/istio-ingressgateway-service-account"
ENVOY_NAMESPACE = "istio-system"
ENVOY_LABELS = {"istio": "ingressgateway"}
# Every workload on: the services, the gateway, sim-engines and vLLM workers, and the InferencePool
# path (its picker, and a sidecar in each decode pod).
MESH_VALUES: dict[str, Any] = {
    "engines": {"sim": {"enabled": True}, "vllm": {"enabled": True}},
    "mesh": {"enabled": True},
    "inferencePool": {
        "enabled": True,
        "ingressFrom": [
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ENVOY_NAMESPACE}}}
        ],
    },
}


def check_mesh(out: Path, report: Report) -> None:
    # The chart's Istio policies (templates/mesh-policies.yaml), rendered as release "kvplane" in
    # namespace "kvplane" with every workload on, checked against that same rendering.
    chart_docs = render_chart(MESH_VALUES, "kvplane", "kvplane")
    docs = [d for d in chart_docs if d["apiVersion"].startswith("security.istio.io/")]
    report.check(len(docs) >= 9, f"mesh: the chart renders {len(docs)} Istio policies")
    pods = [t for _, t in pod_templates(chart_docs)]
    accounts = {
        f"cluster.local/ns/kvplane/sa/{d['metadata']['name']}"
        for d in chart_docs
        if d["kind"] == "ServiceAccount"
    }
    grpc_paths = grpc_service_paths()
    # The x-kvplane-* call metadata keys the services read (auth.py reads them from headers.py).
    headers_source = (ROOT / "services" / "common" / "model" / "headers.py").read_text()
    report.check(
        all(t["metadata"]["labels"].get("sidecar.istio.io/inject") == "true" for t in pods),
        "chart with mesh.enabled: every pod gets a sidecar",
    )

    strict = [d for d in docs if d["kind"] == "PeerAuthentication" and not d["spec"].get("selector")]
    report.check(
        len(strict) == 1 and strict[0]["spec"]["mtls"]["mode"] == "STRICT", "mesh: namespace-wide STRICT mTLS"
    )
    report.check(
        any(d["kind"] == "AuthorizationPolicy" and d.get("spec") == {} for d in docs),
        "mesh: a default-deny AuthorizationPolicy (empty spec)",
    )
    for doc in docs:
        kind, name = doc["kind"], doc["metadata"]["name"]
        label = f"mesh {kind} {name}"
        report.check(doc["apiVersion"] == "security.istio.io/v1", f"{label}: security.istio.io/v1")
        report.check(doc["metadata"].get("namespace") == "kvplane", f"{label}: namespace kvplane")
        if kind not in ISTIO_FIELDS:
            report.check(False, f"{label}: a kind this check knows")
            continue
        bad = unknown_fields(doc.get("spec", {}), ISTIO_FIELDS[kind])
        report.check(not bad, f"{label}: only known fields", ", ".join(bad))
        selector = doc.get("spec", {}).get("selector", {}).get("matchLabels")
        selected = [t for t in pods if selector is None or matches(selector, t["metadata"]["labels"])]
        report.check(bool(selected), f"{label}: selects chart pods")
        for rule in doc.get("spec", {}).get("rules", []):
            for src in rule.get("from", []):
                for principal in src["source"].get("principals", []):
                    report.check(
                        principal in accounts or principal in EXTERNAL_PRINCIPALS,
                        f"{label}: principal {principal} is a chart ServiceAccount",
                    )
            for to in rule.get("to", []):
                op = to["operation"]
                for port in op.get("ports", []):
                    report.check(
                        any(int(port) in container_ports(t) for t in selected),
                        f"{label}: port {port} is served",
                    )
                for path in op.get("paths", []):
                    if path.startswith("/kvplane."):
                        report.check(path in grpc_paths, f"{label}: {path} is a kvplane gRPC service")
            for cond in rule.get("when", []):
                header = re.fullmatch(r"request\.headers\[(.+)\]", cond["key"])
                if header and header.group(1).startswith("x-kvplane-"):
                    report.check(
                        f'"{header.group(1)}"' in headers_source,
                        f"{label}: header {header.group(1)} is one the services read",
                    )
    check_client_calls(chart_docs, report)
    # Without the InferencePool path the decode engines serve on engines.httpPort: the same calls,
    # to other ports.
    without_pool = {k: v for k, v in MESH_VALUES.items() if k != "inferencePool"}
    check_client_calls(render_chart(without_pool, "kvplane", "kvplane"), report, "mesh (no InferencePool)")
    (out / "mesh-crds.json").write_text(json.dumps(docs))


# Who calls: each client's code, the workload it runs in, and the headers it sends on gRPC.
GATEWAY_CODE = CallerCode("gateway", ("services/gateway", "services/client"))
ENGINE_CODE = CallerCode("engine", ("connector",), exclude=("connector/simengine",))
# The endpoint picker and the decode sidecar run parts of the gateway: their own code, and what it
# reaches of the gateway's and the routing client's (client_calls.reachable_code).
FRONT_CODE = ("services/gateway", "services/client", "services/epp", "services/sidecar")
EPP_CODE = CallerCode("epp", ("services/epp",), follow=FRONT_CODE)
SIDECAR_CODE = CallerCode("sidecar", ("services/sidecar",), follow=FRONT_CODE)
NODE_HEADERS = {"x-kvplane-role": "node", "x-kvplane-node": "kvplane-sim-prefill-0"}
# Which component serves each kvplane gRPC service (the chart runs one Deployment per service).
SERVICE_COMPONENT = {
    "RoutingService": "routing",
    "MetadataService": "metadata",
    "EvictionService": "eviction",
}
COMPONENT = "app.kubernetes.io/component"


def ext_proc_paths() -> list[str]:
    """The gRPC paths Envoy calls on the picker: ext_proc's methods (from its descriptor, which the
    picker serves) and the health check of the picker's cluster."""
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

    service = ep.DESCRIPTOR.services_by_name["ExternalProcessor"]
    return [f"/{service.full_name}/{m.name}" for m in service.methods] + ["/grpc.health.v1.Health/Check"]


def client_requests(
    chart_docs: list[dict[str, Any]], namespace: str = "kvplane"
) -> list[tuple[str, Request]]:
    """Every request a kvplane client's code makes, as the destination's proxy would see it; with
    the InferencePool path, the picker's, the sidecars' and the inference gateway's too."""
    templates = [t for _, t in pod_templates(chart_docs)]
    by_component = {t["metadata"]["labels"].get(COMPONENT): t for t in templates}
    engines = [t for t in templates if t["metadata"]["labels"].get("kvplane.io/engine") == "true"]
    with_sidecar = [t for t in engines if any(c["name"] == "sidecar" for c in t["spec"]["containers"])]
    prefill = [t for t in engines if t["metadata"]["labels"].get(COMPONENT, "").endswith("-prefill")]

    def principal(template: dict[str, Any]) -> str:
        return f"cluster.local/ns/{namespace}/sa/{template['spec']['serviceAccountName']}"

    def grpc_port(template: dict[str, Any]) -> int:
        return container_ports(template)["grpc"]

    def request(caller: dict[str, Any], dest: dict[str, Any], port: int, path: str, **kw: Any) -> Request:
        labels = caller["metadata"]["labels"]
        return Request(
            principal(caller), namespace, dest["metadata"]["labels"], port, path, source_labels=labels, **kw
        )

    out: list[tuple[str, Request]] = []
    callers = [(GATEWAY_CODE, by_component["gateway"], {}), (ENGINE_CODE, engines[0], NODE_HEADERS)]
    if "epp" in by_component:
        callers.append((EPP_CODE, by_component["epp"], {}))
    if with_sidecar:
        callers.append((SIDECAR_CODE, with_sidecar[0], {}))
    for code, caller, headers in callers:
        calls = grpc_calls(code.units())
        targets = [SERVICE_COMPONENT[s] for s in calls if s in SERVICE_COMPONENT]
        for service, paths in sorted(calls.items()):
            # A health check goes to the replicas the caller holds channels to.
            components = targets if service == "Health" else [SERVICE_COMPONENT[service]]
            for component in components:
                dest = by_component[component]
                for path in sorted(paths):
                    out.append(
                        (
                            f"{code.name} -> {component} {path}",
                            request(caller, dest, grpc_port(dest), path, headers=headers),
                        )
                    )
    # HTTP: the gateway and the picker (/tokenize; it runs the gateway's turn code) to every engine,
    # the sidecars to the prefill engines (the P leg).
    http_callers = [(GATEWAY_CODE, by_component["gateway"], engines)]
    if "epp" in by_component:
        http_callers.append((EPP_CODE, by_component["epp"], engines))
    if with_sidecar:
        http_callers.append((SIDECAR_CODE, with_sidecar[0], prefill))
    for code, caller, dests in http_callers:
        for path in sorted(http_paths(code.units())):
            for engine in dests:
                port = container_ports(engine)["http"]
                out.append(
                    (
                        f"{code.name} -> {engine['metadata']['labels'][COMPONENT]} HTTP {path}",
                        request(caller, engine, port, path),
                    )
                )
    # The inference gateway's Envoy: ext_proc to the picker, each turn to a decode sidecar.
    if "epp" in by_component:
        picker = by_component["epp"]
        for path in ext_proc_paths():
            out.append(
                (
                    f"inference gateway -> epp {path}",
                    Request(
                        ENVOY_PRINCIPAL,
                        ENVOY_NAMESPACE,
                        picker["metadata"]["labels"],
                        container_ports(picker)["grpc-ext-proc"],
                        path,
                        source_labels=ENVOY_LABELS,
                    ),
                )
            )
    served = sorted(p for p in served_http_paths(SIDECAR_CODE.files()) if p.startswith("/v1/"))
    for decode in with_sidecar:
        for path in served:
            out.append(
                (
                    f"inference gateway -> {decode['metadata']['labels'][COMPONENT]} sidecar HTTP {path}",
                    Request(
                        ENVOY_PRINCIPAL,
                        ENVOY_NAMESPACE,
                        decode["metadata"]["labels"],
                        container_ports(decode)["sidecar"],
                        path,
                        source_labels=ENVOY_LABELS,
                    ),
                )
            )
    return out


def check_client_calls(chart_docs: list[dict[str, Any]], report: Report, what: str = "mesh") -> None:
    """Every RPC and HTTP path a kvplane client's code calls is allowed by the rendered Istio policies
    and let in by the rendered NetworkPolicies."""
    policies = [d for d in chart_docs if d.get("kind") == "AuthorizationPolicy"]
    network_policies = [d for d in chart_docs if d.get("kind") == "NetworkPolicy"]
    templates = [t for _, t in pod_templates(chart_docs)]
    requests = client_requests(chart_docs)
    report.check(len(requests) >= 10, f"{what}: {len(requests)} client calls read from the code")
    for label, request in requests:
        report.check(allowed(policies, request), f"{what} allows {label}")
        if not network_policies:
            continue
        dest = next(t for t in templates if t["metadata"]["labels"] == request.workload_labels)
        connection = Connection(
            request.source_labels,
            request.namespace,
            request.workload_labels,
            "kvplane",
            request.port,
            {k: v for k, v in container_ports(dest).items() if isinstance(k, str)},
        )
        report.check(admitted(network_policies, connection), f"{what}: NetworkPolicies let in {label}")
