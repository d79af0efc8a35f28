"""The `Router`'s ports over the live cluster: the watch-fed view, the store's check-out, the
system clock (`router/ports.py` says what each must do)."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Mapping

from kvplane.services.common.model.nodes import Node
from kvplane.services.common.model.suspects import NodeSuspect
from kvplane.services.common.store import CheckOut, HandleRecord, Store
from kvplane.services.common.store.cluster_view import ClusterView, HandleChange
from kvplane.services.routing.metrics import RoutingMetrics
from kvplane.services.routing.policy import NodeState
from kvplane.services.routing.state.streamed_loads import StreamedLoads


class SystemClock:
    """Wall-clock ms since the epoch, and the monotonic clock."""

    def unix_ms(self) -> int:
        return int(time.time() * 1000)

    def monotonic_s(self) -> float:
        return time.monotonic()


class StoreCheckOut:
    """The check-out as the store's fenced etcd transaction, bounded by a timeout."""

    def __init__(self, store: Store) -> None:
        self.store = store

    async def check_out(
        self, tenant: str, conversation: str, route_id: str, expected: HandleRecord, timeout_s: float
    ) -> CheckOut:
        # asyncio.timeout, not wait_for: no extra task on the hot path.
        async with asyncio.timeout(timeout_s):
            return await self.store.check_out(tenant, conversation, route_id=route_id, expected=expected)


# Conversations whose last handle ended, kept (newest last) so that a Route awaiting a handle that
# was published and is already gone (released, expired, taken) stops waiting at once.
ENDED_KEPT = 65_536


class ViewCluster:
    """The cluster as the replica's watch-fed view shows it, with the loads nodes stream to this
    replica in place of the stored ones while they are fresh (`state.streamed_loads`)."""

    def __init__(
        self, view: ClusterView, metrics: RoutingMetrics, streamed: StreamedLoads | None = None
    ) -> None:
        self.view = view
        self.metrics = metrics
        self.streamed = streamed
        # (tenant, conversation) -> the id of its handle that ended last.
        self._ended: OrderedDict[tuple[str, str], str] = OrderedDict()
        view.on_handle_change(self._on_handle_change)

    def _on_handle_change(self, change: HandleChange) -> None:
        previous = change.previous
        if previous is None:
            return
        if change.current is not None and change.current.handle.handle_id == previous.handle_id:
            return  # the same handle, rewritten
        self._ended[change.key] = previous.handle_id
        self._ended.move_to_end(change.key)
        if len(self._ended) > ENDED_KEPT:
            self._ended.popitem(last=False)

    def ended(self, tenant: str, conversation: str, handle_id: str) -> bool:
        """Whether the view saw `handle_id` come and go (as the conversation's last ended handle)."""
        return self._ended.get((tenant, conversation)) == handle_id

    @property
    def healthy(self) -> bool:
        return self.view.healthy

    @property
    def suspects(self) -> Mapping[str, NodeSuspect]:
        return self.view.suspects

    def handle(self, tenant: str, conversation: str) -> HandleRecord | None:
        return self.view.handle(tenant, conversation)

    def node_states(self) -> tuple[NodeState, ...]:
        view, streamed = self.view, self.streamed
        if streamed is None or not len(streamed):
            return tuple(NodeState(r.node, view.load(r.node)) for r in view.nodes.values())
        now_s = time.monotonic()
        return tuple(
            NodeState(r.node, streamed.load(r.node, view.load(r.node), now_s)) for r in view.nodes.values()
        )

    def node(self, node_id: str) -> Node | None:
        record = self.view.nodes.get(node_id)
        return record.node if record is not None else None

    def newest_report_unix_ms(self) -> int:
        stored = max((load.reported_unix_ms for load in self.view.loads.values()), default=0)
        if self.streamed is None:
            return stored
        return max(stored, self.streamed.newest_report_unix_ms(time.monotonic()))

    async def await_handle(self, tenant: str, conversation: str, handle_id: str, wait_s: float) -> bool:
        """As `wait_published`, timed by outcome (a Route's wait for the engine's publish)."""
        start = time.perf_counter()
        landed = await self.wait_published(tenant, conversation, handle_id, wait_s)
        if landed:
            outcome = "published"
        else:
            outcome = "ended" if self.ended(tenant, conversation, handle_id) else "timeout"
        self.metrics.publish_waits.labels(outcome).observe(time.perf_counter() - start)
        return landed

    async def wait_published(self, tenant: str, conversation: str, handle_id: str, wait_s: float) -> bool:
        """Whether the view holds `handle_id` for the conversation, waiting up to `wait_s` for it;
        no wait for a handle the view already saw come and go."""

        def published() -> bool:
            current = self.view.handle(tenant, conversation)
            return current is not None and current.handle.handle_id == handle_id

        def settled() -> bool:
            return published() or self.ended(tenant, conversation, handle_id)

        if published():
            return True
        if wait_s <= 0 or self.ended(tenant, conversation, handle_id):
            return False
        self.metrics.publish_waiting.inc()
        try:
            return await self.view.wait_for(settled, wait_s) and published()
        finally:
            self.metrics.publish_waiting.dec()
