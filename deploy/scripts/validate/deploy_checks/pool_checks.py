"""The InferencePool path (inferencePool.enabled): the pool, its endpoint picker and the decode
sidecars, wired to one another and to the rest of the chart.

What a Gateway API inference gateway needs, and what kvplane's picker and sidecars assume:

- the pool selects the decode pods that run a sidecar, and nothing else (a prefill engine or a
  decode engine without a sidecar, given a turn, would serve it without P);
- its target port is the port each sidecar listens on and declares; the picker answers D's sidecar
  as D's pod IP on `epp.sidecar_port`, so that is the same port, and D advertises its pod IP;
- its endpointPickerRef names a Service of the chart by a Service port that reaches the picker's
  ext_proc port, with the failure mode the values ask for;
- each sidecar calls the engine beside it: `sidecar.decode_url` is 127.0.0.1 on the port its
  engine serves;
- the picker and every sidecar read the route key from one Secret key; the picker reads the
  gateway's cache-salt key, API keys and routing replicas, so a tenant is the same tenant through
  either front;
- the HTTPRoute, when there is one, sends its matches to the pool and hangs off the Gateway named.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit

from .manifests import container_ports, matches, pod_templates
from .report import Report

POOL_API = "inference.networking.k8s.io/v1"
ROUTE_KEY = "KVPLANE_SIDECAR__ROUTE_KEY"


def _env(c: dict[str, Any]) -> dict[str, Any]:
    """A container's variables: plain values, or their secretKeyRef as a (name, key) pair."""
    out: dict[str, Any] = {}
    for e in c.get("env", []):
        ref = e.get("valueFrom", {}).get("secretKeyRef")
        out[e["name"]] = (ref["name"], ref["key"]) if ref else e.get("value")
    return out


def _containers(docs: list[dict[str, Any]], name: str) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(pod template, container) of every container called `name`."""
    return [(t, c) for _, t in pod_templates(docs) for c in t["spec"]["containers"] if c["name"] == name]


def _port_of(listen: Any) -> int:
    return int(str(listen).rpartition(":")[2] or 0)


def _volume_secret(template: dict[str, Any], mount_dir: str, container: dict[str, Any]) -> str | None:
    """The Secret behind the volume `container` mounts at `mount_dir`."""
    names = [m["name"] for m in container.get("volumeMounts", []) if m["mountPath"] == mount_dir]
    for v in template["spec"].get("volumes", []):
        if names and v["name"] == names[0]:
            secret: str | None = v.get("secret", {}).get("secretName")
            return secret
    return None


def _engine_port(container: dict[str, Any]) -> int | None:
    """The port a sim-engine or vLLM container serves HTTP on, from its flags."""
    for a in container.get("args", []):
        if str(a).startswith("--port="):
            return int(str(a).split("=", 1)[1])
    return None


def _advertises_pod_ip(container: dict[str, Any]) -> bool:
    """D registers its pod IP, which the picker turns into its sidecar's address."""
    args = [str(a) for a in container.get("args", [])]
    if container["name"] == "engine":
        advertised = [a.split("=", 1)[1] for a in args if a.startswith("--advertise-host=")]
        bound = [a.split("=", 1)[1] for a in args if a.startswith("--host=")]
        return (advertised or bound) == ["$(POD_IP)"]
    return str(_env(container).get("KVPLANE_HTTP_URL", "")).startswith("http://$(POD_IP):")


def check_inference_pool(
    label: str, docs: list[dict[str, Any]], values: dict[str, Any], report: Report
) -> None:
    pool_values = values.get("inferencePool", {})
    enabled = bool(pool_values.get("enabled"))
    pools = [d for d in docs if d["kind"] == "InferencePool"]
    pickers = _containers(docs, "epp")
    sidecars = _containers(docs, "sidecar")
    if not report.check(
        len(pools) == int(enabled) and bool(pickers) == enabled and bool(sidecars) == enabled,
        f"{label}: an InferencePool, its picker and decode sidecars iff inferencePool.enabled",
    ):
        return
    if not enabled:
        return
    (pool,) = pools
    name = f"{label} InferencePool {pool['metadata']['name']}"
    report.check(pool["apiVersion"] == POOL_API, f"{name}: {POOL_API}")
    spec = pool["spec"]
    _check_members(name, spec, docs, report)
    _check_picker_ref(name, spec, docs, pool_values, report)
    _check_picker_settings(label, docs, pickers, report)
    _check_route_key(label, pickers, sidecars, report)
    _check_http_route(label, pool, docs, pool_values, report)


def _check_members(name: str, spec: dict[str, Any], docs: list[dict[str, Any]], report: Report) -> None:
    """The pool's pods are exactly the decode pods with a sidecar, on the sidecar's port, which
    listens there; each sidecar calls the engine beside it."""
    selector = spec["selector"]["matchLabels"]
    members = [(w, t) for w, t in pod_templates(docs) if matches(selector, t["metadata"]["labels"])]
    with_sidecar = [
        (w, t) for w, t in pod_templates(docs) if any(c["name"] == "sidecar" for c in t["spec"]["containers"])
    ]
    report.check(
        bool(members)
        and [w["metadata"]["name"] for w, _ in members] == [w["metadata"]["name"] for w, _ in with_sidecar],
        f"{name}: selects exactly the pods that run a decode sidecar",
        str([w["metadata"]["name"] for w, _ in members]),
    )
    decode = [
        w["metadata"]["name"]
        for w, t in pod_templates(docs)
        if t["metadata"]["labels"].get("app.kubernetes.io/component", "").endswith("-decode")
        and any(c["name"] in ("engine", "vllm") for c in t["spec"]["containers"])
    ]
    report.check(
        sorted(decode) == sorted(w["metadata"]["name"] for w, _ in with_sidecar),
        f"{name}: every decode Deployment of the chart runs a sidecar, and no other",
    )
    target = spec["targetPorts"][0]["number"] if len(spec.get("targetPorts", [])) == 1 else None
    for workload, template in members:
        what = f"{name} member {workload['metadata']['name']}"
        sidecar = next((c for c in template["spec"]["containers"] if c["name"] == "sidecar"), None)
        engine = next((c for c in template["spec"]["containers"] if c["name"] in ("engine", "vllm")), None)
        if not report.check(
            sidecar is not None and engine is not None, f"{what}: runs an engine and a sidecar"
        ):
            continue
        assert sidecar is not None and engine is not None
        env = _env(sidecar)
        report.check(
            target in container_ports({"spec": {"containers": [sidecar]}}).values()
            and _port_of(env.get("KVPLANE_SIDECAR__LISTEN")) == target,
            f"{what}: the pool's target port {target} is the sidecar's, and it listens there",
        )
        decode_url = urlsplit(str(env.get("KVPLANE_SIDECAR__DECODE_URL", "")))
        engine_port = _engine_port(engine)
        report.check(
            decode_url.hostname == "127.0.0.1"
            and decode_url.port == engine_port
            and engine_port in container_ports({"spec": {"containers": [engine]}}).values()
            and engine_port != target,
            f"{what}: the sidecar's decode_url is the engine beside it ({decode_url.geturl()})",
        )
        report.check(_advertises_pod_ip(engine), f"{what}: the engine advertises its pod IP")


def _check_picker_ref(
    name: str, spec: dict[str, Any], docs: list[dict[str, Any]], pool_values: dict[str, Any], report: Report
) -> None:
    """endpointPickerRef names a chart Service by a port that reaches the picker's ext_proc port,
    and the picker answers D's sidecar on the pool's target port."""
    ref = spec["endpointPickerRef"]
    report.check(
        ref.get("group", "") == "" and ref.get("kind", "Service") == "Service",
        f"{name}: endpointPickerRef is a core Service",
    )
    report.check(
        ref.get("failureMode", "FailClose") == pool_values["failureMode"],
        f"{name}: failureMode is inferencePool.failureMode ({pool_values['failureMode']})",
    )
    services = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}
    service = services.get(ref.get("name", ""))
    if not report.check(
        service is not None, f"{name}: endpointPickerRef names a Service of the chart ({ref.get('name')})"
    ):
        return
    assert service is not None
    number = ref.get("port", {}).get("number")
    port = next((p for p in service["spec"]["ports"] if p["port"] == number), None)
    pickers = [
        (t, c)
        for _, t in pod_templates(docs)
        if matches(service["spec"]["selector"], t["metadata"]["labels"])
        for c in t["spec"]["containers"]
        if c["name"] == "epp"
    ]
    ok = port is not None and bool(pickers)
    for _, c in pickers:
        target = port["targetPort"] if port is not None else None
        served = container_ports({"spec": {"containers": [c]}}).get(target) if target is not None else None
        ok = ok and served is not None and served == _port_of(_env(c).get("KVPLANE_EPP__LISTEN"))
    report.check(
        ok, f"{name}: endpointPickerRef port {number} reaches the picker's ext_proc port, where it listens"
    )
    target = spec["targetPorts"][0]["number"]
    for _, c in pickers:
        report.check(
            int(_env(c).get("KVPLANE_EPP__SIDECAR_PORT") or 0) == target,
            f"{name}: the picker answers D's sidecar on the pool's target port ({target})",
        )


def _check_picker_settings(
    label: str,
    docs: list[dict[str, Any]],
    pickers: list[tuple[dict[str, Any], dict[str, Any]]],
    report: Report,
) -> None:
    """The picker is the gateway's other front: the gateway's routing replicas, cache-salt key and
    API keys (and the chart's salt Secret when the values name none)."""
    gateways = _containers(docs, "gateway")
    secrets = {d["metadata"]["name"] for d in docs if d["kind"] == "Secret"}
    for template, c in pickers:
        what = f"{label} picker {c['name']}"
        env = _env(c)
        salt = env.get("KVPLANE_GATEWAY__CACHE_SALT_KEY")
        report.check(isinstance(salt, tuple), f"{what}: reads the cache-salt key from a Secret", str(salt))
        api_keys = _volume_secret(template, "/etc/kvplane-api-keys", c)
        for g_template, g in gateways:
            g_env = _env(g)
            report.check(
                salt == g_env.get("KVPLANE_GATEWAY__CACHE_SALT_KEY"),
                f"{what}: salts with the gateway's cache-salt key",
                f"{salt} != {g_env.get('KVPLANE_GATEWAY__CACHE_SALT_KEY')}",
            )
            report.check(
                json.loads(str(env.get("KVPLANE_GATEWAY__ROUTING", "[]")))
                == json.loads(str(g_env.get("KVPLANE_GATEWAY__ROUTING", "[]"))),
                f"{what}: routes through the gateway's routing replicas",
            )
            report.check(
                api_keys == _volume_secret(g_template, "/etc/kvplane-api-keys", g)
                and env.get("KVPLANE_GATEWAY__API_KEYS_FILE") == g_env.get("KVPLANE_GATEWAY__API_KEYS_FILE"),
                f"{what}: checks the gateway's API keys",
            )
        if isinstance(salt, tuple) and salt[0].endswith("-cache-salt"):
            report.check(salt[0] in secrets, f"{what}: the chart renders its cache-salt Secret {salt[0]}")


def _check_route_key(
    label: str,
    pickers: list[tuple[dict[str, Any], dict[str, Any]]],
    sidecars: list[tuple[dict[str, Any], dict[str, Any]]],
    report: Report,
) -> None:
    """One route key, from one Secret key, for the picker and every sidecar: a sidecar with another
    key verifies no route and serves every turn as a recompute."""
    refs = {_env(c).get(ROUTE_KEY) for _, c in pickers + sidecars}
    report.check(
        len(refs) == 1 and isinstance(next(iter(refs)), tuple),
        f"{label}: the picker and every sidecar read one route key Secret",
        str(sorted(map(str, refs))),
    )


def _check_http_route(
    label: str, pool: dict[str, Any], docs: list[dict[str, Any]], pool_values: dict[str, Any], report: Report
) -> None:
    """An HTTPRoute iff a Gateway is named: its parent is that Gateway, its backends the pool."""
    routes = [d for d in docs if d["kind"] == "HTTPRoute"]
    gateway = pool_values["httpRoute"]["gateway"]
    if not report.check(
        len(routes) == int(bool(gateway["name"])),
        f"{label}: an HTTPRoute iff inferencePool.httpRoute.gateway.name",
    ):
        return
    for route in routes:
        what = f"{label} HTTPRoute {route['metadata']['name']}"
        parents = route["spec"].get("parentRefs", [])
        report.check(
            [(p.get("kind", "Gateway"), p["name"], p.get("namespace", "")) for p in parents]
            == [("Gateway", gateway["name"], gateway["namespace"])],
            f"{what}: hangs off the Gateway {gateway['name']}",
        )
        backends = [b for rule in route["spec"].get("rules", []) for b in rule.get("backendRefs", [])]
        report.check(
            bool(backends)
            and all(
                (b.get("group"), b.get("kind"), b.get("name"))
                == ("inference.networking.k8s.io", "InferencePool", pool["metadata"]["name"])
                for b in backends
            ),
            f"{what}: every backend is the InferencePool {pool['metadata']['name']}",
        )
