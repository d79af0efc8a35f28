"""The `kvplane` command."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence
from importlib import metadata
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the serving stack loads only for `serve`: `--help` and `--version` stay fast
    from kvplane.services.process import Installer
    from kvplane.services.settings import KvplaneSettings

log = logging.getLogger("kvplane")

# Each service module exposes `install(ctx)`; `serve all` installs them all.
SERVICES = {
    "metadata": "kvplane.services.metadata.app",
    "routing": "kvplane.services.routing.app",
    "eviction": "kvplane.services.eviction.app",
}


def installers(names: Sequence[str]) -> list[Installer]:
    out = []
    for name in names:
        module = importlib.import_module(SERVICES[name])
        out.append(module.install)
    return out


def _service_names(value: str) -> list[str]:
    """`serve`'s argument: `all`, or service names joined by commas, each once."""
    names = [name.strip() for name in value.split(",")]
    if names == ["all"]:
        return names
    unknown = [name for name in names if name not in SERVICES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown service {unknown[0]!r}: choose from {', '.join(SERVICES)} (joined by commas), or all"
        )
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{value!r} names a service twice")
    return names


def available_services() -> list[str]:
    found = []
    for name, module in SERVICES.items():
        try:
            importlib.import_module(module)
        except ModuleNotFoundError:
            continue
        found.append(name)
    return found


def service_name(names: Sequence[str]) -> str:
    """OpenTelemetry's `service.name` of a process serving `names`: one per service, or the bundle."""
    return f"kvplane-{names[0]}" if len(names) == 1 else "kvplane-control-plane"


def _overrides(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if args.listen:
        out.setdefault("grpc", {})["listen"] = args.listen
    if args.etcd:
        out.setdefault("etcd", {})["endpoints"] = [e.strip() for e in args.etcd.split(",") if e.strip()]
    if args.metrics_port is not None:
        out.setdefault("telemetry", {})["metrics_port"] = args.metrics_port
    if args.otlp_endpoint is not None:
        out.setdefault("telemetry", {})["otlp_endpoint"] = args.otlp_endpoint
    return out


# What each command is for, in `kvplane --help`; a command without an entry says where its help is.
COMMAND_PURPOSES: dict[str, str] = {
    "serve": "run the control plane: metadata, routing, eviction, or `all` three in one process",
    "sim-engine": "one simulated vLLM engine: OpenAI API, real NIXL transfers, registers with kvplane",
    "sim-engine-tokenizer": "write the sim-engine's tokenizer as Hugging Face files (gateway.tokenizers)",
    "gateway": "the OpenAI-compatible front: Route, prefill leg, streamed decode leg, ReportTurn",
    "epp": "a Gateway API Inference Extension endpoint picker: Envoy ext_proc, kvplane's routing",
    "sidecar": "beside a decode engine: the P leg the picker's signed route names, then the local D leg",
    "dev-stack": "etcd, `serve all`, two sim-engines and the gateway on loopback, then a demo (make run)",
    "bench": "live benchmark through a gateway (--start-stack starts one) against the engines directly",
    "sim": "replay a trace or a workload through routing and retention policies in the simulator",
    "health": "exit 0 when a kvplane gRPC server serves, over TLS or mTLS (Kubernetes exec probes)",
    "nodes": "list registered engines, their state and latest load (operator)",
    "handles": "list retained KV handles: whose, where, how much, until when (operator)",
    "drain": "mark a node draining: no new turns go to it (operator)",
    "status": "the eviction leader, its command backlog, and the nodes by role (operator)",
    "end-conversation": "end a conversation: its retained KV is released now (operator)",
    "etcd-setup": "prepare an etcd for kvplane: a user per process, its prefix alone, auth on (root)",
    "dev-certs": "write a CA, etcd's certificate and one client certificate per etcd user (development)",
    "dev-tokens": "write fresh control-plane tokens, API keys and a cache-salt key (development, compose)",
}

_EPILOG = """\
Settings, later ones winning: defaults, a YAML file (--config or KVPLANE_CONFIG), KVPLANE_*
variables (KVPLANE_ETCD__ENDPOINTS='["h:2379"]'), then flags. Tracing follows OpenTelemetry's
variables (OTEL_EXPORTER_OTLP_ENDPOINT, OTEL_SERVICE_NAME, OTEL_TRACES_SAMPLER, ...).
`kvplane COMMAND --help` describes each command's options and their defaults."""


def _version() -> str:
    try:
        return metadata.version("kvplane")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvplane",
        description="KV-cache reuse control plane for disaggregated vLLM",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kvplane {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser(
        "serve",
        help=COMMAND_PURPOSES["serve"],
        description=COMMAND_PURPOSES["serve"],
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    serve.add_argument(
        "service",
        type=_service_names,
        metavar="SERVICE",
        help=f"{', '.join(SERVICES)}, several joined by commas (metadata,eviction), or all",
    )
    serve.add_argument("--config", help="YAML settings file (also KVPLANE_CONFIG)")
    serve.add_argument("--listen", help="gRPC listen address, host:port (default 127.0.0.1:50051)")
    serve.add_argument("--etcd", help="comma-separated etcd endpoints, host:port (default 127.0.0.1:2379)")
    serve.add_argument(
        "--metrics-port", type=int, help="Prometheus port on 127.0.0.1; 0 disables (default 9464)"
    )
    serve.add_argument(
        "--otlp-endpoint",
        help="OTLP/gRPC trace collector, host:port (default: OTEL_EXPORTER_OTLP_ENDPOINT, else none)",
    )
    for name, target in EXTRA_COMMANDS.items():
        purpose = COMMAND_PURPOSES.get(name, f"see `kvplane {name} --help`")
        sub.add_parser(name, help=purpose, add_help=False).set_defaults(extra=target)
    return parser


# Commands implemented elsewhere, which parse their own arguments.
EXTRA_COMMANDS: dict[str, str] = {
    "sim-engine": "kvplane.connector.simengine.command:main",
    "sim-engine-tokenizer": "kvplane.connector.simengine.hf_tokenizer:main",
    "gateway": "kvplane.services.gateway.cli:main",
    "epp": "kvplane.services.epp.cli:main",
    "sidecar": "kvplane.services.sidecar.cli:main",
    "dev-stack": "kvplane.services.devstack.cli:main",
    "bench": "kvplane.bench.live:main",
    "sim": "kvplane.bench.sim.command:main",
    "health": "kvplane.services.health_probe:main",
    "nodes": "kvplane.services.ops.cli:nodes_main",
    "handles": "kvplane.services.ops.cli:handles_main",
    "drain": "kvplane.services.ops.cli:drain_main",
    "status": "kvplane.services.ops.cli:status_main",
    "end-conversation": "kvplane.services.ops.cli:end_conversation_main",
    "etcd-setup": "kvplane.services.etcd_access.cli:etcd_setup_main",
    "dev-certs": "kvplane.services.etcd_access.cli:dev_certs_main",
    "dev-tokens": "kvplane.services.dev.tokens_cli:main",
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in EXTRA_COMMANDS:
        module_name, func = EXTRA_COMMANDS[argv[0]].split(":")
        entry: Any = getattr(importlib.import_module(module_name), func)
        return int(entry(argv[1:]) or 0)
    args = build_parser().parse_args(argv)
    from kvplane.services.common.runtime.telemetry import configure_logging
    from kvplane.services.settings import KvplaneSettings
    from kvplane.services.settings_errors import SettingsError

    try:
        settings = KvplaneSettings.load(args.config, _overrides(args))
    except SettingsError as exc:
        print(f"kvplane serve: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.telemetry.log_level, settings.telemetry.json_logs)
    if settings.auth.mode is None:
        # Closed by default: there is no mode that serves without credentials.
        print(
            "kvplane serve: auth.mode is required (token, mtls or mesh; KVPLANE_AUTH__MODE or the "
            "config file's auth section). See THREAT_MODEL.md.",
            file=sys.stderr,
        )
        return 2
    names = available_services() if args.service == ["all"] else args.service
    log.info("starting", extra={"services": names, "settings": settings.masked_json()})
    from kvplane.services.common.runtime import event_loop
    from kvplane.services.common.runtime.server import BindFailed

    try:
        event_loop.run(_serve(settings, names), settings.grpc.event_loop)
    except BindFailed as exc:
        print(f"kvplane serve: {exc}", file=sys.stderr)
        return 1
    return 0


async def _serve(settings: KvplaneSettings, names: Sequence[str]) -> None:
    from kvplane.services.process import ServiceProcess

    # grpc.aio objects bind to the running loop, so build the process inside it.
    process = ServiceProcess(settings, installers(names), service_name=service_name(names))
    await process.run_until_signalled()


if __name__ == "__main__":
    sys.exit(main())
