"""python -m kvplane.bench.simengine [flags]: one simulated engine, until SIGINT or SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal

from kvplane.bench.simengine.app import serve
from kvplane.bench.simengine.settings import parse_settings


async def _main() -> None:
    settings = parse_settings()
    task = asyncio.create_task(serve(settings))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    with contextlib.suppress(asyncio.CancelledError):
        await task


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_main())
