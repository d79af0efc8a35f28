"""`kvplane sim-engine` (also `python -m kvplane.connector.simengine`): one simulated vLLM engine."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Sequence

from kvplane.connector.simengine.app import serve
from kvplane.connector.simengine.settings import parse_settings
from kvplane.services.client.credentials import PlaintextCredentials
from kvplane.services.common.runtime.telemetry import configure_logging


def main(argv: Sequence[str]) -> int:
    """Runs one simulated vLLM engine until SIGINT or SIGTERM."""
    settings = parse_settings(argv)
    configure_logging("info", json_logs=True)

    async def run() -> None:
        task = asyncio.create_task(serve(settings))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await task

    try:
        asyncio.run(run())
    except PlaintextCredentials as exc:
        print(f"kvplane sim-engine: {exc}", file=sys.stderr)
        return 2
    return 0
