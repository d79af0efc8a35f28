"""The eviction coordinator's parts on their own, against the real etcd: the watch-fed cluster view
it decides over, its leader election, the releaser that carries decisions out (and its metrics),
the node command sessions and their outbox, and metadata's sweep of claims nobody used."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from prometheus_client import CollectorRegistry

from kvplane.services.common.model.handles import ReleaseReason
from kvplane.services.common.model.nodes import Node
from kvplane.services.common.runtime.telemetry import Telemetry
from kvplane.services.common.store import Store
from kvplane.services.common.store.cluster_view import ClusterView, HandleChange, NodeChange
from kvplane.services.common.store.records import HandleRecord
from kvplane.services.eviction.election import LeaderElection, Term
from kvplane.services.eviction.metrics import EvictionMetrics
from kvplane.services.eviction.policy.model import Release
from kvplane.services.eviction.releaser import Releaser
from kvplane.services.eviction.sessions import NodeSession, SessionClosed, SessionRegistry
from kvplane.services.eviction.spill_order import NodeSpillOrder, TierOrder
from kvplane.services.metadata.claim_reaper import ClaimReaper
from kvplane.v1 import eviction_pb2
from tests.conftest import make_node
from tests.support.factories import make_handle
from tests.support.polling import eventually


@pytest.fixture
async def view(store: Store) -> AsyncIterator[ClusterView]:
    v = ClusterView(store)
    v.start()
    await asyncio.wait_for(v.ready.wait(), 30)
    try:
        yield v
    finally:
        await v.stop()


async def _node(store: Store) -> Node:
    """The test's decode node, registered once."""
    record = await store.get_node("d-ev")
    if record is not None:
        return record.node
    node = make_node("d-ev")
    await store.register_node(node, 30)
    return node


async def _publish(store: Store, conversation: str = "c1", nbytes: int = 1 << 20) -> HandleRecord:
    node = await _node(store)
    handle = make_handle(
        node, conversation=conversation, request_id=f"req-{conversation}", retained_bytes=nbytes
    )
    await store.publish_handle(handle)
    record = await store.get_handle_record("acme", conversation)
    assert record is not None
    return record


def _term(active: bool = True) -> Term:
    return Term("r1", lease=0, ttl_s=10, valid_until=time.monotonic() + (3600 if active else -1))


def _release(record: HandleRecord, reason: ReleaseReason = ReleaseReason.MAX_AGE) -> Release:
    h = record.handle
    return Release(
        h.tenant, h.conversation, h.handle_id, h.holder_node_id, reason, "max_age", "old", h.retained_bytes
    )


# --- the cluster view ---------------------------------------------------------------------------


async def test_the_view_loads_what_is_there_and_follows_changes(store: Store) -> None:
    before = await _publish(store, "c-before")
    view = ClusterView(store)
    handle_changes: list[HandleChange] = []
    node_changes: list[NodeChange] = []
    view.on_handle_change(handle_changes.append)
    view.on_node_change(node_changes.append)
    view.start()
    try:
        await asyncio.wait_for(view.ready.wait(), 30)
        assert view.healthy
        record = view.handle("acme", "c-before")
        assert record is not None and record.handle.handle_id == before.handle.handle_id
        node = view.nodes["d-ev"].node
        assert view.live_node("d-ev", node.incarnation) == node
        assert view.live_node("d-ev", "another incarnation") is None
        del handle_changes[:], node_changes[:]  # what the snapshot loaded

        after = await _publish(store, "c-after")
        assert await view.wait_for(lambda: view.handle("acme", "c-after") is not None, 30)
        await store.check_out("acme", "c-before")
        assert await view.wait_for(lambda: view.handle("acme", "c-before") is None, 30)
        assert [(c.key, c.current is not None) for c in handle_changes] == [
            (("acme", "c-after"), True),
            (("acme", "c-before"), False),
        ]
        assert handle_changes[1].previous is not None
        assert handle_changes[1].previous.handle_id == before.handle.handle_id
        assert after.handle.handle_id == view.handles[("acme", "c-after")].handle.handle_id

        await store.deregister_node("d-ev", node.incarnation)
        assert await view.wait_for(lambda: "d-ev" not in view.nodes, 30)
        assert [(c.node_id, c.current) for c in node_changes][-1] == ("d-ev", None)
    finally:
        await view.stop()


# --- leader election ----------------------------------------------------------------------------


async def test_one_replica_leads_and_a_standby_takes_over_when_it_resigns(store: Store) -> None:
    first = LeaderElection(store, "evict", "replica-a", ttl_s=10)
    second = LeaderElection(store, "evict", "replica-b", ttl_s=10)
    term = await asyncio.wait_for(first.campaign(), 30)
    assert term.active and term.replica_id == "replica-a"

    standby = asyncio.create_task(second.campaign())
    await eventually(_true(lambda: second.leader_id == "replica-a"), timeout_s=30, what="the standby saw a")
    assert not standby.done()

    await first.resign(term)
    assert not term.active
    taken = await asyncio.wait_for(standby, 30)
    try:
        assert taken.active and taken.replica_id == "replica-b"
        leader = await store.election_leader("evict")
        assert leader is not None and leader.candidate == "replica-b"
    finally:
        await second.stop(taken)


async def test_a_leader_whose_lease_is_gone_stands_down(store: Store) -> None:
    election = LeaderElection(store, "evict", "replica-a", ttl_s=2)
    term = await asyncio.wait_for(election.campaign(), 30)
    await store.revoke_lease(term.lease)
    await asyncio.wait_for(term.lost.wait(), 30)
    assert not term.active
    await election.stop(None)


def test_an_election_lease_under_two_seconds_is_refused(store: Store) -> None:
    with pytest.raises(ValueError, match="at least 2 s"):
        LeaderElection(store, "evict", "replica-a", ttl_s=1)


def _true(predicate: Callable[[], bool]) -> Callable[[], Awaitable[bool]]:
    async def probe() -> bool:
        return predicate()

    return probe


# --- the releaser and its metrics ---------------------------------------------------------------


def _releaser(store: Store, view: ClusterView) -> tuple[Releaser, CollectorRegistry]:
    registry = CollectorRegistry()
    metrics = EvictionMetrics.create(registry)
    return Releaser(store, view, metrics, Telemetry.disabled(), concurrency=4), registry


async def test_a_decision_on_the_retained_handle_releases_it_and_queues_the_command(
    store: Store, view: ClusterView
) -> None:
    record = await _publish(store, nbytes=3000)
    assert await view.wait_for(lambda: view.handle("acme", "c1") is not None, 30)
    releaser, registry = _releaser(store, view)
    before_ms = int(time.time() * 1000) - 1

    outcome = await releaser.apply([_release(record)], _term())

    assert (outcome.released, outcome.conflicts, outcome.stale, outcome.failed) == (1, 0, 0, 0)
    assert await store.get_handle_record("acme", "c1") is None
    commands = await store.pending_releases("d-ev")
    assert [(p.handle.handle_id, p.reason) for p, _ in commands] == [
        (record.handle.handle_id, ReleaseReason.MAX_AGE)
    ]
    assert releaser.freed_since("d-ev", before_ms) == 3000
    assert (
        registry.get_sample_value(
            "kvplane_eviction_releases_total", {"reason": "max_age", "policy": "max_age"}
        )
        == 1.0
    )


async def test_a_decision_on_a_handle_checked_out_meanwhile_is_a_conflict(
    store: Store, view: ClusterView
) -> None:
    record = await _publish(store)
    assert await view.wait_for(lambda: view.handle("acme", "c1") is not None, 30)
    await view.stop()  # the view still shows the handle retained...
    await store.check_out("acme", "c1")  # ...when it is checked out
    releaser, registry = _releaser(store, view)

    outcome = await releaser.apply([_release(record)], _term())

    assert outcome.conflicts == 1 and outcome.released == 0
    assert await store.pending_releases("d-ev") == []
    assert registry.get_sample_value("kvplane_eviction_release_conflicts_total", {"reason": "max_age"}) == 1.0


async def test_decisions_of_an_ended_term_or_on_another_handle_are_stale(
    store: Store, view: ClusterView
) -> None:
    record = await _publish(store)
    assert await view.wait_for(lambda: view.handle("acme", "c1") is not None, 30)
    releaser, _ = _releaser(store, view)
    other = Release("acme", "c1", "not-the-handle", "d-ev", ReleaseReason.MAX_AGE, "max_age")

    outcome = await releaser.apply([_release(record)], _term(active=False))
    assert outcome.stale == 1
    assert (await releaser.apply([other], _term())).stale == 1
    assert await store.get_handle_record("acme", "c1") is not None


async def test_released_bytes_count_against_demand_reports_until_acknowledged(
    store: Store, view: ClusterView
) -> None:
    record = await _publish(store, nbytes=4096)
    assert await view.wait_for(lambda: view.handle("acme", "c1") is not None, 30)
    releaser, _ = _releaser(store, view)
    await releaser.apply([_release(record)], _term())
    ((pending, _),) = await store.pending_releases("d-ev")

    reported_before_ack = time.monotonic()
    assert releaser.bytes_unseen_by("d-ev", reported_before_ack) == 4096
    releaser.acknowledged("d-ev", pending.command_id)
    assert releaser.bytes_unseen_by("d-ev", reported_before_ack) == 4096, "the report predates the ack"
    assert releaser.bytes_unseen_by("d-ev", time.monotonic()) == 0


# --- metadata's claim reaper --------------------------------------------------------------------


async def test_the_claim_reaper_releases_a_claim_nobody_used(store: Store) -> None:
    record = await _publish(store)
    await store.check_out("acme", "c1")
    reaper = ClaimReaper(store, deadline_s=0.0, interval_s=0.05)
    await reaper.start()
    try:

        async def released() -> bool:
            return bool(await store.pending_releases("d-ev"))

        await eventually(released, timeout_s=30, what="the unused claim released")
    finally:
        await reaper.stop()
    ((pending, _),) = await store.pending_releases("d-ev")
    assert (pending.handle.handle_id, pending.reason) == (record.handle.handle_id, ReleaseReason.CLAIM_UNUSED)


# --- node command sessions and their outbox -----------------------------------------------------


async def _queued_release(store: Store, conversation: str) -> str:
    """A release queued for d-ev (its outbox entry), by the store's fenced release."""
    await _publish(store, conversation)
    return (await store.release("acme", conversation, ReleaseReason.MAX_AGE)).command_id


async def test_a_session_replays_the_outbox_then_follows_it_and_an_ack_deletes_the_entry(
    store: Store,
) -> None:
    earlier = await _queued_release(store, "c-away")  # written while the node was away
    node = await _node(store)
    registry = SessionRegistry(store, EvictionMetrics.create(CollectorRegistry()))
    session = registry.open("d-ev", node.incarnation)
    try:
        first = await asyncio.wait_for(session.next_command(), 30)
        assert first.command_id == earlier and first.release.conversation == "c-away"
        later = await _queued_release(store, "c-later")
        second = await asyncio.wait_for(session.next_command(), 30)
        assert second.command_id == later and session.unacked == 2

        await session.acknowledge(eviction_pb2.CommandAck(command_id=earlier, ok=True))
        assert [p.command_id for p, _ in await store.pending_releases("d-ev")] == [later]
        await session.acknowledge(eviction_pb2.CommandAck(command_id=earlier, ok=True))  # a duplicate
        assert session.unacked == 1 and session.acked == 1
    finally:
        registry.close_all("test over")
        await registry.wait_closed()


async def test_a_session_offers_only_its_own_incarnations_commands_once(store: Store) -> None:
    await _queued_release(store, "c1")
    ((pending, _),) = await store.pending_releases("d-ev")
    session = NodeSession("d-ev", "another incarnation", store, EvictionMetrics.create(CollectorRegistry()))
    assert not session.offer_release(pending), "another incarnation's blocks are gone with it"
    own = NodeSession(
        "d-ev", pending.handle.holder_incarnation, store, EvictionMetrics.create(CollectorRegistry())
    )
    assert own.offer_release(pending) and not own.offer_release(pending)
    assert own.offer_drain() and not own.offer_drain(), "one drain per incarnation"
    assert own.unacked == 2


async def test_a_spill_order_goes_only_to_a_node_that_asked_and_only_when_it_changes(store: Store) -> None:
    metrics = EvictionMetrics.create(CollectorRegistry())
    worth = {"old": 1.0, "young": 0.2, "new": 1.0, "h1": 1.0}
    host = TierOrder(("h1",), ("h1",), worth)
    order = NodeSpillOrder(TierOrder(("young", "old"), ("old", "young"), worth), host)
    plain = NodeSession("d-ev", "inc", store, metrics)
    assert not plain.offer_spill_order(order), "a node without a host tier never asked"

    session = NodeSession("d-ev", "inc", store, metrics, wants_spill_order=True)
    assert session.offer_spill_order(order)
    command = await session.next_command()
    assert command.command_id == "" and command.WhichOneof("command") == "spill_order"
    assert list(command.spill_order.device_request_ids) == ["young", "old"]
    assert list(command.spill_order.host_request_ids) == ["h1"]
    assert session.unacked == 0, "a hint awaits no ack"

    assert not session.offer_spill_order(order), "unchanged"
    joined = NodeSpillOrder(TierOrder(("young", "old", "new"), ("old", "young", "new"), worth), host)
    assert not session.offer_spill_order(joined), "a newer handle at the end: the node does that anyway"
    swapped_worth = {**worth, "old": 0.1}
    swapped = NodeSpillOrder(TierOrder(("old", "young"), ("old", "young"), swapped_worth), host)
    assert session.offer_spill_order(swapped)
    assert list((await session.next_command()).spill_order.device_request_ids) == ["old", "young"]
    session.close("test over")
    assert not session.offer_spill_order(order)


async def test_a_newer_stream_from_the_same_node_closes_the_older_session(store: Store) -> None:
    registry = SessionRegistry(store, EvictionMetrics.create(CollectorRegistry()))
    old = registry.open("d-ev", "inc")
    new = registry.open("d-ev", "inc")
    try:
        assert old.closed and not new.closed and registry.get("d-ev") is new and len(registry) == 1
        with pytest.raises(SessionClosed, match="replaced by a newer stream"):
            await asyncio.wait_for(old.next_command(), 30)
    finally:
        registry.close_all("test over")
        await registry.wait_closed()
    assert len(registry) == 0 and new.closed
