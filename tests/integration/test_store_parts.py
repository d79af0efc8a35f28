"""Each of the store's parts on its own, against the real etcd: the fencing ops, watches, nodes,
handles, claims, releases, elections and suspect marks. Each part is built from the store's
plumbing (its etcd client, key layout, leases), as `Store` builds it."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from kvplane.services.common.model.errors import HandleNotRetained, NodeNotRegistered, NotFound
from kvplane.services.common.model.handles import ReleaseReason
from kvplane.services.common.model.nodes import Node
from kvplane.services.common.model.suspects import NodeSuspect
from kvplane.services.common.store import Store, fencing
from kvplane.services.common.store.claim_store import ClaimStore
from kvplane.services.common.store.election_store import ElectionStore
from kvplane.services.common.store.handle_store import HandleStore
from kvplane.services.common.store.node_store import NodeStore
from kvplane.services.common.store.records import HandleRecord, now_ms
from kvplane.services.common.store.release_store import ReleaseStore
from kvplane.services.common.store.suspect_store import SuspectStore
from kvplane.services.common.store.watches import Watches, WatchEvent
from kvplane.v1 import handle_pb2, node_pb2
from tests.conftest import make_node
from tests.support.factories import make_handle


def _releases(store: Store) -> ReleaseStore:
    return ReleaseStore(store.etcd, store.keys, store.telemetry, store.leases)


def _handles(store: Store) -> HandleStore:
    return HandleStore(store.etcd, store.keys, store.leases, _releases(store), store.telemetry)


def _nodes(store: Store) -> NodeStore:
    return NodeStore(store.etcd, store.keys, store.leases, _releases(store))


async def _retained(
    store: Store, conversation: str = "c1", node: Node | None = None, life_ms: int = 120_000
) -> HandleRecord:
    if node is None:
        node = make_node("d-parts")
        await _nodes(store).register(node, 30)
    await _handles(store).publish(
        make_handle(node, conversation=conversation, request_id=f"req-{conversation}", life_ms=life_ms)
    )
    record = await _handles(store).get_record("acme", conversation)
    assert record is not None
    return record


# --- fencing ------------------------------------------------------------------------------------


async def test_same_revision_fences_a_write_on_nobody_having_written_the_key_since(store: Store) -> None:
    key = store.keys.prefix.encode() + b"fenced"
    created = await store.etcd.write("t", [fencing.absent(key)], [fencing.put(key, b"1")])
    assert created.succeeded
    again = await store.etcd.write("t", [fencing.absent(key)], [fencing.put(key, b"2")])
    assert not again.succeeded, "absent holds only while the key does not exist"

    revision = int(created.header.revision)
    assert (
        await store.etcd.write("t", [fencing.same_revision(key, revision)], [fencing.put(key, b"3")])
    ).succeeded
    stale = await store.etcd.write(
        "t", [fencing.same_revision(key, revision)], [fencing.delete(key)], [fencing.get(key)]
    )
    assert not stale.succeeded, "the key changed since `revision`"
    assert stale.responses[0].response_range.kvs[0].value == b"3"


# --- watches ------------------------------------------------------------------------------------


async def test_a_watch_from_the_read_revision_sees_puts_and_deletes_with_the_previous_value(
    store: Store,
) -> None:
    watches = Watches(store.etcd)
    prefix = store.keys.prefix.encode() + b"watched/"
    await store.etcd.write("t", [], [fencing.put(prefix + b"a", b"1")])
    revision, events = await watches.read_prefix(prefix)
    assert [(e.key, e.value, e.deleted) for e in events] == [(prefix + b"a", b"1", False)]

    seen: list[WatchEvent] = []

    async def follow() -> None:
        async for batch in watches.watch_prefix(prefix, revision + 1):
            seen.extend(batch)
            if len(seen) >= 2:
                return

    following = asyncio.create_task(follow())
    await store.etcd.write("t", [], [fencing.put(prefix + b"b", b"2")])
    await store.etcd.write("t", [], [fencing.delete(prefix + b"a")])
    await asyncio.wait_for(following, 30)
    assert [(e.key, e.deleted, e.prev_value) for e in seen] == [
        (prefix + b"b", False, b""),
        (prefix + b"a", True, b"1"),
    ]


# --- nodes --------------------------------------------------------------------------------------


async def test_a_node_registers_drains_and_deregisters(store: Store) -> None:
    nodes = _nodes(store)
    node = make_node("d-life")
    await nodes.register(node, 30)
    record = await nodes.registered("d-life", node.incarnation)
    assert record.node.incarnation == node.incarnation and not record.node.draining

    assert (await nodes.set_draining("d-life")).draining
    _, listed = await nodes.list_nodes()
    assert [(r.node.node_id, r.node.draining) for r, _ in listed] == [("d-life", True)]

    await nodes.deregister("d-life", node.incarnation)
    assert await nodes.get("d-life") is None
    with pytest.raises(NodeNotRegistered):
        await nodes.registered("d-life", node.incarnation)


async def test_a_new_incarnation_retires_the_old_ones_handles(store: Store) -> None:
    record = await _retained(store)
    nodes = _nodes(store)
    restarted = replace(make_node("d-parts"), incarnation="second")
    await nodes.register(restarted, 30)
    assert await _handles(store).get_record("acme", "c1") is None
    assert record.handle.holder_incarnation != "second"


async def test_handles_of_an_unregistered_node_are_orphaned(store: Store) -> None:
    record = await _retained(store)
    nodes = _nodes(store)
    assert await nodes.orphaned_nodes() == set()
    registered = await nodes.get("d-parts")
    assert registered is not None
    await store.leases.revoke(registered.lease)  # the node's registration lapses; its handle's index stays
    assert await nodes.orphaned_nodes() == {("d-parts", record.handle.holder_incarnation)}


# --- handles ------------------------------------------------------------------------------------


async def test_a_published_handle_is_read_back_and_listed(store: Store) -> None:
    record = await _retained(store, "c-listed")
    assert record.handle.conversation == "c-listed" and record.lease > 0
    listed, _ = await _handles(store).list(tenant="acme")
    assert [h.conversation for h in listed] == ["c-listed"]


async def test_a_publish_replacing_a_retained_handle_queues_its_release(store: Store) -> None:
    first = await _retained(store, "c-replaced")
    node = make_node("d-parts", incarnation=first.handle.holder_incarnation)
    outcome = await _handles(store).publish(make_handle(node, conversation="c-replaced", request_id="newer"))
    assert outcome.superseded is not None
    assert outcome.superseded.handle.vllm.remote_request_id == first.handle.vllm.remote_request_id
    assert outcome.superseded.reason == ReleaseReason.SUPERSEDED


# --- claims -------------------------------------------------------------------------------------


async def test_a_handle_is_checked_out_once(store: Store) -> None:
    record = await _retained(store)
    claims = ClaimStore(store.etcd, store.keys, store.telemetry, store.releases)
    won = await claims.check_out("acme", "c1", record, route_id="r1")
    assert won.handle == record.handle and won.claim_id
    assert handle_pb2.CacheHandle.FromString(won.handle_pb).conversation == "c1"
    with pytest.raises(HandleNotRetained):
        await claims.check_out("acme", "c1", record)
    latest = await claims.latest("acme", "c1")
    assert latest is not None and latest.claim_id == won.claim_id and latest.route_id == "r1"


async def test_an_expired_handle_is_not_checked_out(store: Store) -> None:
    record = await _retained(store, life_ms=120_000)
    expired = replace(record, handle=replace(record.handle, wall_expiry_unix_ms=now_ms() - 1))
    with pytest.raises(NotFound):
        await ClaimStore(store.etcd, store.keys, store.telemetry, store.releases).check_out(
            "acme", "c1", expired
        )


async def test_a_claim_unused_past_the_deadline_is_released_to_its_holder(store: Store) -> None:
    record = await _retained(store)
    claims = ClaimStore(store.etcd, store.keys, store.telemetry, store.releases)
    await claims.check_out("acme", "c1", record)
    assert await claims.release_unused(60_000, now_ms()) == []
    released = await claims.release_unused(60_000, now_ms() + 60_001)
    assert [p.reason for p in released] == [ReleaseReason.CLAIM_UNUSED]
    assert [p.command_id for p, _ in await _releases(store).pending_releases("d-parts")] == [
        released[0].command_id
    ]


# --- releases -----------------------------------------------------------------------------------


async def test_a_retained_handle_is_released_once_and_its_command_acknowledged(store: Store) -> None:
    record = await _retained(store)
    releases = _releases(store)
    pending = await releases.release("acme", "c1", record, ReleaseReason.MAX_AGE)
    assert pending.reason == ReleaseReason.MAX_AGE
    with pytest.raises(HandleNotRetained):
        await releases.release("acme", "c1", record, ReleaseReason.MAX_AGE)
    assert [p.command_id for p, _ in await releases.pending_releases("d-parts")] == [pending.command_id]

    await releases.ack_release("d-parts", pending.command_id)
    assert await releases.pending_releases("d-parts") == []


async def test_a_checked_out_handle_is_never_released(store: Store) -> None:
    record = await _retained(store)
    await ClaimStore(store.etcd, store.keys, store.telemetry, store.releases).check_out("acme", "c1", record)
    with pytest.raises(HandleNotRetained):
        await _releases(store).release("acme", "c1", record, ReleaseReason.NODE_BUDGET)


async def test_blocks_nothing_references_are_unreferenced(store: Store) -> None:
    record = await _retained(store)
    releases = _releases(store)
    held = record.handle.vllm.remote_request_id
    incarnation = record.handle.holder_incarnation
    assert await releases.unreferenced("d-parts", incarnation, [held, "stray"]) == ["stray"]


async def test_blocks_the_engine_freed_drop_the_handle_naming_them(store: Store) -> None:
    record = await _retained(store)
    releases = _releases(store)
    removed = await releases.release_freed(
        "d-parts", record.handle.holder_incarnation, [record.handle.vllm.remote_request_id]
    )
    assert removed == 1
    assert await _handles(store).get_record("acme", "c1") is None
    assert await releases.pending_releases("d-parts") == [], "freed blocks need no command"


async def test_purging_a_node_drops_its_handles_and_its_queued_commands(store: Store) -> None:
    node = make_node("d-parts")
    await _nodes(store).register(node, 30)
    first = await _retained(store, "c-a", node)
    second = await _retained(store, "c-b", node)
    releases = _releases(store)
    await releases.release("acme", "c-b", second, ReleaseReason.MAX_AGE)
    removed = await releases.purge_node("d-parts", first.handle.holder_incarnation, ReleaseReason.HOLDER_DOWN)
    assert removed == 1
    assert await _handles(store).get_record("acme", "c-a") is None
    assert await releases.pending_releases("d-parts") == []


# --- elections and suspects ---------------------------------------------------------------------


async def test_the_first_campaign_wins_and_a_standby_takes_over_when_its_lease_ends(store: Store) -> None:
    elections = ElectionStore(store.etcd, store.keys)
    assert await elections.leader("evict") is None
    first, second = await store.leases.grant(30), await store.leases.grant(30)

    won = await elections.campaign("evict", "a", first)
    lost = await elections.campaign("evict", "b", second)
    assert (won.candidate, won.lease) == ("a", first)
    assert (lost.candidate, lost.lease) == ("a", first), "the standby learns who leads"

    await store.leases.revoke(first)
    taken = await elections.campaign("evict", "b", second)
    assert (taken.candidate, taken.lease) == ("b", second)
    leader = await elections.leader("evict")
    assert leader is not None and leader.candidate == "b"


async def test_a_suspect_mark_is_stored_under_the_node_and_a_newer_one_replaces_it(store: Store) -> None:
    suspects = SuspectStore(store.etcd, store.keys, store.leases)
    await suspects.mark(NodeSuspect("d0", "inc-1", 1_000, "timeout"), ttl_s=30)
    await suspects.mark(NodeSuspect("d0", "inc-1", 2_000, "refused"), ttl_s=30)
    _, events = await Watches(store.etcd).read_prefix(store.keys.suspects_prefix())
    assert len(events) == 1 and events[0].key == store.keys.suspect("d0") and events[0].lease > 0
    stored = NodeSuspect.from_pb(node_pb2.NodeSuspect.FromString(events[0].value))
    assert (stored.marked_unix_ms, stored.reason) == (2_000, "refused")
