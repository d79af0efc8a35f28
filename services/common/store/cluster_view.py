"""An in-memory view of nodes, loads and retained handles, fed by etcd watches.

Routing reads it on the hot path without touching etcd, and the eviction
coordinator evaluates its policies over it. The view loads a consistent
snapshot, then follows one watch on the whole key prefix from the snapshot's
revision; when the watch breaks it resumes from the last revision seen, and
after a compaction or a long outage it reloads the snapshot. While etcd is
unreachable the view keeps its last contents and reports `healthy = False`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass

from kvplane.services.common.model import convert
from kvplane.services.common.model.errors import StoreUnavailable
from kvplane.services.common.model.handles import CacheHandle
from kvplane.services.common.model.keys import prefix_range_end, unescape
from kvplane.services.common.model.nodes import Node, NodeLoad
from kvplane.services.common.model.suspects import NodeSuspect
from kvplane.services.common.store import (
    Compacted,
    HandleRecord,
    NodeRecord,
    Store,
    WatchEvent,
)
from kvplane.v1 import handle_pb2, node_pb2

log = logging.getLogger(__name__)

ConversationKey = tuple[str, str]


@dataclass(frozen=True, slots=True)
class HandleChange:
    """A handle appeared (`current`) or went away (`previous` only)."""

    key: ConversationKey
    current: HandleRecord | None
    previous: CacheHandle | None


@dataclass(frozen=True, slots=True)
class NodeChange:
    node_id: str
    current: NodeRecord | None
    previous: Node | None


class ClusterView:
    """Watch-fed copy of `nodes/`, `loads/` and `handles/`."""

    def __init__(self, store: Store, *, retry_delay_s: float = 0.2, max_retry_delay_s: float = 2.0) -> None:
        self.store = store
        self.nodes: dict[str, NodeRecord] = {}
        self.loads: dict[str, NodeLoad] = {}
        self.handles: dict[ConversationKey, HandleRecord] = {}
        # Nodes that just failed a leg (see kvplane.services.common.model.suspects).
        self.suspects: dict[str, NodeSuspect] = {}
        self.revision = 0
        self.healthy = False
        self.ready = asyncio.Event()
        self._changed = asyncio.Condition()
        self._handle_listeners: list[Callable[[HandleChange], None]] = []
        self._node_listeners: list[Callable[[NodeChange], None]] = []
        self._task: asyncio.Task[None] | None = None
        self._retry_delay_s = retry_delay_s
        self._max_retry_delay_s = max_retry_delay_s
        keys = store.keys
        self._nodes_prefix = keys.nodes_prefix()
        self._loads_prefix = keys.loads_prefix()
        self._handles_prefix = keys.handles_prefix()
        self._suspects_prefix = keys.suspects_prefix()
        # handles/, loads/ and nodes/ sort next to each other, with nothing between them, so
        # one range holds exactly what the view needs: claims, the per-node index and the
        # release outbox (whose values carry whole handles) never reach it.
        self._range = (self._handles_prefix, prefix_range_end(keys.nodes_prefix()))

    def on_handle_change(self, listener: Callable[[HandleChange], None]) -> None:
        """Called on the event loop for every handle put or delete after the snapshot."""
        self._handle_listeners.append(listener)

    def on_node_change(self, listener: Callable[[NodeChange], None]) -> None:
        self._node_listeners.append(listener)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="cluster-view")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def wait_for(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Waits until `predicate()` holds on the view (for tests and start-up)."""
        async with self._changed:
            try:
                async with asyncio.timeout(timeout_s):
                    await self._changed.wait_for(predicate)
                return True
            except TimeoutError:
                return False

    # -- lookups used on hot paths --------------------------------------------

    def handle(self, tenant: str, conversation: str) -> HandleRecord | None:
        return self.handles.get((tenant, conversation))

    def live_node(self, node_id: str, incarnation: str) -> Node | None:
        record = self.nodes.get(node_id)
        if record is None or record.node.incarnation != incarnation:
            return None
        return record.node

    def load(self, node: Node) -> NodeLoad | None:
        load = self.loads.get(node.node_id)
        return load if load is not None and load.incarnation == node.incarnation else None

    # -- feeding ---------------------------------------------------------------

    async def _run(self) -> None:
        delay = self._retry_delay_s
        resume_from = 0
        while True:
            try:
                if resume_from == 0:
                    resume_from = await self._load_snapshot() + 1
                async for batch in self.store.watch_range(*self._range, resume_from, prev_kv=False):
                    self.healthy = True
                    delay = self._retry_delay_s
                    for event in batch:
                        self._apply(event)
                        resume_from = event.revision + 1
                    await self._notify()
            except Compacted:
                log.warning("cluster view fell behind a compaction; reloading")
                resume_from = 0
            except StoreUnavailable as exc:
                if self.healthy:
                    log.warning("cluster view lost etcd: %s", exc)
                self.healthy = False
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("cluster view failed; reloading")
                resume_from = 0
                self.healthy = False
            await self._notify()
            await asyncio.sleep(delay)  # back off before reconnecting
            delay = min(delay * 2, self._max_retry_delay_s)

    async def _load_snapshot(self) -> int:
        revision, events = await self.store.read_range(*self._range)
        nodes: dict[str, NodeRecord] = {}
        loads: dict[str, NodeLoad] = {}
        handles: dict[ConversationKey, HandleRecord] = {}
        suspects: dict[str, NodeSuspect] = {}
        for ev in events:
            if ev.key.startswith(self._nodes_prefix):
                node_record = _node_record(ev)
                nodes[node_record.node.node_id] = node_record
            elif ev.key.startswith(self._loads_prefix):
                load = convert.load_from_pb(node_pb2.NodeLoad.FromString(ev.value))
                loads[load.node_id] = load
            elif ev.key.startswith(self._handles_prefix):
                handles[self.store.keys.handle_parts(ev.key)] = _handle_record(ev)
            elif ev.key.startswith(self._suspects_prefix):
                suspect = _suspect(ev)
                suspects[suspect.node_id] = suspect
        self.suspects = suspects
        old_handles = self.handles
        self.nodes, self.loads, self.handles = nodes, loads, handles
        self.revision = revision
        self.healthy = True
        # Listeners see what changed across the reload as ordinary changes.
        for key, record in handles.items():
            old = old_handles.get(key)
            if old is None or old.mod_revision != record.mod_revision:
                self._emit_handle(HandleChange(key, record, old.handle if old else None))
        for key, old in old_handles.items():
            if key not in handles:
                self._emit_handle(HandleChange(key, None, old.handle))
        self.ready.set()
        await self._notify()
        return revision

    def _apply(self, ev: WatchEvent) -> None:
        self.revision = max(self.revision, ev.revision)
        key = ev.key
        if key.startswith(self._handles_prefix):
            conv = self.store.keys.handle_parts(key)
            previous = self.handles.get(conv)
            if ev.deleted:
                self.handles.pop(conv, None)
                self._emit_handle(HandleChange(conv, None, previous.handle if previous else None))
            else:
                handle_record = _handle_record(ev)
                self.handles[conv] = handle_record
                self._emit_handle(HandleChange(conv, handle_record, previous.handle if previous else None))
        elif key.startswith(self._nodes_prefix):
            node_id = _unescape_last(key)
            previous_node = self.nodes.get(node_id)
            if ev.deleted:
                self.nodes.pop(node_id, None)
                self.loads.pop(node_id, None)
                change = NodeChange(node_id, None, previous_node.node if previous_node else None)
            else:
                node_record = _node_record(ev)
                self.nodes[node_record.node.node_id] = node_record
                change = NodeChange(node_id, node_record, previous_node.node if previous_node else None)
            for listener in self._node_listeners:
                listener(change)
        elif key.startswith(self._suspects_prefix):
            if ev.deleted:
                self.suspects.pop(_unescape_last(key), None)
            else:
                suspect = _suspect(ev)
                self.suspects[suspect.node_id] = suspect
        elif key.startswith(self._loads_prefix):
            if ev.deleted:
                self.loads.pop(_unescape_last(key), None)
            else:
                load = convert.load_from_pb(node_pb2.NodeLoad.FromString(ev.value))
                self.loads[load.node_id] = load

    def _emit_handle(self, change: HandleChange) -> None:
        for listener in self._handle_listeners:
            try:
                listener(change)
            except Exception:
                log.exception("handle listener failed")

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()


def _unescape_last(key: bytes) -> str:
    return unescape(key.decode("utf-8").rsplit("/", 1)[1])


def _node_record(ev: WatchEvent) -> NodeRecord:
    return NodeRecord(convert.node_from_pb(node_pb2.Node.FromString(ev.value)), ev.lease, ev.mod_revision)


def _handle_record(ev: WatchEvent) -> HandleRecord:
    handle = convert.handle_from_pb(handle_pb2.CacheHandle.FromString(ev.value))
    return HandleRecord(handle, ev.mod_revision, ev.lease)


__all__ = ["ClusterView", "ConversationKey", "HandleChange", "NodeChange", "prefix_range_end"]


def _suspect(ev: WatchEvent) -> NodeSuspect:
    return NodeSuspect.from_pb(node_pb2.NodeSuspect.FromString(ev.value))
