"""Carries out policy decisions: one fenced release transaction each.

The transaction (`Store.release`) succeeds only if the handle is still the
retained one the leader saw; it deletes the handle and queues the node's
command in one step. A handle checked out meanwhile makes it fail, and the
decision is dropped: a checked-out handle is never released early.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from kvplane.services.common.model.errors import HandleNotRetained, NotFound, StoreUnavailable
from kvplane.services.common.model.handles import PendingRelease
from kvplane.services.common.runtime.telemetry import Telemetry
from kvplane.services.common.store import Store, now_ms
from kvplane.services.common.store.cluster_view import ClusterView
from kvplane.services.eviction.election import Term
from kvplane.services.eviction.metrics import EvictionMetrics
from kvplane.services.eviction.policy import Release

log = logging.getLogger(__name__)

# How long releases are remembered against lagging load reports, ms.
_FREED_MEMORY_MS = 120_000
# How long a release is remembered against its node's demand reports, seconds:
# a node that is away does not report demand either, and on reconnect it is
# sent the command again.
_DEMAND_MEMORY_S = 10.0


@dataclass(frozen=True, slots=True)
class ReleaseOutcome:
    released: int
    conflicts: int
    stale: int
    failed: int


@dataclass(slots=True)
class _Sent:
    """A release sent to a node, as its demand reports see it. Times: time.monotonic() s."""

    nbytes: int
    decided_s: float
    # When the node acknowledged it; None: not yet.
    acked_s: float | None


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
        # (when, bytes, command id) of recent releases and moves per node: a node's load report
        # lags them, and must not be read as if they had not happened.
        self._freed: dict[str, deque[tuple[int, int, str]]] = defaultdict(deque)
        # Per node, command id -> release sent: a demand report the node sent
        # before it acknowledged a release cannot count that release.
        self._sent: dict[str, dict[str, _Sent]] = defaultdict(dict)
        # Acknowledgements that overtook their transaction's reply: command id -> when.
        self._acked_early: OrderedDict[str, float] = OrderedDict()

    def freed_since(self, node_id: str, since_unix_ms: int) -> int:
        """Bytes released on `node_id` after `since_unix_ms` (a load report's time)."""
        entries = self._freed.get(node_id)
        if not entries:
            return 0
        horizon = now_ms() - _FREED_MEMORY_MS
        while entries and entries[0][0] < horizon:
            entries.popleft()
        return sum(b for t, b, _ in entries if t > since_unix_ms)

    def bytes_unseen_by(self, node_id: str, report_received_s: float) -> int:
        """Bytes released on `node_id` that a demand report received at `report_received_s`
        (time.monotonic()) cannot reflect: their acknowledgements came after it, or not yet."""
        entries = self._sent.get(node_id)
        if not entries:
            return 0
        horizon = time.monotonic() - _DEMAND_MEMORY_S
        total = 0
        for command_id, sent in list(entries.items()):
            if (sent.acked_s if sent.acked_s is not None else sent.decided_s) < horizon:
                del entries[command_id]
            elif sent.acked_s is None or sent.acked_s > report_received_s:
                total += sent.nbytes
        return total

    def acknowledged(self, node_id: str, command_id: str) -> None:
        """The node applied `command_id`: its demand reports from now on reflect it."""
        now = time.monotonic()
        entry = self._sent.get(node_id, {}).get(command_id)
        if entry is not None:
            entry.acked_s = now
            return
        self._acked_early[command_id] = now
        while len(self._acked_early) > 1024:
            self._acked_early.popitem(last=False)

    def note_sent(self, release: Release, command_id: str, decided_unix_ms: int) -> None:
        """`release` went to its node as `command_id` (a release or a move): its handle is not
        judged again while the view still shows it, and its device bytes count as freed against
        the node's lagging load and demand reports."""
        self.recent[release.key] = release.handle_id
        self._freed[release.node_id].append((decided_unix_ms, release.retained_bytes, command_id))
        acked_s = self._acked_early.pop(command_id, None)
        self._sent[release.node_id][command_id] = _Sent(release.retained_bytes, time.monotonic(), acked_s)

    def take_back(self, release: Release, command_id: str) -> None:
        """`command_id` freed nothing after all (a move the node refused, never received, or
        started to no effect): its handle may be judged again, and its bytes no longer count as
        freed."""
        if self.recent.get(release.key) == release.handle_id:
            del self.recent[release.key]
        self._sent.get(release.node_id, {}).pop(command_id, None)
        entries = self._freed.get(release.node_id)
        if entries:
            kept = [e for e in entries if e[2] != command_id]
            entries.clear()
            entries.extend(kept)

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
            self.note_sent(release, pending.command_id, pending.decided_unix_ms)
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
