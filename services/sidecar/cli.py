"""`kvplane sidecar`: the decode-side sidecar, until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
from collections.abc import Sequence
from typing import Any

from kvplane.services.common.runtime import event_loop
from kvplane.services.common.runtime.heap import freeze_startup_heap
from kvplane.services.common.runtime.telemetry import Telemetry, configure_logging
from kvplane.services.settings import KvplaneSettings
from kvplane.services.sidecar.app import Sidecar

log = logging.getLogger("kvplane.sidecar")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvplane sidecar", description="kvplane's decode-side sidecar (llm-d's P/D contract)"
    )
    p.add_argument("--config", help="YAML settings file (also KVPLANE_CONFIG): the sidecar section")
    p.add_argument("--listen", help="HTTP listen address, host:port (default 127.0.0.1:8000)")
    p.add_argument(
        "--decode-url", help="the decode engine beside the sidecar (default http://127.0.0.1:8200)"
    )
    return p


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    sidecar: dict[str, Any] = {}
    if args.listen:
        sidecar["listen"] = args.listen
    if args.decode_url:
        sidecar["decode_url"] = args.decode_url
    return {"sidecar": sidecar} if sidecar else {}


async def serve(settings: KvplaneSettings) -> None:
    telemetry = Telemetry.create(
        "kvplane-sidecar",
        otlp_endpoint=settings.telemetry.otlp_endpoint,
        sample_ratio=settings.telemetry.sample_ratio,
        trace_background=settings.telemetry.trace_background,
    )
    sidecar = Sidecar(settings.sidecar, settings.gateway, telemetry)
    await sidecar.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    freeze_startup_heap()
    print(f"kvplane sidecar ready: {sidecar.address}", flush=True)
    try:
        await stop.wait()
    finally:
        log.info("stopping")
        await sidecar.stop()
        telemetry.shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = KvplaneSettings.load(args.config, overrides(args))
    configure_logging(settings.telemetry.log_level, settings.telemetry.json_logs)
    if not settings.sidecar.route_key.get_secret_value():
        log.warning("sidecar.route_key is not set: no route verifies, every turn is served by D alone")
    log.info("starting", extra={"settings": settings.masked_json()})
    # The gateway's loop (`gateway.event_loop`): the sidecar relays D's stream as the gateway does.
    event_loop.run(serve(settings), settings.gateway.event_loop)
    return 0
