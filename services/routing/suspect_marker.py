"""Marking nodes suspect for every replica: a gateway's report of a failed leg.

`SuspectMarker` writes the mark in the background, so that the route that
reported the failure never waits on etcd. Which nodes a route then leaves out
is `state.suspects.usable_nodes`, pure.
"""

from __future__ import annotations

import asyncio
import logging

from kvplane.services.common.model.errors import KvplaneError
from kvplane.services.common.model.suspects import NodeSuspect
from kvplane.services.common.store import Store

log = logging.getLogger(__name__)

# The longest a mark stands without proof either way, seconds. A dead node's
# registration lapses before this (its lease is shorter); a live one proves
# itself with its next load report, well within it.
SUSPECT_TTL_S = 30
# Marks of one node closer together than this are one failure, ms.
_REMARK_AFTER_MS = 1000
# How many node ids one Route may name as failed.
MAX_FAILED_NODES = 8


class SuspectMarker:
    """Marks nodes suspect in etcd, one background write per failure."""

    def __init__(self, store: Store, ttl_s: int = SUSPECT_TTL_S) -> None:
        self.store = store
        self.ttl_s = ttl_s
        self._last_mark_ms: dict[tuple[str, str], int] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def mark(self, suspect: NodeSuspect) -> None:
        key = (suspect.node_id, suspect.incarnation)
        last = self._last_mark_ms.get(key, 0)
        if suspect.marked_unix_ms - last < _REMARK_AFTER_MS:
            return
        self._last_mark_ms[key] = suspect.marked_unix_ms
        if len(self._last_mark_ms) > 4096:
            # Old incarnations: only the newest marks matter for de-duplication.
            for stale in sorted(self._last_mark_ms, key=self._last_mark_ms.__getitem__)[:2048]:
                del self._last_mark_ms[stale]
        task = asyncio.create_task(self._write(suspect))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _write(self, suspect: NodeSuspect) -> None:
        try:
            await self.store.mark_suspect(suspect, self.ttl_s)
            log.warning("node %s marked suspect: %s", suspect.node_id, suspect.reason)
        except KvplaneError as exc:
            # The turn's own retry already avoids the node; other replicas learn of it later.
            log.warning("could not mark node %s suspect: %s", suspect.node_id, exc)
