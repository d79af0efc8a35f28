"""Open node command streams on the leader, and the outbox each one follows.

The outbox is etcd itself: `releases/{node}/{command id}` entries, written
by the same transaction that removed the handle. A session replays every
entry for its node when it opens (oldest first), then follows a watch on the
node's prefix from the revision of that read, so commands written while the
node was away, or while another replica led, are all delivered. An entry is
deleted only when the node acknowledges it, so a command is never lost; and
nodes apply each command id at most once, so a replay is never applied twice.
The deletion of an applied release also records its blocks as freed (the
tombstone the node's own report would have written): one etcd request for both.

Two kinds of message bypass the outbox: a spill order (a hint, not acknowledged) and a move
(`mover.py`: acknowledged, but neither stored nor replayed, as it changes no record). Each
answer to a move, and the stream's end before one, goes back to the leader's mover.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvplane.services.common.model import convert
from kvplane.services.common.model.errors import StoreUnavailable
from kvplane.services.common.model.handles import PendingRelease
from kvplane.services.common.store import Compacted, Store, now_ms
from kvplane.services.eviction.metrics import EvictionMetrics
from kvplane.services.eviction.policy import Release
from kvplane.services.eviction.spill_order import NodeSpillOrder
from kvplane.v1 import eviction_pb2, handle_pb2

log = logging.getLogger(__name__)

_RELEASE = "release"
_DRAIN = "drain"
_MOVE = "move"


@dataclass(frozen=True, slots=True)
class _Sent:
    kind: str
    decided_unix_ms: int
    # A release: the holder's incarnation and request id, recorded as freed when the node acks.
    freed: tuple[str, str] | None = None


class SessionClosed(Exception):
    """The session ended: the node went away, reconnected elsewhere, or the term ended."""


class NodeSession:
    """One node's command stream: what was offered, what awaits an ack."""

    def __init__(
        self,
        node_id: str,
        incarnation: str,
        store: Store,
        metrics: EvictionMetrics,
        wants_spill_order: bool = False,
        accepts_moves: bool = False,
        on_move_done: Callable[[str, bool | None], None] | None = None,
    ) -> None:
        self.node_id = node_id
        self.incarnation = incarnation
        # The node has a host tier and asked for the order of its moves there (`spill_order.py`).
        self.wants_spill_order = wants_spill_order
        self._spill_sent: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
        # The node's engine moves handles to its host tier on a MoveCommand (`mover.py`); each
        # answer, or the stream's end before one, goes to `on_move_done` (command id, moved).
        self.accepts_moves = accepts_moves and on_move_done is not None
        self._on_move_done = on_move_done
        self.store = store
        self.metrics = metrics
        self.opened = time.monotonic()
        self.acked = 0
        self.close_reason = ""
        self._queue: asyncio.Queue[eviction_pb2.CommandsResponse | None] = asyncio.Queue()
        self._offered: set[str] = set()
        self._unacked: dict[str, _Sent] = {}
        self._follower: asyncio.Task[None] | None = None

    @property
    def closed(self) -> bool:
        return bool(self.close_reason)

    @property
    def unacked(self) -> int:
        return len(self._unacked)

    def offer_release(self, pending: PendingRelease) -> bool:
        """Queues a release for sending unless it is another incarnation's or already offered."""
        if self.closed or pending.handle.holder_incarnation != self.incarnation:
            # Another incarnation's blocks are gone with it; the dead-node
            # purge deletes such entries.
            return False
        if pending.command_id in self._offered:
            return False
        self._offered.add(pending.command_id)
        h = pending.handle
        command = eviction_pb2.CommandsResponse(
            command_id=pending.command_id,
            release=eviction_pb2.ReleaseCommand(
                tenant=h.tenant,
                conversation=h.conversation,
                handle_id=h.handle_id,
                remote_request_id=h.vllm.remote_request_id,
                reason=convert.reason_to_pb(pending.reason),
                ack_records_freed=True,
            ),
        )
        freed = (h.holder_incarnation, h.vllm.remote_request_id)
        self._unacked[pending.command_id] = _Sent(_RELEASE, pending.decided_unix_ms, freed)
        self._queue.put_nowait(command)
        return True

    def offer_move(self, command_id: str, release: Release, remote_request_id: str) -> bool:
        """Queues a move of the handle `release` names to the node's host tier (`mover.py`)."""
        if self.closed or not self.accepts_moves:
            return False
        self._offered.add(command_id)
        self._unacked[command_id] = _Sent(_MOVE, now_ms())
        self._queue.put_nowait(
            eviction_pb2.CommandsResponse(
                command_id=command_id,
                move=eviction_pb2.MoveCommand(
                    tenant=release.tenant,
                    conversation=release.conversation,
                    handle_id=release.handle_id,
                    remote_request_id=remote_request_id,
                    reason=convert.reason_to_pb(release.reason),
                ),
            )
        )
        return True

    def offer_drain(self) -> bool:
        # One drain per incarnation: its id is stable, so a node that already
        # drained acknowledges a replay without acting twice.
        command_id = f"drain-{self.incarnation}"
        if self.closed or command_id in self._offered:
            return False
        self._offered.add(command_id)
        self._unacked[command_id] = _Sent(_DRAIN, now_ms())
        self._queue.put_nowait(
            eviction_pb2.CommandsResponse(command_id=command_id, drain=eviction_pb2.DrainCommand())
        )
        return True

    def offer_spill_order(self, order: NodeSpillOrder) -> bool:
        """Queues the node's spill order if it asked for one and would not already follow it."""
        if self.closed or not self.wants_spill_order:
            return False
        sent_device, sent_host = self._spill_sent
        if order.device.followed_after(sent_device) and order.host.followed_after(sent_host):
            return False
        self._spill_sent = (order.device.order, order.host.order)
        self._queue.put_nowait(
            eviction_pb2.CommandsResponse(
                spill_order=eviction_pb2.SpillOrder(
                    device_request_ids=order.device.order, host_request_ids=order.host.order
                )
            )
        )
        return True

    async def next_command(self) -> eviction_pb2.CommandsResponse:
        """The next command to send; raises SessionClosed when the session ends."""
        item = await self._queue.get()
        if item is None:
            raise SessionClosed(self.close_reason)
        self.metrics.commands_sent.labels(item.WhichOneof("command") or "").inc()
        return item

    async def acknowledge(self, ack: eviction_pb2.CommandAck) -> None:
        sent = self._unacked.pop(ack.command_id, None)
        if sent is None:
            return  # a duplicate ack, or one for a command of an earlier stream
        outcome = "ok" if ack.ok else "error"
        self.metrics.commands_acked.labels(sent.kind, outcome).inc()
        if sent.kind == _MOVE:
            if self._on_move_done is not None:
                # Refused: the handle stays where it is, and the leader releases it instead.
                self._on_move_done(ack.command_id, ack.ok)
        elif not ack.ok:
            # The node could not apply it (e.g. the engine had already freed
            # the blocks). Re-sending would fail the same way, and the handle
            # is already unroutable, so the command is done either way.
            log.warning(
                "node failed a command",
                extra={
                    "node": self.node_id,
                    "command_id": ack.command_id,
                    "kind": sent.kind,
                    "error": ack.error,
                },
            )
        if sent.kind == _RELEASE:
            try:
                # Applied: the node left these blocks out of its freed report, so the ack records
                # them. Not applied: the engine had freed them already and reported that itself.
                await self.store.ack_release(self.node_id, ack.command_id, sent.freed if ack.ok else None)
            except StoreUnavailable as exc:
                # The entry stays and is replayed on the next connect; the
                # node acknowledges it again without applying it twice.
                log.warning("could not delete acknowledged release %s: %s", ack.command_id, exc)
                return
            self.metrics.delivery_seconds.observe(max(0, now_ms() - sent.decided_unix_ms) / 1000.0)
        self._offered.discard(ack.command_id)
        self.acked += 1

    def close(self, reason: str) -> None:
        if not self.closed:
            self.close_reason = reason
            self._queue.put_nowait(None)
            if self._on_move_done is not None:
                # Unanswered moves: the handles stay where they were, to be decided afresh.
                for command_id, sent in list(self._unacked.items()):
                    if sent.kind == _MOVE:
                        del self._unacked[command_id]
                        self._on_move_done(command_id, None)
        if self._follower is not None:
            self._follower.cancel()

    def follow_outbox(self) -> None:
        if self._follower is None:
            self._follower = asyncio.create_task(self._follow(), name=f"outbox-{self.node_id}")

    async def _follow(self) -> None:
        prefix = self.store.keys.releases_prefix(self.node_id)
        delay = 0.1
        while not self.closed:
            try:
                revision, entries = await self.store.read_prefix(prefix)
                for entry in sorted(entries, key=lambda e: e.mod_revision):
                    self.offer_release(_pending(entry.value))
                async for batch in self.store.watch_prefix(prefix, revision + 1):
                    delay = 0.1
                    for event in batch:
                        if not event.deleted:
                            self.offer_release(_pending(event.value))
            except Compacted:
                continue  # re-read: the replay covers whatever was missed
            except StoreUnavailable as exc:
                log.warning("outbox of node %s: %s", self.node_id, exc)
                await asyncio.sleep(delay)  # back off while etcd is unreachable
                delay = min(delay * 2, 2.0)


def _pending(value: bytes) -> PendingRelease:
    return convert.pending_from_pb(handle_pb2.PendingRelease.FromString(value))


class SessionRegistry:
    """The leader's open sessions, at most one per node."""

    def __init__(
        self,
        store: Store,
        metrics: EvictionMetrics,
        on_move_done: Callable[[str, bool | None], None] | None = None,
    ) -> None:
        self.store = store
        self.metrics = metrics
        # Where each session sends its nodes' answers to moves (the leader's `Mover.settled`).
        self.on_move_done = on_move_done
        self._sessions: dict[str, NodeSession] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def get(self, node_id: str) -> NodeSession | None:
        return self._sessions.get(node_id)

    def open(
        self, node_id: str, incarnation: str, wants_spill_order: bool = False, accepts_moves: bool = False
    ) -> NodeSession:
        """A new session; a node's older stream is closed (it reconnected)."""
        old = self._sessions.pop(node_id, None)
        if old is not None:
            old.close("replaced by a newer stream from the same node")
        session = NodeSession(
            node_id,
            incarnation,
            self.store,
            self.metrics,
            wants_spill_order,
            accepts_moves,
            self.on_move_done,
        )
        self._sessions[node_id] = session
        self.metrics.connected_nodes.set(len(self._sessions))
        session.follow_outbox()
        return session

    def discard(self, session: NodeSession, reason: str) -> None:
        session.close(reason)
        if self._sessions.get(session.node_id) is session:
            del self._sessions[session.node_id]
        self.metrics.connected_nodes.set(len(self._sessions))

    def spill_order_nodes(self) -> set[str]:
        """Nodes whose open session asked for spill orders."""
        return {node_id for node_id, s in self._sessions.items() if s.wants_spill_order and not s.closed}

    def close_all(self, reason: str) -> None:
        for session in list(self._sessions.values()):
            self.discard(session, reason)

    async def wait_closed(self) -> None:
        """Lets cancelled followers finish (for orderly shutdown)."""
        for session in list(self._sessions.values()):
            if session._follower is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await session._follower
