"""Moves in place of releases, for nodes with a host tier, by a real leader against real etcd.

A node whose hello accepts moves is sent a MoveCommand where the leader's policies want a
handle's KV-cache blocks back: the handle stays retained (the node relocates it when its copy
lands). A refused move becomes a release. Handles already in a host tier are not the policies'
to judge: their tier's TTL and room end them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator

from kvplane.services.common.model.handles import CacheHandle, KvTier
from kvplane.services.common.model.nodes import Node
from kvplane.services.common.store import Store
from kvplane.services.dev.local_etcd import LocalEtcd
from kvplane.services.eviction.mover import Mover
from kvplane.services.process import ServiceProcess
from kvplane.v1 import handle_pb2
from tests.conftest import make_node
from tests.integration.test_eviction_budgets import MB, aged_handle, lowest_value, retained_by
from tests.support.eviction_nodes import CommandNode, coordinator_of, start_replica, target_of
from tests.support.polling import eventually, until

# Long enough that a test slowed by a busy machine does not lose its node, and its handles with it.
_NODE_LEASE_S = 600
_BUDGET = {"policies": [{"name": "node_budget", "high_bytes": 150 * MB, "low_bytes": 100 * MB}]}


async def _twenty_handles(store: Store, node: Node) -> tuple[list[CacheHandle], set[str]]:
    """20 handles of 10 MB, idle 100 s to 2,000 s, and the 10 that bring the node under budget
    when the leader judges all of them at once."""
    published = []
    for i in range(20):
        outcome = await store.publish_handle(aged_handle(node, "acme", f"c{i:02d}", 100 + 100 * i, 10))
        published.append(outcome.handle)
    return published, lowest_value(published, 10, node.kv_capacity_bytes)


async def test_a_node_with_a_host_tier_is_sent_moves_and_keeps_every_handle(
    etcd: LocalEtcd, prefix: str, store: Store
) -> None:
    async with _leader_and_node(etcd, prefix, store, accepts_moves=True) as (_, replica, agent, handles):
        published, expected = handles
        await until(lambda: len(agent.moves) >= 10, "ten moves", timeout_s=30)
        moved = {m.conversation for m in agent.moves.values()}
        assert moved == expected, f"moved {sorted(moved)}, expected the lowest-value {sorted(expected)}"
        by_conversation = {h.conversation: h for h in published}
        for m in agent.moves.values():
            assert m.handle_id == by_conversation[m.conversation].handle_id
            assert m.remote_request_id == by_conversation[m.conversation].vllm.remote_request_id
            assert m.reason == handle_pb2.RELEASE_REASON_NODE_BUDGET
        # Nothing was released: every handle is still retained, and no command waits in etcd.
        assert not agent.applied
        assert len(await retained_by(store, node_id="d0")) == 20
        assert not await store.pending_releases("d0")
        coordinator = coordinator_of(replica)
        assert coordinator.metrics.moves.labels("node_budget", "node_budget")._value.get() == 10

        # Until the node relocates them, the moved count as freed: no more go, however often
        # the leader judges; nor is any handle moved twice.
        rounds = coordinator.evaluations
        await until(lambda: coordinator.evaluations >= rounds + 3, "more rounds")
        assert len(agent.moves) == 10 and not agent.applied

        # The node relocates one to its host tier: a host-tier handle is not judged again.
        first = next(iter(agent.moves.values()))
        old = by_conversation[first.conversation]
        relocated = await store.publish_handle(
            dataclasses.replace(old, handle_id="", tier=KvTier.HOST, relocates_handle_id=old.handle_id)
        )
        assert relocated.handle.tier is KvTier.HOST
        rounds = coordinator.evaluations
        await until(lambda: coordinator.evaluations >= rounds + 3, "rounds after it")
        assert len(agent.moves) == 10 and not agent.applied
        current = await store.get_handle("acme", first.conversation)
        assert current is not None and current.handle.tier is KvTier.HOST


async def test_a_move_the_node_never_answered_is_decided_afresh_when_it_reconnects(
    etcd: LocalEtcd, prefix: str, store: Store
) -> None:
    # The node takes each move but dies before its ack leaves.
    async with _leader_and_node(etcd, prefix, store, accepts_moves=True, ack=False) as (
        _,
        replica,
        agent,
        (_, expected),
    ):
        await until(lambda: len(agent.moves) >= 10, "ten moves", timeout_s=30)
        mover: Mover = coordinator_of(replica).mover
        assert mover.moving == 10
        first = dict(agent.moves)

        await agent.disconnect()
        await until(lambda: mover.moving == 0, "the unanswered moves forgotten")
        agent.ack = True
        agent.start()
        await until(lambda: len(agent.moves) >= 20, "the moves sent again", timeout_s=30)
        again = {m.conversation for i, m in agent.moves.items() if i not in first}
        assert again == expected and not agent.applied
        assert len(await retained_by(store, node_id="d0")) == 20


async def test_moves_that_come_to_nothing_at_different_times_all_become_releases(
    etcd: LocalEtcd, prefix: str, store: Store
) -> None:
    """The node starts six moves, and the other four only once the six are released: by then the
    node is between the budget's marks, where judging afresh would release nothing more. The
    leader's decision stands: each move that came to nothing is released."""
    async with _leader_and_node(etcd, prefix, store, accepts_moves=True, ack=False, move_settle_s=1.0) as (
        _,
        replica,
        agent,
        (_, expected),
    ):
        await until(lambda: len(agent.moves) >= 10, "ten moves", timeout_s=30)
        first, rest = list(agent.moves)[:6], list(agent.moves)[6:]
        for command_id in first:
            agent.acknowledge(command_id)
        await until(lambda: len(agent.applied) >= 6, "six releases", timeout_s=30)
        for command_id in rest:
            agent.acknowledge(command_id)
        await until(lambda: len(agent.applied) >= 10, "ten releases", timeout_s=30)
        assert {c for _, c in agent.released_conversations()} == expected
        assert set(agent.released_handles.values()) == {1}
        assert len(agent.moves) == 10 and coordinator_of(replica).mover.moving == 0


async def test_a_started_move_whose_handle_never_leaves_the_kv_cache_becomes_a_release(
    etcd: LocalEtcd, prefix: str, store: Store
) -> None:
    """The node acknowledges each move but never relocates a handle (its copy came to nothing):
    a second after, the leader releases them instead."""
    async with _leader_and_node(etcd, prefix, store, accepts_moves=True, move_settle_s=1.0) as (
        _,
        replica,
        agent,
        (_, expected),
    ):
        await until(lambda: len(agent.applied) >= 10, "ten releases", timeout_s=30)
        assert {c for _, c in agent.released_conversations()} == expected
        assert {m.conversation for m in agent.moves.values()} == expected
        assert len(agent.moves) == 10 and set(agent.released_handles.values()) == {1}
        assert coordinator_of(replica).mover.moving == 0


async def test_a_draining_node_that_takes_moves_has_every_handle_released(
    etcd: LocalEtcd, prefix: str, store: Store
) -> None:
    async with _leader_and_node(etcd, prefix, store, accepts_moves=True, twenty=False) as (node, _, agent, _):
        for i in range(3):
            await store.publish_handle(aged_handle(node, "acme", f"c{i}", 100, 10))
        await store.set_draining(node.node_id)
        await until(lambda: len(agent.applied) == 3, "every handle released")
        assert {a.reason for a in agent.applied.values()} == {handle_pb2.RELEASE_REASON_DRAIN}
        assert not agent.moves, "a drain ends handles; it never moves them"


async def test_a_refused_move_becomes_a_release(etcd: LocalEtcd, prefix: str, store: Store) -> None:
    async with _leader_and_node(etcd, prefix, store, accepts_moves=True, refuse_moves=True) as (
        _,
        _,
        agent,
        (_, expected),
    ):
        await until(lambda: len(agent.applied) >= 10, "ten releases", timeout_s=30)
        released = agent.released_conversations()
        assert {c for _, c in released} == expected
        assert {m.conversation for m in agent.moves.values()} == expected, "each was offered as a move first"
        assert len(agent.moves) == 10, "a refused move is never offered again"
        assert set(agent.released_handles.values()) == {1}
        left = await retained_by(store, node_id="d0")
        assert sum(h.retained_bytes for h in left) <= 100 * MB


async def test_a_node_without_moves_is_released_to_as_before(
    etcd: LocalEtcd, prefix: str, store: Store
) -> None:
    async with _leader_and_node(etcd, prefix, store) as (_, _, agent, (_, expected)):
        await until(lambda: len(agent.applied) >= 10, "ten releases", timeout_s=30)
        assert {c for _, c in agent.released_conversations()} == expected
        assert not agent.moves


async def test_the_age_limit_judges_kv_cache_handles_not_host_tier_ones(
    etcd: LocalEtcd, prefix: str, store: Store
) -> None:
    """Both handles are 1,000 s old, past D's TTL less its margin; the one in host memory is
    offered for an hour and stays."""
    node = make_node("d0")
    await store.register_node(node, _NODE_LEASE_S)
    device = aged_handle(node, "acme", "on-device", 1000, 10)
    await store.publish_handle(device)
    on_host = await store.publish_handle(aged_handle(node, "acme", "on-host", 1000, 10))
    await store.publish_handle(
        dataclasses.replace(
            on_host.handle,
            handle_id="",
            tier=KvTier.HOST,
            relocates_handle_id=on_host.handle.handle_id,
            wall_expiry_unix_ms=int(time.time() * 1000) + 3_600_000,
        )
    )
    replica = await start_replica(etcd, prefix, policy={"policies": [{"name": "max_age"}]})
    agent = CommandNode(node.node_id, node.incarnation, [target_of(replica)])
    agent.start()
    try:
        await until(lambda: len(agent.applied) >= 1, "the device handle's release", timeout_s=30)
        coordinator = coordinator_of(replica)
        rounds = coordinator.evaluations
        await until(lambda: coordinator.evaluations >= rounds + 3, "more rounds")
        assert agent.released_conversations() == {("acme", "on-device")}
        kept = await store.get_handle("acme", "on-host")
        assert kept is not None and kept.handle.tier is KvTier.HOST
    finally:
        await agent.stop()
        await replica.stop()


@contextlib.asynccontextmanager
async def _leader_and_node(
    etcd: LocalEtcd,
    prefix: str,
    store: Store,
    *,
    accepts_moves: bool = False,
    refuse_moves: bool = False,
    ack: bool = True,
    twenty: bool = True,
    move_settle_s: float = 600.0,
) -> AsyncIterator[tuple[Node, ServiceProcess, CommandNode, tuple[list[CacheHandle], set[str]]]]:
    """A leader with the budget policy, a scripted node d0 on its stream and, with `twenty`, the
    node's twenty handles (`_twenty_handles`), all there before the leader judges any: it would
    release part of them down to the low mark, and more only past the high mark again. So they
    are published before the leader starts, or, for a node that takes moves, while the leader
    knows it does but its stream is down (the leader holds its decisions until it is back)."""
    node = make_node("d0")
    await store.register_node(node, _NODE_LEASE_S)
    handles: tuple[list[CacheHandle], set[str]] = ([], set())
    if twenty and not accepts_moves:
        handles = await _twenty_handles(store, node)
    replica = await start_replica(etcd, prefix, policy=_BUDGET, move_settle_s=move_settle_s)
    agent = CommandNode(
        node.node_id,
        node.incarnation,
        [target_of(replica)],
        ack=ack,
        accepts_moves=accepts_moves,
        refuse_moves=refuse_moves,
    )
    agent.start()
    try:
        if accepts_moves:
            await _session_open(replica, "d0")
            if twenty:
                await agent.disconnect()
                handles = await _twenty_handles(store, node)
                agent.start()
                await _session_open(replica, "d0")
        yield node, replica, agent, handles
    finally:
        await agent.stop()
        await replica.stop()


async def _session_open(replica: ServiceProcess, node_id: str) -> None:
    """Until the leader holds the node's stream: a release decided before it goes out as one."""
    coordinator = coordinator_of(replica)

    async def open_() -> bool:
        session = coordinator.sessions.get(node_id)
        return coordinator.is_leader and session is not None and session.accepts_moves

    await eventually(open_, timeout_s=30, what=f"{node_id}'s command stream at the leader")


async def test_a_new_leader_waits_for_a_node_that_takes_moves_before_it_releases_anything(
    etcd: LocalEtcd, prefix: str, store: Store
) -> None:
    """The handles are there when the leader's term starts and the node is not connected: within
    the grace it releases nothing, however often it judges; when the node connects and says it
    takes moves, they move."""
    node = make_node("d0")
    await store.register_node(node, _NODE_LEASE_S)
    _, expected = await _twenty_handles(store, node)
    replica = await start_replica(etcd, prefix, policy=_BUDGET, move_grace_s=600)
    agent = CommandNode(node.node_id, node.incarnation, [target_of(replica)], accepts_moves=True)
    try:
        coordinator = coordinator_of(replica)
        await until(lambda: coordinator.evaluations >= 5, "rounds without the node")
        assert len(await retained_by(store, node_id="d0")) == 20
        assert not await store.pending_releases("d0")
        agent.start()
        await until(lambda: len(agent.moves) >= 10, "ten moves", timeout_s=30)
        assert {m.conversation for m in agent.moves.values()} == expected and not agent.applied
    finally:
        await agent.stop()
        await replica.stop()
