"""The compose stack, as `docker compose config --format json` resolved it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from .compose_credentials import check_credentials
from .kvplane_code import (
    connector_setting_names,
    host_port,
    load_settings,
    module_file,
    parse_serve,
    parse_sim_engine,
    settings_has_section,
    without_section,
)
from .report import COMPOSE_DIR, Report


class Stack:
    """The resolved services, and what runs behind a host name."""

    def __init__(self, services: dict[str, Any]) -> None:
        self.services = services
        self.aliases = {
            alias: name
            for name, svc in services.items()
            for net in (svc.get("networks") or {}).values()
            for alias in ((net or {}).get("aliases") or [])
        }

    def runs(self, host: str) -> set[str]:
        """kvplane services that the compose service named (or aliased) `host` runs."""
        name = host if host in self.services else self.aliases.get(host, "")
        command = self.services.get(name, {}).get("command") or []
        if command[:1] == ["serve"]:
            return {"metadata", "routing", "eviction"} if command[1] == "all" else {command[1]}
        return set()

    def engine_services(self, host: str) -> list[str]:
        """Engine services (sim or vLLM) that answer to `host`, by name or alias."""
        return [
            n
            for n, svc in self.services.items()
            if (
                n == host
                or any(
                    host in ((net or {}).get("aliases") or []) for net in (svc.get("networks") or {}).values()
                )
            )
            and (n.startswith("sim-") or n.startswith("vllm-"))
        ]

    def engine_port(self, name: str) -> int:
        for arg in self.services[name].get("command") or []:
            if arg.startswith("--port="):
                return int(arg.split("=", 1)[1])
        return 0


def check_compose(resolved_path: Path, report: Report) -> None:
    project = json.loads(resolved_path.read_text())
    stack = Stack(project["services"])
    config_text = (COMPOSE_DIR / "kvplane.yaml").read_text()
    for name, svc in stack.services.items():
        _check_wiring(stack, name, svc, report)
        image = str(svc.get("image", ""))
        command = list(svc.get("command") or [])
        env = {k: str(v) for k, v in (svc.get("environment") or {}).items() if v is not None}
        if command[:1] == ["serve"]:
            _check_serve(stack, name, command, env, config_text, report)
        elif command[:1] == ["gateway"]:
            _check_gateway(stack, name, env, config_text, report)
        elif "sim" in image or svc.get("build", {}).get("target") == "sim-engine":
            _check_sim_engine(stack, name, svc, command, report)
        elif svc.get("build", {}).get("target") == "vllm-cpu":
            _check_vllm(stack, name, svc, command, env, report)
    _check_prometheus(stack, report)
    _check_collector(stack, report)
    check_credentials(stack.services, config_text, report)


def one_shot(svc: dict[str, Any]) -> bool:
    """A service that runs once and exits (a credentials writer, etcd's setup): no health check;
    what needs it waits for it to complete."""
    return str(svc.get("restart", "")) == "no"


def _check_wiring(stack: Stack, name: str, svc: dict[str, Any], report: Report) -> None:
    """Host networking, published ports, health checks and what the service waits for."""
    services = stack.services
    report.check(svc.get("network_mode") != "host", f"compose {name}: no host networking")
    for port in svc.get("ports", []):
        report.check(
            port.get("host_ip") == "127.0.0.1",
            f"compose {name}: port {port.get('target')} published on 127.0.0.1 only",
            f"host_ip={port.get('host_ip')!r}",
        )
    if name not in ("otel-collector", "jaeger") and not one_shot(svc):  # no shell; or no server
        test = svc.get("healthcheck", {}).get("test")
        report.check(bool(test), f"compose {name}: has a health check")
        # Podman's Docker API splits a CMD's arguments at spaces: inline code breaks there.
        report.check(
            isinstance(test, list) and test[:1] == ["CMD"] and not any(" " in str(a) for a in test[1:]),
            f"compose {name}: health check is one argument list without spaces (no inline code)",
            str(test),
        )
    for dep, spec in (svc.get("depends_on") or {}).items():
        # `required: false` names a service that an override may leave out (serve-all).
        if dep not in services and spec.get("required") is False:
            continue
        report.check(dep in services, f"compose {name}: depends on defined service {dep}")
        if dep in services and one_shot(svc):
            # podman starts a stopped dependency's dependencies with it, and podman 4.3 fails to
            # when one of them is running: a one-shot service waits for one-shot services only.
            report.check(
                one_shot(services[dep]),
                f"compose {name}: a one-shot service waits for one-shot services only ({dep})",
            )
        if dep in services and one_shot(services[dep]):
            report.check(
                spec.get("condition") == "service_completed_successfully",
                f"compose {name}: waits for {dep} to complete",
                f"condition={spec.get('condition')}",
            )
        elif dep in services and services[dep].get("healthcheck", {}).get("test"):
            report.check(
                spec.get("condition") == "service_healthy",
                f"compose {name}: waits for {dep} to be healthy",
                f"condition={spec.get('condition')}",
            )


def _check_serve(
    stack: Stack, name: str, command: list[str], env: dict[str, str], config_text: str, report: Report
) -> None:
    """A `kvplane serve` service: its flags and settings parse, and its addresses are services."""
    try:
        flags = parse_serve(command)[1]
        settings = load_settings(env, config_text, flags)
        ok, detail = True, ""
    except (SystemExit, Exception) as exc:  # argparse exits; pydantic raises
        ok, detail, settings = False, repr(exc), None
    report.check(ok, f"compose {name}: `kvplane {' '.join(command)}` parses with its settings", detail)
    if settings is not None:
        report.check(
            settings.grpc.listen.startswith("0.0.0.0:") and settings.telemetry.metrics_host == "0.0.0.0",
            f"compose {name}: gRPC and metrics listen on all interfaces",
        )
        for endpoint in settings.etcd.endpoints:
            report.check(
                host_port(endpoint)[0] in stack.services, f"compose {name}: etcd {endpoint} is a service"
            )
        otlp = settings.telemetry.otlp_endpoint
        report.check(
            host_port(otlp) == ("otel-collector", 4317), f"compose {name}: traces go to the collector"
        )


def _check_gateway(stack: Stack, name: str, env: dict[str, str], config_text: str, report: Report) -> None:
    """The gateway: its settings load, its engines and routing are services that run them."""
    text, genv = config_text, env
    if not settings_has_section("gateway"):
        report.note(f"compose {name}: settings have no gateway section yet; gateway settings not checked")
        text, genv = without_section(config_text, env, "gateway")
    try:
        settings = load_settings(genv, text, {})
        ok, detail = True, ""
    except Exception as exc:
        ok, detail, settings = False, repr(exc), None
    report.check(ok, f"compose {name}: gateway settings load", detail)
    if settings is not None and settings_has_section("gateway"):
        g = settings.gateway
        for url in (g.tokenize_url, *g.fallback_prefill_url, *g.fallback_decode_url):
            host = url.split("//", 1)[-1].split(":", 1)[0]
            engines = stack.engine_services(host)
            report.check(
                bool(engines) and all(url.endswith(f":{stack.engine_port(e)}") for e in engines),
                f"compose {name}: {url} is an engine in every profile",
                str(engines),
            )
        for target in g.routing:
            report.check(
                "routing" in stack.runs(host_port(target)[0]),
                f"compose {name}: routing {target} runs routing",
            )


def _check_sim_engine(
    stack: Stack, name: str, svc: dict[str, Any], command: list[str], report: Report
) -> None:
    """A sim-engine: its flags parse, it advertises its own name, its control plane runs metadata."""
    try:
        sim = parse_sim_engine(command)
        ok, detail = True, ""
    except (SystemExit, Exception) as exc:
        ok, detail, sim = False, repr(exc), None
    report.check(ok, f"compose {name}: `kvplane sim-engine` flags parse", detail)
    if sim is not None:
        hostname = svc.get("hostname", name)
        report.check(
            sim.http_host == hostname and sim.side_channel_host == hostname,
            f"compose {name}: binds and advertises its own name ({hostname})",
            f"http_host={sim.http_host} side_channel_host={sim.side_channel_host}",
        )
        report.check(
            "metadata" in stack.runs(host_port(sim.control_plane)[0]),
            f"compose {name}: control plane {sim.control_plane} runs metadata",
        )


def _check_vllm(
    stack: Stack, name: str, svc: dict[str, Any], command: list[str], env: dict[str, str], report: Report
) -> None:
    """A vLLM engine: its --kv-transfer-config names the connector, known settings, real services."""
    kv = [a.split("=", 1)[1] for a in command if a.startswith("--kv-transfer-config=")]
    if not report.check(len(kv) == 1, f"compose {name}: one --kv-transfer-config"):
        return
    try:
        config = json.loads(kv[0])
    except json.JSONDecodeError as exc:
        report.check(False, f"compose {name}: --kv-transfer-config is JSON", str(exc))
        return
    module = config.get("kv_connector_module_path", "")
    report.check(module_file(module) is not None, f"compose {name}: connector module {module} exists")
    section = config.get("kv_connector_extra_config", {}).get("kvplane", {})
    unknown = set(section) - connector_setting_names()
    report.check(not unknown, f"compose {name}: kvplane connector settings are known", str(sorted(unknown)))
    report.check(
        "metadata" in stack.runs(host_port(section.get("metadata_target", ":0"))[0]),
        f"compose {name}: metadata_target runs metadata",
    )
    report.check(
        "eviction" in stack.runs(host_port(section.get("eviction_target", ":0"))[0]),
        f"compose {name}: eviction_target runs eviction",
    )
    hostname = svc.get("hostname", name)
    report.check(
        section.get("http_url", "").startswith(f"http://{hostname}:")
        and env.get("VLLM_NIXL_SIDE_CHANNEL_HOST") == hostname,
        f"compose {name}: advertises its own name ({hostname}) for HTTP and the side channel",
    )


def _check_prometheus(stack: Stack, report: Report) -> None:
    """Prometheus scrapes every metrics endpoint, by service name."""
    prom = yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())
    targets = {
        t for job in prom["scrape_configs"] for sc in job.get("static_configs", []) for t in sc["targets"]
    }
    for target in sorted(targets):
        host = host_port(target)[0]
        report.check(
            host in stack.services or host in stack.aliases or host == "127.0.0.1",
            f"prometheus target {target} is a compose service",
        )
    expected = (
        {f"{n}:9464" for n in stack.services if stack.runs(n) and n not in stack.aliases.values()}
        | {f"{n}:{stack.engine_port(n)}" for n in stack.services if n.startswith(("sim-", "vllm-"))}
        | {"gateway:8080", "etcd:2381"}
    )
    missing = expected - targets
    report.check(
        not missing,
        "prometheus scrapes every kvplane, engine and etcd metrics endpoint",
        str(sorted(missing)),
    )


def _check_collector(stack: Stack, report: Report) -> None:
    """The collector's pipelines use only defined components, and export to a service."""
    otel = yaml.safe_load((COMPOSE_DIR / "otel-collector.yaml").read_text())
    for pipeline, spec in otel["service"]["pipelines"].items():
        for kind in ("receivers", "processors", "exporters"):
            for component in spec.get(kind, []):
                report.check(
                    component in otel.get(kind, {}),
                    f"otel pipeline {pipeline}: {kind[:-1]} {component} defined",
                )
    for exporter, spec in otel["exporters"].items():
        if "endpoint" in spec:
            report.check(
                host_port(spec["endpoint"])[0] in stack.services,
                f"otel exporter {exporter} targets a service",
            )
    grpc_endpoint = otel["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    report.check(host_port(grpc_endpoint)[1] == 4317, "otel collector receives OTLP/gRPC on 4317")
