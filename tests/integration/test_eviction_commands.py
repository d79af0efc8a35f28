"""The eviction command channel against real etcd and real gRPC streams."""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import pytest
from aetcd import rpc

from kvplane.services.common.model import convert
from kvplane.services.common.model.handles import ReleaseReason
from kvplane.services.common.store import Store
from kvplane.services.common.store.settings import StoreSettings
from kvplane.services.dev.local_etcd import LocalEtcd
from kvplane.services.process import ServiceProcess
from kvplane.v1 import eviction_pb2, eviction_pb2_grpc, handle_pb2
from tests.conftest import NODE_HEADERS, make_node
from tests.support.eviction_nodes import CommandNode, coordinator_of, start_replica, target_of
from tests.support.factories import make_handle
from tests.support.polling import eventually

NO_POLICY: dict[str, list[object]] = {"policies": []}


@pytest.fixture
async def replica(etcd: LocalEtcd, prefix: str) -> AsyncIterator[ServiceProcess]:
    process = await start_replica(etcd, prefix, policy=NO_POLICY)
    try:
        await eventually(_leads(process), what="the replica to lead")
        yield process
    finally:
        await process.stop()


def _leads(process: ServiceProcess):  # type: ignore[no-untyped-def]
    async def probe() -> bool:
        return coordinator_of(process).is_leader

    return probe


async def _publish(store: Store, node, count: int, tenant: str = "acme") -> list[str]:  # type: ignore[no-untyped-def]
    conversations = []
    for i in range(count):
        conversation = f"conv-{i}-{uuid.uuid4().hex[:6]}"
        await store.publish_handle(make_handle(node, tenant, conversation))
        conversations.append(conversation)
    return conversations


async def test_end_conversation_release_reaches_the_node_within_a_second(
    store: Store, replica: ServiceProcess
) -> None:
    node = make_node("d0")
    await store.register_node(node, 30)
    [conversation] = await _publish(store, node, 1)
    agent = CommandNode(node.node_id, node.incarnation, [target_of(replica)])
    agent.start()
    try:
        await eventually(lambda: _true(agent.connected), what="the node's stream")
        started = time.monotonic()
        pending = await store.release("acme", conversation, ReleaseReason.CONVERSATION_ENDED)
        await eventually(
            lambda: _true(pending.command_id in agent.applied),
            timeout_s=1.0,
            interval_s=0.01,
            what="the release command at the node",
        )
        elapsed = time.monotonic() - started
        assert elapsed < 1.0
        applied = agent.applied[pending.command_id]
        assert applied.conversation == conversation
        assert applied.remote_request_id == pending.handle.vllm.remote_request_id
        assert applied.reason == handle_pb2.RELEASE_REASON_CONVERSATION_ENDED
        # The ack deletes the outbox entry and, in the same request, records the blocks freed:
        # the command said so, and the node sends no report of them.
        await eventually(lambda: _empty(store.pending_releases(node.node_id)), what="the outbox to empty")
        tombstone = store.keys.freed(node.node_id, node.incarnation, applied.remote_request_id)
        assert await store.etcd.exists(tombstone)
    finally:
        await agent.stop()


async def test_a_standby_answers_unavailable_and_reports_the_leader(
    etcd: LocalEtcd, prefix: str, replica: ServiceProcess
) -> None:
    standby = await start_replica(etcd, prefix, policy=NO_POLICY)
    try:
        async with grpc.aio.insecure_channel(target_of(standby)) as channel:
            stub = eviction_pb2_grpc.EvictionServiceStub(channel)
            hello = eviction_pb2.CommandsRequest(hello=eviction_pb2.NodeHello(node_id="d0", incarnation="i0"))
            call = stub.Commands(iter([hello]), metadata=NODE_HEADERS)
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                async for _ in call:
                    pass
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
            status = await stub.GetStatus(eviction_pb2.GetStatusRequest(), metadata=NODE_HEADERS)
            assert not status.leader
            assert status.leader_id == coordinator_of(replica).replica_id
        async with grpc.aio.insecure_channel(target_of(replica)) as channel:
            status = await eviction_pb2_grpc.EvictionServiceStub(channel).GetStatus(
                eviction_pb2.GetStatusRequest(), metadata=NODE_HEADERS
            )
            assert status.leader
    finally:
        await standby.stop()


async def test_a_node_that_reconnects_converges_with_one_that_never_left(
    store: Store, replica: ServiceProcess
) -> None:
    steady_node, flaky_node = make_node("steady"), make_node("flaky")
    for n in (steady_node, flaky_node):
        await store.register_node(n, 30)
    steady_convs = await _publish(store, steady_node, 12)
    flaky_convs = await _publish(store, flaky_node, 12)
    target = [target_of(replica)]
    steady = CommandNode(steady_node.node_id, steady_node.incarnation, target)
    # The flaky node applies what it receives but loses its acks the first time.
    flaky = CommandNode(flaky_node.node_id, flaky_node.incarnation, target, ack=False)
    steady.start()
    flaky.start()
    try:
        await eventually(lambda: _true(steady.connected and flaky.connected), what="both streams")
        for convs in (steady_convs[:4], flaky_convs[:4]):
            for c in convs:
                await store.release("acme", c, ReleaseReason.CONVERSATION_ENDED)
        await eventually(
            lambda: _true(len(flaky.applied) == 4 and len(steady.applied) == 4), what="first releases"
        )
        await flaky.disconnect()
        # Released while the flaky node is away.
        for convs in (steady_convs[4:8], flaky_convs[4:8]):
            for c in convs:
                await store.release("acme", c, ReleaseReason.CONVERSATION_ENDED)
        flaky.ack = True
        flaky.start()
        await eventually(lambda: _true(flaky.connected), what="the reconnect")
        for convs in (steady_convs[8:], flaky_convs[8:]):
            for c in convs:
                await store.release("acme", c, ReleaseReason.CONVERSATION_ENDED)

        def suffixes(agent: CommandNode) -> list[str]:
            return sorted(c.split("-", 2)[1] for _, c in agent.released_conversations())

        await eventually(
            lambda: _true(len(flaky.applied) == 12 and len(steady.applied) == 12), what="all releases"
        )
        await eventually(
            lambda: _empty(store.pending_releases(flaky_node.node_id)), what="flaky outbox empty"
        )
        await eventually(
            lambda: _empty(store.pending_releases(steady_node.node_id)), what="steady outbox empty"
        )
        # Same state: every conversation released exactly once on each node.
        assert suffixes(flaky) == suffixes(steady)
        assert set(flaky.released_handles.values()) == {1}
        assert set(steady.released_handles.values()) == {1}
        # The unacknowledged first four were sent again after the reconnect,
        # and not applied twice.
        assert len(flaky.received) > len(flaky.applied)
    finally:
        await steady.stop()
        await flaky.stop()


async def test_a_draining_node_gets_a_drain_command_and_loses_its_handles(
    store: Store, replica: ServiceProcess
) -> None:
    node = make_node("d0")
    await store.register_node(node, 30)
    convs = await _publish(store, node, 5)
    agent = CommandNode(node.node_id, node.incarnation, [target_of(replica)])
    agent.start()
    try:
        await eventually(lambda: _true(agent.connected), what="the node's stream")
        await store.set_draining(node.node_id)
        await eventually(lambda: _true(len(agent.drains) == 1), what="the drain command")
        await eventually(lambda: _true(len(agent.applied) == 5), what="every handle released")
        assert {c for _, c in agent.released_conversations()} == set(convs)
        assert {a.reason for a in agent.applied.values()} == {handle_pb2.RELEASE_REASON_DRAIN}
        for c in convs:
            assert await store.get_handle_record("acme", c) is None
    finally:
        await agent.stop()


async def test_a_dead_nodes_handles_are_purged_when_its_lease_goes(
    store: Store, replica: ServiceProcess
) -> None:
    node = make_node("d0")
    lease = await store.register_node(node, 30)
    convs = await _publish(store, node, 3)
    await store.revoke_lease(lease)
    for c in convs:
        await eventually(_handle_gone(store, c), what="the purge")
    assert await store.orphaned_nodes() == set()


async def test_orphans_left_while_no_leader_ran_are_swept_by_the_next_leader(
    etcd: LocalEtcd, prefix: str, store: Store
) -> None:
    node = make_node("d0")
    lease = await store.register_node(node, 30)
    convs = await _publish(store, node, 3)
    await store.revoke_lease(lease)
    assert await store.orphaned_nodes() == {(node.node_id, node.incarnation)}
    process = await start_replica(etcd, prefix, policy=NO_POLICY)
    try:
        await eventually(_orphans_gone(store), what="the orphan sweep")
        for c in convs:
            assert await store.get_handle_record("acme", c) is None
    finally:
        await process.stop()


def _orphans_gone(store: Store):  # type: ignore[no-untyped-def]
    async def probe() -> bool:
        return await store.orphaned_nodes() == set()

    return probe


async def _true(value: bool) -> bool:
    return value


async def _empty(awaitable) -> bool:  # type: ignore[no-untyped-def]
    return not await awaitable


def _handle_gone(store: Store, conversation: str) -> Callable[[], Awaitable[bool]]:
    async def probe() -> bool:
        return await store.get_handle_record("acme", conversation) is None

    return probe


async def test_a_restart_seen_only_on_the_watch_still_retires_the_old_incarnation(
    etcd: LocalEtcd, prefix: str, store: Store
) -> None:
    # No periodic sweep within the test: only the watch can act.
    replica = await start_replica(etcd, prefix, policy=NO_POLICY, orphan_sweep_interval_s=300)
    await eventually(_leads(replica), what="the replica to lead")
    try:
        await _restart_behind_the_stores_back(store)
    finally:
        await replica.stop()


async def _restart_behind_the_stores_back(store: Store) -> None:
    old = make_node("d0")
    await store.register_node(old, 30)
    convs = await _publish(store, old, 3)
    # The node comes back as a new incarnation, written without the purge
    # that register_node does (as if its registrar died half-way): only the
    # coordinator's watch of the node key can retire the old handles.
    new = dataclasses.replace(old, incarnation=uuid.uuid4().hex)
    lease = await store.grant_lease(30)
    put = rpc.RequestOp(
        request_put=rpc.PutRequest(
            key=store.keys.node(new.node_id), value=convert.node_to_pb(new).SerializeToString(), lease=lease
        )
    )
    await store.etcd.txn("test_put_node", [], [put])
    for c in convs:
        await eventually(_handle_gone(store, c), what="the old incarnation's purge")


async def test_the_leader_rides_out_an_etcd_restart_and_keeps_delivering() -> None:
    # Its own etcd: restarting the shared one would disturb other tests.
    with LocalEtcd() as own:
        prefix = f"/kvplane-test/{uuid.uuid4().hex}/"
        store = Store(StoreSettings(endpoints=(own.endpoint,), prefix=prefix))
        await store.connect()
        process = await start_replica(own, prefix, policy=NO_POLICY)
        node = make_node("d0")
        agent = CommandNode(node.node_id, node.incarnation, [target_of(process)])
        try:
            await eventually(_leads(process), what="the replica to lead")
            await store.register_node(node, 60)
            convs = await _publish(store, node, 2)
            agent.start()
            await eventually(lambda: _true(agent.connected), what="the node's stream")
            first = await store.release("acme", convs[0], ReleaseReason.CONVERSATION_ENDED)
            await eventually(lambda: _true(first.command_id in agent.applied), what="the first release")
            own.restart()
            # Whoever leads after the restart (the lease may have lapsed, and
            # the replica campaigned again) still delivers the next release.
            second = await eventually(
                lambda: store.release("acme", convs[1], ReleaseReason.CONVERSATION_ENDED),
                timeout_s=30,
                what="etcd back",
            )
            await eventually(
                lambda: _true(second.command_id in agent.applied),
                timeout_s=30,
                what="the release after the restart",
            )
            await eventually(_leads(process), what="the replica to lead again")
            assert set(agent.released_handles.values()) == {1}
        finally:
            await agent.stop()
            await process.stop()
            await store.close()
