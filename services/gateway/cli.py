"""`kvplane gateway`: the OpenAI-compatible front, until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence
from typing import Any

from kvplane.services.client import RoutingClient
from kvplane.services.client.credentials import PlaintextCredentials
from kvplane.services.common.runtime import event_loop
from kvplane.services.common.runtime.heap import freeze_startup_heap
from kvplane.services.common.runtime.server import BindFailed
from kvplane.services.common.runtime.telemetry import Telemetry, configure_logging
from kvplane.services.gateway.app import Gateway
from kvplane.services.gateway.colocated_routing import ColocatedRouting
from kvplane.services.gateway.local_tokenizer import TokenizerUnavailable
from kvplane.services.process import ServiceProcess
from kvplane.services.settings import KvplaneSettings
from kvplane.services.settings_errors import SettingsError

log = logging.getLogger("kvplane.gateway")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvplane gateway", description="OpenAI-compatible HTTP front of kvplane")
    p.add_argument("--config", help="YAML settings file (also KVPLANE_CONFIG); see the `gateway` section")
    p.add_argument("--listen", help="HTTP listen address, host:port ([v6]:port) (default 127.0.0.1:8080)")
    p.add_argument("--routing", help="routing replicas, host:port[,host:port] (default 127.0.0.1:50051)")
    p.add_argument(
        "--api-key",
        action="append",
        dest="api_keys",
        metavar="TENANT=KEY",
        help="a client API key and the tenant it acts as (repeatable; visible to local users in the "
        "process list: prefer --api-keys-file in production)",
    )
    p.add_argument(
        "--api-keys-file",
        help='a YAML or JSON list of {"token": ..., "tenant": ...}, read again when it changes '
        "(default: none)",
    )
    p.add_argument(
        "--routing-in-process",
        action="store_true",
        default=None,
        help="route in this process: it is a routing replica itself (etcd from --etcd, engines' "
        "streams on --grpc-listen; needs auth, as `kvplane serve` does)",
    )
    p.add_argument("--grpc-listen", help="with --routing-in-process: its gRPC listen address, host:port")
    p.add_argument("--etcd", help="with --routing-in-process: comma-separated etcd endpoints, host:port")
    p.add_argument("--routing-token-file", help="the operator token the gateway presents to routing")
    p.add_argument(
        "--fallback-prefill",
        action="append",
        help="prefill engine URLs used while routing is unreachable: url[,url] (repeatable)",
    )
    p.add_argument(
        "--fallback-decode",
        action="append",
        help="decode engine URLs used while routing is unreachable: url[,url] (repeatable)",
    )
    p.add_argument("--default-tenant", help="development only: the tenant of requests without an API key")
    p.add_argument("--tokenize-url", help="engine URL offering vLLM's /tokenize")
    p.add_argument("--model", action="append", dest="models", help="served model name (repeatable)")
    p.add_argument("--otlp-endpoint", help="OTLP/gRPC trace collector, host:port")
    p.add_argument("--event-loop", choices=("uvloop", "asyncio"), help="the event loop (default uvloop)")
    return p


def _api_key(value: str) -> dict[str, str]:
    tenant, sep, token = value.partition("=")
    if not sep or not tenant.strip() or not token.strip():
        raise SettingsError("--api-key expects TENANT=KEY, both non-empty")
    return {"tenant": tenant.strip(), "token": token.strip()}


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    gateway: dict[str, Any] = {}
    if args.listen:
        gateway["listen"] = args.listen
    if args.routing:
        gateway["routing"] = [t.strip() for t in args.routing.split(",") if t.strip()]
    for flag, key in (
        ("fallback_prefill", "fallback_prefill_url"),
        ("fallback_decode", "fallback_decode_url"),
    ):
        if getattr(args, flag) is not None:
            # Each flag may itself be comma-separated; the settings check every URL.
            gateway[key] = [u.strip() for value in getattr(args, flag) for u in value.split(",")]
    if args.api_keys:
        gateway["api_keys"] = [_api_key(value) for value in args.api_keys]
    for flag, key in (
        ("default_tenant", "default_tenant"),
        ("tokenize_url", "tokenize_url"),
        ("models", "models"),
        ("event_loop", "event_loop"),
        ("api_keys_file", "api_keys_file"),
        ("routing_token_file", "routing_token_file"),
        ("routing_in_process", "routing_in_process"),
    ):
        if getattr(args, flag) is not None:
            gateway[key] = getattr(args, flag)
    out: dict[str, Any] = {"gateway": gateway} if gateway else {}
    if args.grpc_listen:
        out["grpc"] = {"listen": args.grpc_listen}
    if args.etcd:
        out["etcd"] = {"endpoints": [e.strip() for e in args.etcd.split(",") if e.strip()]}
    if args.otlp_endpoint is not None:
        out["telemetry"] = {"otlp_endpoint": args.otlp_endpoint}
    return out


async def serve(settings: KvplaneSettings) -> None:
    """Runs the gateway until SIGINT or SIGTERM."""
    telemetry = Telemetry.create(
        "kvplane-gateway",
        otlp_endpoint=settings.telemetry.otlp_endpoint,
        sample_ratio=settings.telemetry.sample_ratio,
        trace_background=settings.telemetry.trace_background,
    )
    replica: ServiceProcess | None = None
    routing: RoutingClient | None = None
    if settings.gateway.routing_in_process:
        colocated = ColocatedRouting()
        # The gateway's /metrics serves the replica's metrics as well: no port of their own.
        quiet = settings.telemetry.model_copy(update={"metrics_port": 0})
        replica = ServiceProcess(
            settings.model_copy(update={"telemetry": quiet}),
            [colocated.install],
            telemetry,
            service_name="kvplane-gateway",
        )
        await replica.start()
        routing = colocated.client(timeout_s=settings.gateway.routing_timeout_s)
    gateway = Gateway(settings.gateway, telemetry, routing)
    try:
        await gateway.start()
    except BaseException:
        if replica is not None:
            await replica.stop()
        raise
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    freeze_startup_heap()
    # A single line that scripts and tests wait for.
    loop_name = type(loop).__module__.split(".")[0]
    print(f"kvplane gateway ready: {gateway.url} (event loop: {loop_name})", flush=True)
    try:
        await stop.wait()
    finally:
        log.info("stopping")
        await gateway.stop()
        if replica is not None:
            await replica.stop()
        telemetry.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = KvplaneSettings.load(args.config, overrides(args))
    except SettingsError as exc:
        print(f"kvplane gateway: {exc}", file=sys.stderr)
        return 2
    if settings.gateway.routing_in_process and settings.auth.mode is None:
        print(
            "kvplane gateway: routing in process serves the engines' streams, and auth.mode is "
            "required for that (token, mtls or mesh; KVPLANE_AUTH__MODE or the config file's auth "
            "section). See THREAT_MODEL.md.",
            file=sys.stderr,
        )
        return 2
    configure_logging(settings.telemetry.log_level, settings.telemetry.json_logs)
    log.info("starting", extra={"settings": settings.masked_json()})
    try:
        event_loop.run(serve(settings), settings.gateway.event_loop)
    except BindFailed as exc:
        print(f"kvplane gateway: {exc}", file=sys.stderr)
        return 1
    except (PlaintextCredentials, TokenizerUnavailable) as exc:
        print(f"kvplane gateway: {exc}", file=sys.stderr)
        return 2
    return 0
