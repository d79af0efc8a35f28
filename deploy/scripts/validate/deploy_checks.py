"""Offline checks of kvplane's deployment artifacts, beyond what their schemas say.

    python deploy_checks.py compose RESOLVED.json     the compose stack, as `docker compose config
                                                      --format json` resolved it (all profiles)
    python deploy_checks.py dockerfile RESOLVED.json   deploy/docker/Dockerfile, and the compose
                                                      build targets in it
    python deploy_checks.py helm OUT_DIR              lint and render the chart for each values file,
                                                      validate every built-in resource against the
                                                      Kubernetes schemas, cross-check the manifests
    python deploy_checks.py mesh OUT_DIR              the Istio manifests against the chart

`helm` and `mesh` write the custom resources they found to OUT_DIR/*-crds.json, for
crd_schemas.mjs. validate_deploy.sh runs all of this; each command prints one line per check and
exits 1 if any failed.

Where possible a check runs kvplane's own code: flags go through the real argument parsers and
settings through the real settings model, so a renamed flag or setting fails here, not at start-up.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import functools
import json
import os
import re
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[3]
CHART = ROOT / "deploy" / "helm" / "kvplane"
COMPOSE_DIR = ROOT / "deploy" / "compose"
# Kubernetes versions the chart is validated against: its kubeVersion floor and the newest schemas.
KUBE_VERSIONS = ("1.29.0", "1.37.0")


class Report:
    """Collects check results; prints each as it comes."""

    def __init__(self) -> None:
        self.failures: list[str] = []
        self.passed = 0

    def check(self, ok: bool, what: str, detail: str = "") -> bool:
        if ok:
            self.passed += 1
            print(f"ok   {what}")
        else:
            self.failures.append(what)
            print(f"FAIL {what}{': ' + detail if detail else ''}")
        return ok

    def note(self, what: str) -> None:
        print(f"note {what}")

    def done(self, name: str) -> int:
        print(f"{name}: {self.passed} passed, {len(self.failures)} failed")
        return 1 if self.failures else 0


# ---------------------------------------------------------------- kvplane's own parsers


def kvplane_settings_cls() -> Any:
    from kvplane.services.common.settings import KvplaneSettings

    return KvplaneSettings


@contextlib.contextmanager
def kvplane_env(env: Mapping[str, str]) -> Iterator[None]:
    """The process environment with only `env`'s KVPLANE_* variables, as a container would see."""
    saved = {k: v for k, v in os.environ.items() if k.startswith("KVPLANE_")}
    for key in saved:
        del os.environ[key]
    os.environ.update({k: v for k, v in env.items() if k.startswith("KVPLANE_")})
    try:
        yield
    finally:
        for key in [k for k in os.environ if k.startswith("KVPLANE_")]:
            del os.environ[key]
        os.environ.update(saved)


def load_settings(env: Mapping[str, str], config_text: str | None, flags: dict[str, Any]) -> Any:
    """KvplaneSettings from a settings file's text, KVPLANE_* variables and flag overrides."""
    import tempfile

    cls = kvplane_settings_cls()
    file_values = yaml.safe_load(config_text) if config_text else {}
    unknown = unknown_settings(file_values) + unknown_settings(env_settings(env))
    if unknown:
        raise ValueError(f"unknown settings: {', '.join(unknown)}")
    env = {k: v for k, v in env.items() if k != "KVPLANE_CONFIG"}
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        yaml.safe_dump(file_values or {}, f)
        f.flush()
        with kvplane_env(env):
            return cls.load(f.name, flags)


def unknown_settings(values: Any, model: Any = None, path: str = "") -> list[str]:
    """Keys in `values` that the settings model does not have, at any depth.

    KvplaneSettings forbids unknown top-level sections, but its sections ignore unknown keys, so
    a misspelt setting would otherwise be dropped without a word.
    """
    import typing

    from pydantic import BaseModel

    model = model or kvplane_settings_cls()
    if not isinstance(values, dict):
        return []
    out = []
    for key, value in values.items():
        field = model.model_fields.get(key)
        where = f"{path}{key}"
        if field is None:
            out.append(where)
            continue
        annotation = field.annotation
        args = typing.get_args(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            out.extend(unknown_settings(value, annotation, where + "."))
        elif (
            typing.get_origin(annotation) is list
            and args
            and isinstance(args[0], type)
            and issubclass(args[0], BaseModel)
        ):
            for i, item in enumerate(value if isinstance(value, list) else []):
                out.extend(unknown_settings(item, args[0], f"{where}[{i}]."))
    return out


def env_settings(env: Mapping[str, str]) -> dict[str, Any]:
    """KVPLANE_<SECTION>__<FIELD> variables as nested keys (values unparsed)."""
    out: dict[str, Any] = {}
    for name, value in env.items():
        if not name.startswith("KVPLANE_") or name == "KVPLANE_CONFIG":
            continue
        parts = name[len("KVPLANE_") :].lower().split("__")
        node = out
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = value
    return out


def settings_has_section(name: str) -> bool:
    return name in kvplane_settings_cls().model_fields


def without_section(
    config_text: str | None, env: Mapping[str, str], section: str
) -> tuple[str, dict[str, str]]:
    values = yaml.safe_load(config_text) if config_text else {}
    values.pop(section, None)
    prefix = f"KVPLANE_{section.upper()}__"
    return yaml.safe_dump(values), {k: v for k, v in env.items() if not k.startswith(prefix)}


def parse_serve(argv: list[str]) -> tuple[argparse.Namespace, dict[str, Any]]:
    from kvplane.services import cli

    args = cli.build_parser().parse_args(argv)
    return args, cli._overrides(args)


def check_health_probe(
    name: str, command: list[str], c: dict[str, Any], ports: Mapping[str | int, int], report: Report
) -> None:
    """An exec probe running `kvplane health` (gRPC over TLS): its flags parse, it dials a port of
    its container on loopback, and the certificate files it names are mounted."""
    from kvplane.services.health_probe import build_parser

    if not report.check(command[:2] == ["kvplane", "health"], f"{name}: runs `kvplane health`", str(command)):
        return
    parser = build_parser()
    parser.exit_on_error = False
    try:
        args = parser.parse_args(command[2:])
    except (SystemExit, argparse.ArgumentError) as exc:
        report.check(False, f"{name}: `kvplane health` flags parse", repr(exc))
        return
    host, _, port = args.target.rpartition(":")
    report.check(
        host in ("localhost", "127.0.0.1", "[::1]") and port.isdigit() and int(port) in ports.values(),
        f"{name}: probes a port of its container on loopback ({args.target})",
    )
    env = {e["name"]: e.get("value") for e in c.get("env", [])}
    mounts = {m["mountPath"] for m in c.get("volumeMounts", [])}
    files = [args.tls_ca_file, args.tls_cert_file, args.tls_key_file]
    report.check(
        bool(args.tls_ca_file) and all(os.path.dirname(f) in mounts for f in files if f),
        f"{name}: the CA and certificate it presents are mounted",
    )
    # The probe's certificate is the server's own: the one the server is configured with.
    if args.tls_cert_file:
        report.check(
            env.get("KVPLANE_GRPC__TLS__CERT_FILE") == args.tls_cert_file
            and env.get("KVPLANE_GRPC__TLS__CLIENT_CA_FILE") == args.tls_ca_file,
            f"{name}: presents the server's certificate, checked by the server's client CA",
        )


def parse_sim_engine(argv: list[str]) -> Any:
    from kvplane.bench.simengine.settings import build_arg_parser, settings_from_args

    parser = build_arg_parser()
    parser.exit_on_error = False
    return settings_from_args(parser.parse_args(argv))


@functools.cache
def connector_setting_names() -> frozenset[str]:
    """Fields of ConnectorSettings, read from the source: importing it needs vLLM."""
    tree = ast.parse((ROOT / "connector" / "vllm_nixl.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == "ConnectorSettings":
            return frozenset(
                s.target.id
                for s in node.body
                if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
            )
    raise RuntimeError("ConnectorSettings not found in connector/vllm_nixl.py")


def module_file(module: str) -> Path | None:
    """Source file of a kvplane.* module, by the distribution's package-dir mapping."""
    mapping = {"kvplane.connector": "connector", "kvplane.services": "services", "kvplane.bench": "bench"}
    for prefix, directory in mapping.items():
        if module == prefix or module.startswith(prefix + "."):
            rest = module[len(prefix) :].lstrip(".").replace(".", "/")
            path = ROOT / directory / (rest + ".py" if rest else "__init__.py")
            return path if path.exists() else None
    return None


def host_port(target: str) -> tuple[str, int]:
    host, _, port = target.rpartition(":")
    return host.strip("[]"), int(port)


# ---------------------------------------------------------------- compose


def check_compose(resolved_path: Path, report: Report) -> None:
    project = json.loads(resolved_path.read_text())
    services: dict[str, Any] = project["services"]
    config_text = (COMPOSE_DIR / "kvplane.yaml").read_text()

    aliases = {
        alias: name
        for name, svc in services.items()
        for net in (svc.get("networks") or {}).values()
        for alias in ((net or {}).get("aliases") or [])
    }

    def runs(host: str) -> set[str]:
        """kvplane services that the compose service named (or aliased) `host` runs."""
        name = host if host in services else aliases.get(host, "")
        command = services.get(name, {}).get("command") or []
        if command[:1] == ["serve"]:
            return {"metadata", "routing", "eviction"} if command[1] == "all" else {command[1]}
        return set()

    def engine_services(host: str) -> list[str]:
        """Engine services (sim or vLLM) that answer to `host`, by name or alias."""
        return [
            n
            for n, svc in services.items()
            if (
                n == host
                or any(
                    host in ((net or {}).get("aliases") or []) for net in (svc.get("networks") or {}).values()
                )
            )
            and (n.startswith("sim-") or n.startswith("vllm-"))
        ]

    def engine_port(name: str) -> int:
        for arg in services[name].get("command") or []:
            if arg.startswith("--port="):
                return int(arg.split("=", 1)[1])
        return 0

    for name, svc in services.items():
        report.check(svc.get("network_mode") != "host", f"compose {name}: no host networking")
        for port in svc.get("ports", []):
            report.check(
                port.get("host_ip") == "127.0.0.1",
                f"compose {name}: port {port.get('target')} published on 127.0.0.1 only",
                f"host_ip={port.get('host_ip')!r}",
            )
        if name not in ("otel-collector", "jaeger"):  # images without a shell: see compose.yaml
            report.check(bool(svc.get("healthcheck", {}).get("test")), f"compose {name}: has a health check")
        for dep, spec in (svc.get("depends_on") or {}).items():
            # `required: false` names a service that an override may leave out (serve-all).
            if dep not in services and spec.get("required") is False:
                continue
            report.check(dep in services, f"compose {name}: depends on defined service {dep}")
            if dep in services and services[dep].get("healthcheck", {}).get("test"):
                report.check(
                    spec.get("condition") == "service_healthy",
                    f"compose {name}: waits for {dep} to be healthy",
                    f"condition={spec.get('condition')}",
                )

        image = str(svc.get("image", ""))
        command = list(svc.get("command") or [])
        env = {k: str(v) for k, v in (svc.get("environment") or {}).items() if v is not None}
        if command[:1] == ["serve"]:
            try:
                flags = parse_serve(command)[1]
                settings = load_settings(env, config_text, flags)
                ok, detail = True, ""
            except (SystemExit, Exception) as exc:  # argparse exits; pydantic raises
                ok, detail, settings = False, repr(exc), None
            report.check(
                ok, f"compose {name}: `kvplane {' '.join(command)}` parses with its settings", detail
            )
            if settings is not None:
                report.check(
                    settings.grpc.listen.startswith("0.0.0.0:")
                    and settings.telemetry.metrics_host == "0.0.0.0",
                    f"compose {name}: gRPC and metrics listen on all interfaces",
                )
                for endpoint in settings.etcd.endpoints:
                    report.check(
                        host_port(endpoint)[0] in services, f"compose {name}: etcd {endpoint} is a service"
                    )
                otlp = settings.telemetry.otlp_endpoint
                report.check(
                    host_port(otlp) == ("otel-collector", 4317), f"compose {name}: traces go to the collector"
                )
        elif command[:1] == ["gateway"]:
            text, genv = config_text, env
            if not settings_has_section("gateway"):
                report.note(
                    f"compose {name}: settings have no gateway section yet; gateway settings not checked"
                )
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
                    engines = engine_services(host)
                    report.check(
                        bool(engines) and all(url.endswith(f":{engine_port(e)}") for e in engines),
                        f"compose {name}: {url} is an engine in every profile",
                        str(engines),
                    )
                for target in g.routing:
                    report.check(
                        "routing" in runs(host_port(target)[0]),
                        f"compose {name}: routing {target} runs routing",
                    )
        elif "sim" in image or svc.get("build", {}).get("target") == "sim-engine":
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
                    "metadata" in runs(host_port(sim.control_plane)[0]),
                    f"compose {name}: control plane {sim.control_plane} runs metadata",
                )
        elif svc.get("build", {}).get("target") == "vllm-cpu":
            kv = [a.split("=", 1)[1] for a in command if a.startswith("--kv-transfer-config=")]
            if not report.check(len(kv) == 1, f"compose {name}: one --kv-transfer-config"):
                continue
            try:
                config = json.loads(kv[0])
            except json.JSONDecodeError as exc:
                report.check(False, f"compose {name}: --kv-transfer-config is JSON", str(exc))
                continue
            module = config.get("kv_connector_module_path", "")
            report.check(module_file(module) is not None, f"compose {name}: connector module {module} exists")
            section = config.get("kv_connector_extra_config", {}).get("kvplane", {})
            unknown = set(section) - connector_setting_names()
            report.check(
                not unknown, f"compose {name}: kvplane connector settings are known", str(sorted(unknown))
            )
            report.check(
                "metadata" in runs(host_port(section.get("metadata_target", ":0"))[0]),
                f"compose {name}: metadata_target runs metadata",
            )
            report.check(
                "eviction" in runs(host_port(section.get("eviction_target", ":0"))[0]),
                f"compose {name}: eviction_target runs eviction",
            )
            hostname = svc.get("hostname", name)
            report.check(
                section.get("http_url", "").startswith(f"http://{hostname}:")
                and env.get("VLLM_NIXL_SIDE_CHANNEL_HOST") == hostname,
                f"compose {name}: advertises its own name ({hostname}) for HTTP and the side channel",
            )

    # Prometheus scrapes every metrics endpoint, by service name.
    prom = yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())
    targets = {
        t for job in prom["scrape_configs"] for sc in job.get("static_configs", []) for t in sc["targets"]
    }
    for target in sorted(targets):
        host = host_port(target)[0]
        report.check(
            host in services or host in aliases or host == "127.0.0.1",
            f"prometheus target {target} is a compose service",
        )
    expected = (
        {f"{n}:9464" for n in services if runs(n) and n not in aliases.values()}
        | {f"{n}:{engine_port(n)}" for n in services if n.startswith(("sim-", "vllm-"))}
        | {"gateway:8080", "etcd:2381"}
    )
    missing = expected - targets
    report.check(
        not missing,
        "prometheus scrapes every kvplane, engine and etcd metrics endpoint",
        str(sorted(missing)),
    )

    # The collector's pipelines use only defined components, and export to a service.
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
                host_port(spec["endpoint"])[0] in services, f"otel exporter {exporter} targets a service"
            )
    grpc_endpoint = otel["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"]
    report.check(host_port(grpc_endpoint)[1] == 4317, "otel collector receives OTLP/gRPC on 4317")


# ---------------------------------------------------------------- Dockerfile


def check_dockerfile(resolved_paths: list[Path], report: Report) -> None:
    """Parse with BuildKit's parser; build targets and COPY sources exist and are in the context."""
    import dockerfile

    path = ROOT / "deploy" / "docker" / "Dockerfile"
    try:
        commands = dockerfile.parse_file(str(path))
    except dockerfile.GoParseError as exc:
        report.check(False, "Dockerfile parses (BuildKit parser)", str(exc))
        return
    report.check(True, f"Dockerfile parses (BuildKit parser): {len(commands)} instructions")
    stages = [
        c.value[2] for c in commands if c.cmd == "FROM" and len(c.value) == 3 and c.value[1].upper() == "AS"
    ]
    report.check(len(stages) == len(set(stages)), f"Dockerfile stages are distinct: {', '.join(stages)}")

    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]

    def pattern_regex(pattern: str) -> re.Pattern[str]:
        out = (
            re.escape(pattern.strip("/"))
            .replace(r"\*\*", "\0")
            .replace(r"\*", "[^/]*")
            .replace(r"\?", "[^/]")
        )
        return re.compile(out.replace("\0", ".*") + "(/.*)?")

    def in_context(rel: str) -> bool:
        """.dockerignore semantics: the last matching pattern wins, "!" re-includes. A directory
        is judged by a file inside it."""
        probe = rel + "/x.py" if (ROOT / rel).is_dir() else rel
        included = True
        for pattern in patterns:
            negate = pattern.startswith("!")
            if pattern_regex(pattern.lstrip("!")).fullmatch(probe):
                included = negate
        return included

    for c in commands:
        if c.cmd == "COPY" and not any(f.startswith("--from") for f in c.flags):
            for src in c.value[:-1]:
                report.check((ROOT / src).exists(), f"Dockerfile COPY {src}: exists")
                report.check(in_context(src), f"Dockerfile COPY {src}: not excluded by .dockerignore")
    for resolved in resolved_paths:
        for name, svc in json.loads(resolved.read_text())["services"].items():
            build = svc.get("build")
            if build:
                report.check(
                    Path(build["dockerfile"]).name == "Dockerfile" and build.get("target") in stages,
                    f"compose {name}: build target {build.get('target')} is a Dockerfile stage",
                )


# ---------------------------------------------------------------- Kubernetes manifests


def docs_of(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def pod_templates(docs: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, pod template) of every Deployment and StatefulSet."""
    return [(d, d["spec"]["template"]) for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def matches(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def container_ports(template: dict[str, Any]) -> dict[str | int, int]:
    out: dict[str | int, int] = {}
    for c in template["spec"]["containers"]:
        for p in c.get("ports", []):
            out[p["containerPort"]] = p["containerPort"]
            if "name" in p:
                out[p["name"]] = p["containerPort"]
    return out


@functools.cache
def _schema(filename: str, version: str) -> Any:

    return _ORIGINAL_SCHEMA_CONTENTS(filename, version)


_ORIGINAL_SCHEMA_CONTENTS: Any = None


def kubernetes_validate(doc: dict[str, Any], version: str) -> str:
    """'' if `doc` is valid against the strict Kubernetes schema of `version`, else the error."""
    global _ORIGINAL_SCHEMA_CONTENTS
    from kubernetes_validate import utils

    if _ORIGINAL_SCHEMA_CONTENTS is None:
        # The schemas are large and read once per call otherwise.
        _ORIGINAL_SCHEMA_CONTENTS = utils.schema_contents
        utils.schema_contents = _schema
    try:
        utils.validate(doc, version, strict=True)
    except utils.ValidationError as exc:
        path = "/".join(str(p) for p in exc.path)
        return f"{path}: {exc.message}"
    except utils.SchemaNotFoundError as exc:
        return f"no schema: {exc}"
    return ""


BUILTIN_GROUPS = ("v1", "apps/v1", "batch/v1", "policy/v1", "networking.k8s.io/v1")


def check_kubernetes_docs(label: str, docs: list[dict[str, Any]], report: Report) -> list[dict[str, Any]]:
    """Schema-validate built-in kinds; return the custom resources."""
    crds = []
    for doc in docs:
        name = f"{label} {doc['kind']} {doc['metadata']['name']}"
        if doc["apiVersion"] in BUILTIN_GROUPS:
            for version in KUBE_VERSIONS:
                error = kubernetes_validate(doc, version)
                report.check(not error, f"{name}: Kubernetes {version} schema (strict)", error)
        else:
            crds.append(doc)
    return crds


def check_chart_semantics(
    label: str, docs: list[dict[str, Any]], values: dict[str, Any], report: Report
) -> None:
    pods = pod_templates(docs)
    accounts = {d["metadata"]["name"] for d in docs if d["kind"] == "ServiceAccount"}
    engine_labels = values["engines"]["podLabels"]
    services_by_name = {d["metadata"]["name"]: d for d in docs if d["kind"] == "Service"}

    # The pods of CronJobs (etcd backups) are peers too, though no Service or PDB covers them.
    job_pods = [d["spec"]["jobTemplate"]["spec"]["template"] for d in docs if d["kind"] == "CronJob"]

    def pods_for(selector: Mapping[str, str]) -> list[dict[str, Any]]:
        templates = [t for _, t in pods] + job_pods
        return [t for t in templates if matches(selector, t["metadata"]["labels"])]

    for workload, template in pods:
        name = f"{label} {workload['kind']} {workload['metadata']['name']}"
        report.check(
            matches(workload["spec"]["selector"]["matchLabels"], template["metadata"]["labels"]),
            f"{name}: selector matches its pods",
        )
        report.check(
            template["spec"].get("serviceAccountName") in accounts, f"{name}: runs as a chart ServiceAccount"
        )
        ports = container_ports(template)
        for c in template["spec"]["containers"]:
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
            if c["name"] in ("metadata", "routing", "eviction", "gateway"):
                check_kvplane_container(name, c, env, docs, report)
            if c["name"] == "engine":
                check_sim_container(name, c, report)
            if c["name"] == "vllm":
                check_vllm_container(name, c, docs, report)
        if workload["kind"] == "StatefulSet":
            report.check(
                workload["spec"]["serviceName"] in services_by_name
                and services_by_name[workload["spec"]["serviceName"]]["spec"].get("clusterIP") == "None",
                f"{name}: has its headless Service",
            )

    for svc in services_by_name.values():
        name = f"{label} Service {svc['metadata']['name']}"
        selected = pods_for(svc["spec"]["selector"])
        if report.check(bool(selected), f"{name}: selects pods"):
            for port in svc["spec"]["ports"]:
                target = port.get("targetPort", port["port"])
                report.check(target in container_ports(selected[0]), f"{name}: targetPort {target} exists")

    for pdb in (d for d in docs if d["kind"] == "PodDisruptionBudget"):
        name = f"{label} PodDisruptionBudget {pdb['metadata']['name']}"
        owners = [
            w for w, t in pods if matches(pdb["spec"]["selector"]["matchLabels"], t["metadata"]["labels"])
        ]
        if report.check(len(owners) == 1, f"{name}: covers one workload"):
            replicas = owners[0]["spec"]["replicas"]
            if "minAvailable" in pdb["spec"]:
                report.check(
                    pdb["spec"]["minAvailable"] < replicas or replicas == 1,
                    f"{name}: leaves room for a voluntary eviction",
                    f"minAvailable={pdb['spec']['minAvailable']} replicas={replicas}",
                )

    for np in (d for d in docs if d["kind"] == "NetworkPolicy"):
        name = f"{label} NetworkPolicy {np['metadata']['name']}"
        selector = np["spec"]["podSelector"]["matchLabels"]
        external_engines = selector == engine_labels and not pods_for(selector)
        report.check(bool(pods_for(selector)) or external_engines, f"{name}: selects pods")
        for rule in np["spec"].get("ingress", []):
            for peer in rule.get("from", []):
                sel = peer.get("podSelector", {}).get("matchLabels")
                # Peers the chart itself names (values may add others, outside the chart).
                chart_peer = sel is not None and (
                    sel.get("app.kubernetes.io/name") == "kvplane" or sel == engine_labels
                )
                if chart_peer and "namespaceSelector" not in peer:
                    report.check(
                        bool(pods_for(sel)) or sel == engine_labels, f"{name}: peer {sel} selects pods"
                    )
            for port in rule.get("ports", []):
                targets = pods_for(selector)
                if targets:
                    report.check(
                        any(port["port"] in container_ports(t) for t in targets),
                        f"{name}: port {port['port']} is served",
                    )

    for sm in (d for d in docs if d["kind"] == "ServiceMonitor"):
        name = f"{label} ServiceMonitor {sm['metadata']['name']}"
        selected = [
            s
            for s in services_by_name.values()
            if matches(sm["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])
        ]
        if report.check(len(selected) >= 1, f"{name}: selects a Service"):
            names = {p.get("name") for s in selected for p in s["spec"]["ports"]}
            for ep in sm["spec"]["endpoints"]:
                report.check(ep["port"] in names, f"{name}: endpoint port {ep['port']} is a Service port")

    # The engines' NetworkPolicy lets only engines reach any port but HTTP.
    engines_np = [
        d
        for d in docs
        if d["kind"] == "NetworkPolicy" and d["spec"]["podSelector"]["matchLabels"] == engine_labels
    ]
    if values["networkPolicy"]["enabled"]:
        ok = len(engines_np) == 1
        if ok:
            for rule in engines_np[0]["spec"]["ingress"]:
                peers = rule.get("from", [])
                all_ports = "ports" not in rule
                if all_ports:
                    ok = (
                        ok
                        and all(
                            p.get("podSelector", {}).get("matchLabels") == engine_labels and len(p) == 1
                            for p in peers
                        )
                        and bool(peers)
                    )
                else:
                    ok = ok and {p["port"] for p in rule["ports"]} == {values["engines"]["httpPort"]}
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
        flags = parse_serve(args)[1] if args[:1] == ["serve"] else {}
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
            sim.http_host == "10.0.0.1" and sim.side_channel_host == "10.0.0.1",
            f"{name}: advertises its pod IP",
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
        report.check(
            endpoints[0].startswith("--endpoints=https://" if wants_tls else "--endpoints=http://")
            and ({"--cacert", "--cert", "--key"} <= flags) == wants_tls
            and (
                volumes.get("etcd-client-tls", {}).get("secret", {}).get("secretName") == tls["clientSecret"]
            )
            == wants_tls,
            f"{name}: etcdctl speaks TLS with the client certificate iff etcd.tls is on",
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

    # Values the chart must refuse.
    refusals: list[tuple[str, dict[str, Any]]] = [
        ("external etcd without endpoints", {"etcd": {"enabled": False, "external": {"endpoints": []}}}),
        ("the retired open header mode", {"auth": {"mode": "header"}}),
        ("unknown auth mode", {"auth": {"mode": "none"}}),
        ("a misspelt value", {"services": {"routing": {"replica": 2}}}),
        (
            "etcd backups over TLS without a client certificate",
            {"etcd": {"tls": {"enabled": True, "serverSecret": "s"}, "backup": {"enabled": True}}},
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
            "gRPC TLS without the gateway's Secret",
            {"grpc": {"tls": {"enabled": True, "serverSecret": "s"}}},
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


# ---------------------------------------------------------------- mesh

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
        for service in re.findall(r"^service\s+(\w+)", text, re.M):
            out.add(f"/{package.group(1) if package else ''}.{service}/*")
    return out


def check_mesh(out: Path, report: Report) -> None:
    # The chart's Istio policies (templates/mesh-policies.yaml), rendered as release "kvplane" in
    # namespace "kvplane" with every workload on, checked against that same rendering.
    chart_docs = render_chart(
        {"engines": {"sim": {"enabled": True}, "vllm": {"enabled": True}}, "mesh": {"enabled": True}},
        "kvplane",
        "kvplane",
    )
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
    headers_source = (ROOT / "services" / "common" / "headers.py").read_text()
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
    (out / "mesh-crds.json").write_text(json.dumps(docs))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    sub.add_parser("compose").add_argument("resolved", type=Path)
    sub.add_parser("dockerfile").add_argument("resolved", type=Path, nargs="*")
    sub.add_parser("helm").add_argument("out", type=Path)
    sub.add_parser("mesh").add_argument("out", type=Path)
    args = parser.parse_args(argv)
    report = Report()
    if args.what == "compose":
        check_compose(args.resolved, report)
    elif args.what == "dockerfile":
        check_dockerfile(args.resolved, report)
    elif args.what == "helm":
        check_helm(args.out, report)
    else:
        check_mesh(args.out, report)
    return report.done(args.what)


if __name__ == "__main__":
    sys.exit(main())
