"""Carries out policy decisions: one fenced release transaction each.

The transaction (`Store.release`) succeeds only if the handle is still the
retained one the leader saw; it deletes the handle and queues the node's
command in one step. A handle checked out meanwhile makes it fail, and the
decision is dropped: a checked-out handle is never released early.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from kvplane.services.common.cluster_view import ClusterView
from kvplane.services.common.errors import HandleNotRetained, NotFound, StoreUnavailable
from kvplane.services.common.handles import PendingRelease
from kvplane.services.common.store import Store, now_ms
from kvplane.services.common.telemetry import Telemetry
from kvplane.services.eviction.election import Term
from kvplane.services.eviction.metrics import EvictionMetrics
from kvplane.services.eviction.policy import Release

log = logging.getLogger(__name__)

# How long releases are remembered against lagging load reports, ms.
_FREED_MEMORY_MS = 120_000


@dataclass(frozen=True, slots=True)
class ReleaseOutcome:
    released: int
    conflicts: int
    stale: int
    failed: int


class Releaser:
    def __init__(
        self,
        store: Store,
        view: ClusterView,
        metrics: EvictionMetrics,
        telemetry: Telemetry,
        concurrency: int,
    ) -> None:
        self.store = store
        self.view = view
        self.metrics = metrics
        self.telemetry = telemetry
        self._limit = asyncio.Semaphore(concurrency)
        # Handles released whose deletion the view has not shown yet: not
        # decided upon again meanwhile.
        self.recent: dict[tuple[str, str], str] = {}
        # (when, bytes) of recent releases per node: a node's load report
        # lags them, and must not be read as if they had not happened.
        self._freed: dict[str, deque[tuple[int, int]]] = defaultdict(deque)

    def freed_since(self, node_id: str, since_unix_ms: int) -> int:
        """Bytes released on `node_id` after `since_unix_ms` (a load report's time)."""
        entries = self._freed.get(node_id)
        if not entries:
            return 0
        horizon = now_ms() - _FREED_MEMORY_MS
        while entries and entries[0][0] < horizon:
            entries.popleft()
        return sum(b for t, b in entries if t > since_unix_ms)

    def prune(self) -> None:
        for key, handle_id in list(self.recent.items()):
            record = self.view.handle(*key)
            if record is None or record.handle.handle_id != handle_id:
                del self.recent[key]

    async def apply(self, releases: Sequence[Release], term: Term) -> ReleaseOutcome:
        results = await asyncio.gather(*(self._one(r, term) for r in releases))
        return ReleaseOutcome(
            released=results.count("released"),
            conflicts=results.count("conflict"),
            stale=results.count("stale"),
            failed=results.count("failed"),
        )

    async def _one(self, release: Release, term: Term) -> str:
        async with self._limit:
            if not term.active:
                return "stale"  # leadership ended: the successor decides afresh
            record = self.view.handle(release.tenant, release.conversation)
            if record is None or record.handle.handle_id != release.handle_id:
                return "stale"
            attrs = {
                "kvplane.release.reason": release.reason.value,
                "kvplane.release.policy": release.policy,
                "kvplane.node": release.node_id,
                "kvplane.handle_id": release.handle_id,
            }
            with self.telemetry.tracer.start_as_current_span("eviction.release", attributes=attrs) as span:
                try:
                    pending = await self.store.release(
                        release.tenant,
                        release.conversation,
                        release.reason,
                        handle_id=release.handle_id,
                        expected=record,
                    )
                except (HandleNotRetained, NotFound):
                    span.set_attribute("kvplane.release.outcome", "conflict")
                    self.metrics.release_conflicts.labels(release.reason.value).inc()
                    return "conflict"
                except StoreUnavailable as exc:
                    span.set_attribute("kvplane.release.outcome", "failed")
                    log.warning("release failed: %s", exc, extra={"handle_id": release.handle_id})
                    return "failed"
                span.set_attribute("kvplane.release.outcome", "released")
                span.set_attribute("kvplane.command_id", pending.command_id)
            self.recent[release.key] = release.handle_id
            self._freed[release.node_id].append((pending.decided_unix_ms, release.retained_bytes))
            self.metrics.releases.labels(release.reason.value, release.policy).inc()
            _log_release(release, pending)
            return "released"


def _log_release(release: Release, pending: PendingRelease) -> None:
    log.info(
        "released handle: %s (%s)",
        release.reason.value,
        release.detail,
        extra={
            "reason": release.reason.value,
            "policy": release.policy,
            "tenant": release.tenant,
            "conversation": release.conversation,
            "handle_id": release.handle_id,
            "node": release.node_id,
            "bytes": release.retained_bytes,
            "command_id": pending.command_id,
        },
    )
