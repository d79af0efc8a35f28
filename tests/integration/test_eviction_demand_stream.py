"""KV demand on the command stream, against a real leader, real etcd and real gRPC streams.

A node reports the blocks it needs; the leader releases its handles, least
expected reuse per byte first, until the demand is covered, and counts the
releases the node has not acknowledged against any repeat of the report.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import pytest

from kvplane.services.common.model.nodes import Node
from kvplane.services.common.store import Store
from kvplane.services.dev.local_etcd import LocalEtcd
from kvplane.services.process import ServiceProcess
from tests.conftest import make_node
from tests.support.eviction_nodes import CommandNode, coordinator_of, start_replica, target_of
from tests.support.factories import make_handle
from tests.support.polling import eventually

DEMAND_ONLY = {"policies": [{"name": "demand"}]}
MB = 1 << 20
# make_node: 16-token blocks of 4,096 bytes a token, so 64 KiB a block; 16 blocks make 1 MiB.
BLOCKS_PER_MB = 16


@pytest.fixture
async def leader(etcd: LocalEtcd, prefix: str) -> AsyncIterator[ServiceProcess]:
    # Rounds every 30 s: whatever is released here is the demand path's doing, not the loop's.
    process = await start_replica(etcd, prefix, policy=DEMAND_ONLY, evaluate_interval_s=30.0)
    try:
        await eventually(_true_after(lambda: coordinator_of(process).is_leader), what="the replica to lead")
        yield process
    finally:
        await process.stop()


def _true_after(predicate):  # type: ignore[no-untyped-def]
    async def probe() -> bool:
        return bool(predicate())

    return probe


async def _retain(store: Store, leader: ServiceProcess, node: Node, count: int) -> list[str]:
    """`count` 1 MiB handles on `node`, published oldest first; returns once the leader sees them."""
    conversations = []
    for i in range(count):
        conversation = f"conv-{i}-{uuid.uuid4().hex[:6]}"
        await store.publish_handle(make_handle(node, "acme", conversation, retained_bytes=MB))
        conversations.append(conversation)
    view = coordinator_of(leader).view
    await eventually(_true_after(lambda: len(view.handles) == count), what="the handles in the leader's view")
    return conversations


def _answers_timed(replica: ServiceProcess) -> float:
    """How many demands the leader timed as answered (kvplane_eviction_demand_answer_seconds)."""
    histogram = coordinator_of(replica).metrics.demand_answer_seconds
    return sum(s.value for m in histogram.collect() for s in m.samples if s.name.endswith("_count"))


async def _connected_node(
    store: Store, replica: ServiceProcess, *, ack: bool, accepts_moves: bool = False
) -> tuple[Node, CommandNode]:
    node = make_node("d0")
    await store.register_node(node, 30)
    agent = CommandNode(
        node.node_id, node.incarnation, [target_of(replica)], ack=ack, accepts_moves=accepts_moves
    )
    agent.start()
    await eventually(_true_after(lambda: agent.connected), what="the node's stream")
    await eventually(
        _true_after(lambda: node.node_id in coordinator_of(replica).view.nodes), what="the node in the view"
    )
    return node, agent


async def test_a_demand_releases_the_oldest_handles_until_it_is_covered_and_no_more(
    store: Store, leader: ServiceProcess
) -> None:
    node, agent = await _connected_node(store, leader, ack=True)
    try:
        conversations = await _retain(store, leader, node, 5)
        coordinator = coordinator_of(leader)
        # 1.5 MiB wanted: two 1 MiB handles, the two oldest (equal in all else).
        agent.send_demand(BLOCKS_PER_MB + BLOCKS_PER_MB // 2)
        await eventually(_true_after(lambda: len(agent.applied) == 2), what="two release commands")
        assert agent.released_conversations() == {("acme", c) for c in conversations[:2]}
        await eventually(_true_after(lambda: _answers_timed(leader) == 1), what="the answer timed")
        # The node frees them and reports no more demand: nothing else goes.
        agent.send_demand(0)
        agent.send_demand(0)
        await eventually(_true_after(lambda: "d0" not in coordinator.demands), what="the demand withdrawn")
        assert len(agent.applied) == 2
        assert {h.handle.conversation for h in coordinator.view.handles.values()} == set(conversations[2:])
    finally:
        await agent.stop()


async def test_a_demand_on_a_node_that_takes_moves_is_answered_by_moves_and_timed(
    store: Store, leader: ServiceProcess
) -> None:
    node, agent = await _connected_node(store, leader, ack=True, accepts_moves=True)
    try:
        conversations = await _retain(store, leader, node, 5)
        agent.send_demand(BLOCKS_PER_MB + BLOCKS_PER_MB // 2)
        await eventually(_true_after(lambda: len(agent.moves) == 2), what="two move commands")
        assert {m.conversation for m in agent.moves.values()} == set(conversations[:2])
        assert agent.applied == {}
        # The demand was answered, by moves: the leader's answer time counts it as it counts releases.
        await eventually(_true_after(lambda: _answers_timed(leader) == 1), what="the answer timed")
    finally:
        await agent.stop()


async def test_a_repeated_demand_is_not_answered_twice_while_its_releases_are_unacknowledged(
    store: Store, leader: ServiceProcess
) -> None:
    node, agent = await _connected_node(store, leader, ack=False)
    try:
        await _retain(store, leader, node, 5)
        coordinator = coordinator_of(leader)
        agent.send_demand(BLOCKS_PER_MB)
        await eventually(_true_after(lambda: len(agent.applied) == 1), what="one release command")
        # The node has not acknowledged (not applied, as far as the leader knows): the same
        # demand again is already answered.
        agent.send_demand(BLOCKS_PER_MB)
        agent.send_demand(BLOCKS_PER_MB)
        await eventually(
            _true_after(lambda: coordinator.metrics.demand_reports._value.get() >= 3),
            what="the repeats received",
        )
        assert await coordinator.answer_demand("d0", coordinator.term) == 0  # type: ignore[arg-type]
        assert len(agent.applied) == 1
        # Once acknowledged, a demand the node still reports is a new need: one more goes.
        [command_id] = agent.applied
        agent.acknowledge(command_id)
        await eventually(
            _true_after(lambda: coordinator.releaser.bytes_unseen_by("d0", time.monotonic()) == 0),
            what="the ack recorded",
        )
        # The report the leader holds came before the ack: still answered.
        assert await coordinator.answer_demand("d0", coordinator.term) == 0  # type: ignore[arg-type]
        agent.send_demand(BLOCKS_PER_MB)
        await eventually(_true_after(lambda: len(agent.applied) == 2), what="a second release command")
    finally:
        await agent.stop()


async def test_a_demand_from_another_incarnation_releases_nothing(
    store: Store, leader: ServiceProcess
) -> None:
    node, agent = await _connected_node(store, leader, ack=True)
    try:
        await _retain(store, leader, node, 2)
        coordinator = coordinator_of(leader)
        coordinator.on_demand(node.node_id, "an-earlier-life", 10 * BLOCKS_PER_MB, 0)
        assert node.node_id not in coordinator.demands
        assert await coordinator.answer_demand(node.node_id, coordinator.term) == 0  # type: ignore[arg-type]
        assert agent.applied == {}
    finally:
        await agent.stop()
