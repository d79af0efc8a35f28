"""The eviction coordinator: elected leader, policy loop, dead nodes, sessions.

Every replica watches the cluster (a warm standby) and learns inter-turn
gaps from handle publishes. Only the leader acts:

- evaluates the retention pipeline over the cluster view and releases what
  it decides, each through a fenced transaction (`Releaser`);
- answers nodes' KV demand at once: a demand report on a node's command
  stream wakes a round for that node alone, which releases its handles in
  value order until the demand is covered (the `demand` plugin). Releases
  the node acknowledged only after it sent the report (or not yet) are
  taken off the report, so one shortage is answered once. The leader, not the node, decides: it holds
  the learned gap statistics and the view of every handle, and each release
  still goes through the same fenced transaction, so a handle being checked
  out is never freed;
- purges the handles of nodes whose lease went, or that came back as a new
  incarnation, through the per-node index, and sweeps for orphans;
- drains nodes marked draining;
- serves node command streams (`sessions`).

A new leader needs nothing from its predecessor: the handles, the nodes and
the release outbox are all in etcd, and the view is caught up to the
revision read at the start of the term before anything is decided.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from kvplane.services.common.model.errors import StoreUnavailable
from kvplane.services.common.model.handles import KvTier, ReleaseReason
from kvplane.services.common.runtime.telemetry import Telemetry
from kvplane.services.common.store import Store, now_ms
from kvplane.services.common.store.cluster_view import ClusterView, HandleChange, NodeChange
from kvplane.services.eviction.config import retention_pipeline
from kvplane.services.eviction.election import LeaderElection, Term
from kvplane.services.eviction.metrics import EvictionMetrics
from kvplane.services.eviction.mover import Mover
from kvplane.services.eviction.policy import (
    HandleInfo,
    NodeInfo,
    Release,
    RetentionPipeline,
    Snapshot,
    TurnTracker,
)
from kvplane.services.eviction.releaser import Releaser
from kvplane.services.eviction.sessions import NodeSession, SessionRegistry
from kvplane.services.eviction.settings import EvictionSection
from kvplane.services.eviction.spill_order import spill_orders

log = logging.getLogger(__name__)

# Shortest pause between two evaluations, seconds: bursts of publishes are
# judged together rather than one evaluation per publish.
_MIN_EVALUATE_GAP_S = 0.05
# How long a new leader waits for its view to reach the term's start revision.
_CATCH_UP_TIMEOUT_S = 5.0


@dataclass(frozen=True, slots=True)
class NodeDemand:
    """A node's latest KV demand report."""

    incarnation: str
    # KV blocks wanted beyond what is free and what the node is already freeing.
    blocks: int
    # When the node measured it (its clock), Unix ms.
    measured_unix_ms: int
    # When the leader received it, time.monotonic() seconds.
    received_s: float


def default_replica_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class EvictionCoordinator:
    """One replica of the coordinator; a Component (start/stop) of a process."""

    def __init__(
        self,
        store: Store,
        view: ClusterView,
        settings: EvictionSection,
        telemetry: Telemetry,
        *,
        pipeline: RetentionPipeline | None = None,
    ) -> None:
        self.store = store
        self.view = view
        self.settings = settings
        self.telemetry = telemetry
        self.replica_id = settings.replica_id or default_replica_id()
        self.election = LeaderElection(store, settings.election_name, self.replica_id, settings.lease_ttl_s)
        self.metrics = EvictionMetrics.create(telemetry.registry)
        self.sessions = SessionRegistry(store, self.metrics)
        self.pipeline = pipeline or retention_pipeline(settings)
        self.tracker = TurnTracker(self.pipeline.values.gaps, horizon_s=settings.gap_horizon_s)
        self.releaser = Releaser(store, view, self.metrics, telemetry, settings.release_concurrency)
        self.mover = Mover(
            view,
            self.sessions,
            self.releaser,
            self.metrics,
            lambda: self._wake.set(),
            settings.move_grace_s,
            settings.move_settle_s,
        )
        self.sessions.on_move_done = self.mover.settled
        self.term: Term | None = None
        self.evaluations = 0
        # CPU time of the last round's judging, seconds.
        self.last_evaluation_s = 0.0
        self._reported_nodes: set[str] = set()
        self._wake = asyncio.Event()
        self.demands: dict[str, NodeDemand] = {}
        self._demand_wake = asyncio.Event()
        # One decision round at a time (the policy round or a demand round):
        # each sees the releases of the one before it.
        self._deciding = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._term_tasks: set[asyncio.Task[Any]] = set()
        self._leadership_listeners: list[Callable[[bool], None]] = []
        view.on_handle_change(self._on_handle_change)
        view.on_node_change(self._on_node_change)

    # -- lifecycle ----------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        return self.term is not None and self.term.active

    def on_leadership(self, listener: Callable[[bool], None]) -> None:
        """Called with True when this replica starts acting, False when it stops (and at start)."""
        self._leadership_listeners.append(listener)

    def _announce(self, leading: bool) -> None:
        for listener in self._leadership_listeners:
            try:
                listener(leading)
            except Exception:
                log.exception("leadership listener failed")

    async def start(self) -> None:
        self._announce(False)
        self.view.start()
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="eviction-coordinator")

    async def stop(self) -> None:
        """Stops acting and hands leadership over at once (revokes the lease)."""
        # Taken first: cancelling the loop ends the term and forgets it.
        term = self.term
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._end_term()
        await self.election.stop(term)

    async def _run(self) -> None:
        while True:
            term = await self.election.campaign()
            try:
                await self._lead(term)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("eviction leader failed; resigning")
                await self.election.resign(term)
            finally:
                self._end_term()
            # A replica that lost its lease is likely cut off from etcd or
            # overloaded: give the standbys, already watching, the first go.
            await asyncio.sleep(self.settings.lease_ttl_s / 2)  # stand-down pause

    async def _lead(self, term: Term) -> None:
        await self._catch_up()
        if term.lost.is_set():
            return
        self.term = term
        self.mover.start_term()
        self.metrics.leader.set(1)
        self._announce(True)
        log.info("eviction leader: acting", extra={"replica": self.replica_id})
        self._spawn(self._policy_loop(term))
        self._spawn(self._demand_loop(term))
        self._spawn(self._sweep_loop(term))
        for record in list(self.view.nodes.values()):
            if record.node.draining:
                self._drain(record.node.node_id, record.node.incarnation)
        await term.lost.wait()
        log.warning("eviction leader: leadership lost; stopped acting", extra={"replica": self.replica_id})

    def _end_term(self) -> None:
        if self.term is not None:
            self.term.lost.set()
            self._announce(False)
        self.term = None
        self.metrics.leader.set(0)
        for task in list(self._term_tasks):
            task.cancel()
        self.sessions.close_all("leadership lost")

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(coro)
        self._term_tasks.add(task)
        task.add_done_callback(self._term_tasks.discard)

    async def _catch_up(self) -> None:
        """Waits until the view has seen everything etcd held when the term began."""
        try:
            revision = await self.store.revision()
        except StoreUnavailable:
            return
        if not await self.view.wait_for(
            lambda: self.view.ready.is_set() and self.view.revision >= revision, _CATCH_UP_TIMEOUT_S
        ):
            log.warning("eviction leader: view not caught up to revision %d; acting on it anyway", revision)

    # -- the policy loop -------------------------------------------------------------

    async def _policy_loop(self, term: Term) -> None:
        interval = self.settings.evaluate_interval_s
        while term.active:
            self._wake.clear()
            try:
                await self.evaluate_once(term)
            except StoreUnavailable as exc:
                log.warning("eviction round failed: %s", exc)
            except Exception:
                log.exception("eviction round failed")
            # Let a burst of changes settle; and since a round holds the event
            # loop while it judges, keep rounds to a third of the loop's time.
            await asyncio.sleep(max(_MIN_EVALUATE_GAP_S, 2 * self.last_evaluation_s))
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self._wake.wait()

    def snapshot(self, now_unix_ms: int, only_node: str = "") -> tuple[Snapshot, list[Release]]:
        """The policy snapshot of the view, and releases for draining nodes.

        With `only_node`, only that node's handles (a demand round judges one node).
        """
        self.releaser.prune()
        nodes = {}
        for node_id, node_record in self.view.nodes.items():
            capacity = node_record.node.kv_capacity_bytes
            load = self.view.load(node_record.node)
            reported, free = 0, 1.0
            if load is not None:
                # What this leader released since the report is not in it yet.
                freed = self.releaser.freed_since(node_id, load.reported_unix_ms)
                reported = max(0, load.retained_bytes - freed)
                free = load.free_kv_fraction
                if capacity > 0 and load.total_kv_blocks > 0:
                    free = min(1.0, free + freed / capacity)
            nodes[node_id] = NodeInfo(node_id, capacity, reported, free, self.demand_bytes(node_id))
        draining = {(r.node.node_id, r.node.incarnation) for r in self.view.nodes.values() if r.node.draining}
        handles: list[HandleInfo] = []
        drains: list[Release] = []
        for key, record in self.view.handles.items():
            h = record.handle
            if only_node and h.holder_node_id != only_node:
                continue
            if h.wall_expiry_unix_ms <= now_unix_ms:
                # Past its expiry, its key lives only until its shared lease's bucket ends: the
                # engine frees the blocks itself, and nothing hands the handle out any more.
                continue
            if self.releaser.recent.get(key) == h.handle_id:
                continue
            info = HandleInfo(
                h.tenant,
                h.conversation,
                h.handle_id,
                h.holder_node_id,
                h.retained_bytes,
                h.num_tokens,
                h.published_unix_ms,
                h.wall_expiry_unix_ms,
                on_device=h.tier is KvTier.DEVICE,
            )
            if (h.holder_node_id, h.holder_incarnation) in draining:
                drains.append(
                    Release.of(info, ReleaseReason.DRAIN, "drain", f"node {h.holder_node_id} is draining")
                )
            else:
                handles.append(info)
        return Snapshot(now_unix_ms, tuple(handles), nodes), drains

    async def evaluate_once(self, term: Term) -> int:
        """One round: judge the view, release what was decided. Returns releases made."""
        async with self._deciding:
            return await self._evaluate(term)

    async def _evaluate(self, term: Term) -> int:
        started = time.perf_counter()
        now = now_ms()
        self.tracker.expire(now)
        snapshot, releases = self.snapshot(now)
        # Host-tier handles are judged by their tier (its TTL, its room), not by the policies.
        releases += self.pipeline.evaluate(snapshot.on_device())
        self.evaluations += 1
        self.last_evaluation_s = time.perf_counter() - started
        self.metrics.evaluation_seconds.observe(self.last_evaluation_s)
        self._report_retained(snapshot)
        self._offer_spill_orders(snapshot)
        releases = self.mover.split(releases)
        if not releases:
            return 0
        outcome = await self.releaser.apply(releases, term)
        return outcome.released

    def _offer_spill_orders(self, snapshot: Snapshot) -> None:
        """Sends each node with a host tier its order of moves, where it changed (`spill_order.py`)."""
        nodes = self.sessions.spill_order_nodes()
        if not nodes:
            return
        request_ids = {
            record.handle.handle_id: record.handle.vllm.remote_request_id
            for record in self.view.handles.values()
            if record.handle.holder_node_id in nodes
        }
        orders = spill_orders(
            snapshot, self.pipeline.values, request_ids, self.settings.spill_order_max_handles, nodes
        )
        for node_id, order in orders.items():
            session = self.sessions.get(node_id)
            if session is not None:
                session.offer_spill_order(order)  # counted by kind as it is sent

    def _report_retained(self, snapshot: Snapshot) -> None:
        retained = dict.fromkeys(snapshot.nodes, 0)
        for h in snapshot.handles:
            retained[h.node_id] = retained.get(h.node_id, 0) + h.retained_bytes
        for node_id, value in retained.items():
            self.metrics.node_retained_bytes.labels(node_id).set(value)
        # Nodes that left take their series with them.
        for node_id in self._reported_nodes - retained.keys():
            self.metrics.node_retained_bytes.remove(node_id)
        self._reported_nodes = set(retained)

    # -- demand ------------------------------------------------------------------------------

    def on_demand(self, node_id: str, incarnation: str, blocks: int, measured_unix_ms: int) -> None:
        """A node reported its KV demand on its command stream (replaces its previous report)."""
        self.metrics.demand_reports.inc()
        record = self.view.nodes.get(node_id)
        if record is not None and record.node.incarnation != incarnation:
            return  # a report from another life of the node
        if blocks <= 0:
            self.demands.pop(node_id, None)
            return
        self.demands[node_id] = NodeDemand(incarnation, blocks, measured_unix_ms, time.monotonic())
        self._demand_wake.set()

    def forget_demand(self, node_id: str, incarnation: str) -> None:
        """The node's stream closed: its demand is reported again when it reconnects."""
        demand = self.demands.get(node_id)
        if demand is not None and demand.incarnation == incarnation:
            del self.demands[node_id]

    def demand_bytes(self, node_id: str) -> int:
        """`node_id`'s demand in bytes, less releases its report could not reflect yet."""
        demand = self.demands.get(node_id)
        record = self.view.nodes.get(node_id)
        if demand is None or record is None:
            return 0
        block_bytes = record.node.kv_bytes_per_token * max(1, record.node.block_size)
        unseen = self.releaser.bytes_unseen_by(node_id, demand.received_s)
        return max(0, demand.blocks * block_bytes - unseen)

    async def _demand_loop(self, term: Term) -> None:
        while term.active:
            await self._demand_wake.wait()
            self._demand_wake.clear()
            for node_id in list(self.demands):
                try:
                    await self.answer_demand(node_id, term)
                except StoreUnavailable as exc:
                    log.warning("demand round for %s failed: %s", node_id, exc)
                except Exception:
                    log.exception("demand round for %s failed", node_id)

    async def answer_demand(self, node_id: str, term: Term) -> int:
        """Releases `node_id`'s handles, in value order, until its demand is covered.

        A release that loses to a check-out frees nothing, so the round is
        repeated on the new view while it makes progress. Returns releases made.
        """
        demand = self.demands.get(node_id)
        released = 0
        async with self._deciding:
            # Read under the lock: a policy round that held it may have sent moves of its own.
            moves_before = self.mover.sent
            while term.active:
                snapshot, _ = self.snapshot(now_ms(), only_node=node_id)
                releases = self.mover.split(self.pipeline.for_demand(snapshot, node_id))
                if not releases:
                    break  # covered, by moves if not by releases
                outcome = await self.releaser.apply(releases, term)
                released += outcome.released
                if outcome.released == 0:
                    break  # nothing could be released: the next report or round retries
        # Answered by releases committed, or by moves sent (a node with a host tier).
        if (released or self.mover.sent > moves_before) and demand is not None:
            self.metrics.demand_answer_seconds.observe(time.monotonic() - demand.received_s)
        return released

    # -- inputs from the view ------------------------------------------------------------

    def _on_handle_change(self, change: HandleChange) -> None:
        current = change.current
        if current is not None and (
            change.previous is None or change.previous.handle_id != current.handle.handle_id
        ):
            # Standbys learn too, so a new leader starts with warm statistics.
            self.tracker.on_publish(
                current.handle.tenant, current.handle.conversation, current.handle.published_unix_ms
            )
        if self.term is not None:
            self._wake.set()

    def _on_node_change(self, change: NodeChange) -> None:
        if self.term is None:
            return
        previous, current = change.previous, change.current
        if current is None:
            if previous is not None:
                # The node's lease is gone: its blocks died with it.
                self._spawn(self._purge(change.node_id, previous.incarnation))
            return
        if previous is not None and previous.incarnation != current.node.incarnation:
            # A restart: the old incarnation's handles must never be served.
            self._spawn(self._purge(change.node_id, previous.incarnation))
            session = self.sessions.get(change.node_id)
            if session is not None and session.incarnation != current.node.incarnation:
                self.sessions.discard(session, "node restarted with a new incarnation")
        if current.node.draining and not (previous is not None and previous.draining):
            self._drain(change.node_id, current.node.incarnation)

    def _drain(self, node_id: str, incarnation: str) -> None:
        session = self.sessions.get(node_id)
        if session is not None and session.incarnation == incarnation:
            session.offer_drain()
        self._wake.set()  # the next round releases the node's handles

    # -- dead nodes ------------------------------------------------------------------------

    async def _purge(self, node_id: str, incarnation: str) -> None:
        try:
            removed = await self.store.purge_node(node_id, incarnation, ReleaseReason.HOLDER_DOWN)
        except StoreUnavailable as exc:
            log.warning("purge of node %s failed (the sweep retries): %s", node_id, exc)
            return
        if removed:
            self.metrics.purged_handles.inc(removed)
            log.info(
                "purged handles of a dead node",
                extra={
                    "node": node_id,
                    "incarnation": incarnation,
                    "handles": removed,
                    "reason": "holder_down",
                },
            )

    async def sweep_orphans(self) -> None:
        for node_id, incarnation in await self.store.orphaned_nodes():
            await self._purge(node_id, incarnation)

    async def _sweep_loop(self, term: Term) -> None:
        while term.active:
            try:
                await self.sweep_orphans()
            except StoreUnavailable as exc:
                log.warning("orphan sweep failed: %s", exc)
            await asyncio.sleep(self.settings.orphan_sweep_interval_s)  # periodic sweep

    # -- sessions ----------------------------------------------------------------------------

    def open_session(
        self, node_id: str, incarnation: str, wants_spill_order: bool = False, accepts_moves: bool = False
    ) -> NodeSession:
        session = self.sessions.open(node_id, incarnation, wants_spill_order, accepts_moves)
        self.mover.note_session(node_id, incarnation, accepts_moves)
        record = self.view.nodes.get(node_id)
        if record is not None and record.node.draining and record.node.incarnation == incarnation:
            session.offer_drain()
        if wants_spill_order:
            self._wake.set()  # its first order comes with the next round
        return session

    async def pending_commands(self) -> int:
        _, entries = await self.store.read_prefix(self.store.keys.releases_prefix())
        return len(entries)
