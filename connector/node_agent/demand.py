"""The engine's KV demand, sent on the eviction command stream: at once when the engine calls
`notify_demand()`, after every (re)connect, and again every `demand_refresh_s` while it lasts.

`demand_fn()` is the blocks the engine's waiting requests need beyond its free blocks and the
blocks it is already freeing. Acks and demand share one ordered stream, so a demand report sent
after an ack already counts the release acknowledged. Runs on the agent's thread, but for
`notify`, which any thread may call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from kvplane.connector.node_agent.control_plane import ControlPlane
from kvplane.connector.node_agent.wake import ThreadWake
from kvplane.v1 import eviction_pb2

log = logging.getLogger(__name__)


class DemandReporter:
    """Puts `demand_fn()` on the command stream while the stream is open."""

    def __init__(self, plane: ControlPlane, demand_fn: Callable[[], int]) -> None:
        self._plane = plane
        # Called on the agent's thread: thread-safe, quick, never blocking.
        self._demand_fn = demand_fn
        self.reports = 0
        self._wake = ThreadWake()

    def attach(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """The agent's loop started (or, with None, stopped)."""
        self._wake.attach(loop)

    def notify(self) -> None:
        """The engine's demand changed: send it now. Never blocks; any thread."""
        self._wake.set()

    async def send(self, out: asyncio.Queue[eviction_pb2.CommandsRequest | None]) -> None:
        """Puts the engine's demand on the stream: on change, on connect, and while it lasts."""
        wake = self._wake.event
        assert wake is not None
        last = 0
        while True:
            try:
                blocks = max(0, int(self._demand_fn()))
            except Exception:
                log.exception("demand_fn failed; no demand reported")
                blocks = 0
            # Zero is sent once, when a demand ends; a lasting demand is repeated.
            if blocks or last:
                await out.put(
                    eviction_pb2.CommandsRequest(
                        demand=eviction_pb2.KvDemand(blocks=blocks, measured_unix_ms=int(time.time() * 1000))
                    )
                )
                self.reports += 1
            last = blocks
            wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._plane.settings.demand_refresh_s):
                    await wake.wait()
