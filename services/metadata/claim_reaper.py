"""Releases claims nobody used: a handle checked out for a turn whose P leg
never started (the client left, the gateway died) would otherwise stay
pinned on its holder until the engine's TTL.

Every metadata replica sweeps; the release transaction is fenced on the
claim, so each claim is released once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from kvplane.services.common.model.errors import StoreUnavailable
from kvplane.services.common.store import Store

log = logging.getLogger(__name__)


class ClaimReaper:
    """A component: sweeps for unused claims every `interval_s` seconds."""

    def __init__(self, store: Store, deadline_s: float, interval_s: float) -> None:
        self.store = store
        self.deadline_ms = int(deadline_s * 1000)
        self.interval_s = interval_s
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._sweep(), name="claim-reaper")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _sweep(self) -> None:
        while True:
            try:
                released = await self.store.release_unused_claims(self.deadline_ms)
                for pending in released:
                    h = pending.handle
                    log.info(
                        "released an unused claim",
                        extra={"node": h.holder_node_id, "conversation": h.conversation, "tenant": h.tenant},
                    )
            except StoreUnavailable as exc:
                log.warning("claim reaper: %s", exc)
            await asyncio.sleep(self.interval_s)  # periodic sweep
