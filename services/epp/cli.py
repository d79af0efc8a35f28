"""`kvplane epp`: the endpoint picker, until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence
from typing import Any

from kvplane.services.client.credentials import PlaintextCredentials
from kvplane.services.common.runtime import event_loop
from kvplane.services.common.runtime.heap import freeze_startup_heap
from kvplane.services.common.runtime.server import MetricsServer
from kvplane.services.common.runtime.telemetry import Telemetry, configure_logging
from kvplane.services.epp.app import Picker
from kvplane.services.gateway.local_tokenizer import TokenizerUnavailable
from kvplane.services.settings import KvplaneSettings

log = logging.getLogger("kvplane.epp")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvplane epp", description="kvplane as a Gateway API Inference Extension endpoint picker"
    )
    p.add_argument(
        "--config", help="YAML settings file (also KVPLANE_CONFIG): the epp, sidecar and gateway sections"
    )
    p.add_argument("--listen", help="ext_proc gRPC listen address, host:port (default 127.0.0.1:9002)")
    p.add_argument("--routing", help="routing replicas, host:port[,host:port]")
    p.add_argument("--sidecar-port", type=int, help="the decode sidecars' port (default 8000)")
    return p


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if args.listen:
        out.setdefault("epp", {})["listen"] = args.listen
    if args.sidecar_port is not None:
        out.setdefault("epp", {})["sidecar_port"] = args.sidecar_port
    if args.routing:
        out["gateway"] = {"routing": [t.strip() for t in args.routing.split(",") if t.strip()]}
    return out


async def serve(settings: KvplaneSettings) -> None:
    telemetry = Telemetry.create(
        "kvplane-epp",
        otlp_endpoint=settings.telemetry.otlp_endpoint,
        sample_ratio=settings.telemetry.sample_ratio,
        trace_background=settings.telemetry.trace_background,
    )
    picker = Picker(settings.epp, settings.gateway, settings.sidecar, telemetry)
    metrics = None
    if settings.telemetry.metrics_port > 0:
        metrics = MetricsServer(telemetry, settings.telemetry.metrics_host, settings.telemetry.metrics_port)
        metrics.start()
    await picker.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    freeze_startup_heap()
    # A single line that scripts and tests wait for.
    print(f"kvplane epp ready: {picker.address}", flush=True)
    try:
        await stop.wait()
    finally:
        log.info("stopping")
        await picker.stop()
        if metrics is not None:
            metrics.stop()
        telemetry.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = KvplaneSettings.load(args.config, overrides(args))
    configure_logging(settings.telemetry.log_level, settings.telemetry.json_logs)
    log.info("starting", extra={"settings": settings.masked_json()})
    try:
        # The gateway's loop (`gateway.event_loop`): the picker runs the gateway's turn code.
        event_loop.run(serve(settings), settings.gateway.event_loop)
    except (PlaintextCredentials, TokenizerUnavailable) as exc:
        print(f"kvplane epp: {exc}", file=sys.stderr)
        return 2
    return 0
