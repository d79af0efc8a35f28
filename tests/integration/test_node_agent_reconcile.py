"""Nothing orphaned: a node that lost its registration (its handles purged) frees, at
re-registration, every retained handle the control plane no longer references."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Iterator

import pytest

from kvplane.connector.node_agent.agent import NodeAgent
from kvplane.connector.node_agent.settings import NodeAgentSettings
from kvplane.services.common.model.nodes import NodeLoad
from kvplane.services.common.store import Store
from kvplane.services.dev.local_etcd import LocalEtcd
from kvplane.services.process import ServiceProcess
from tests.conftest import MESH_CREDENTIALS, make_node
from tests.support.eviction_nodes import start_purging_leader
from tests.support.factories import make_handle
from tests.support.polling import eventually


class FakeEngine:
    """The engine side: the request ids whose blocks it retains; on_release frees one."""

    def __init__(self, held: set[str]) -> None:
        self._lock = threading.Lock()
        self.held = set(held)
        self.freed: list[str] = []

    def retained(self) -> list[str]:
        with self._lock:
            return sorted(self.held)

    def on_release(self, request_id: str) -> None:
        with self._lock:
            if request_id in self.held:
                self.held.discard(request_id)
                self.freed.append(request_id)


@pytest.fixture
async def purger(etcd: LocalEtcd, prefix: str) -> AsyncIterator[ServiceProcess]:
    """The eviction leader: what purges the handles of a node whose registration lapsed."""
    process = await start_purging_leader(etcd, prefix)
    try:
        yield process
    finally:
        await process.stop()


@pytest.fixture
def agents() -> Iterator[list[NodeAgent]]:
    started: list[NodeAgent] = []
    yield started
    for agent in started:
        agent.stop(timeout_s=5.0)


async def test_handles_purged_while_the_node_was_away_are_freed_when_it_registers_again(
    metadata_process: ServiceProcess, purger: ServiceProcess, store: Store, agents: list[NodeAgent]
) -> None:
    node = make_node("d-reconcile")
    engine = FakeEngine(set())
    agent = NodeAgent(
        NodeAgentSettings(
            metadata_target=f"127.0.0.1:{metadata_process.grpc_port}",
            lease_ttl_s=3,
            load_interval_s=0.1,
            backoff_initial_s=0.02,
            backoff_max_s=0.3,
            credentials=MESH_CREDENTIALS,
        ),
        node,
        lambda: NodeLoad(node.node_id, ""),
        engine.on_release,
        retained_fn=engine.retained,
    )
    agent.start()
    agents.append(agent)
    await eventually(lambda: _true(agent.stats().registered), what="registration")

    # r1 retained and published; r2 published, then checked out (a pull is on its way);
    # r3 retained but its publish was lost.
    registered = make_node("d-reconcile", incarnation=agent.incarnation)
    engine.held |= {"r1", "r2", "r3"}
    agent.publish(make_handle(registered, conversation="c1", request_id="r1"))
    agent.publish(make_handle(registered, conversation="c2", request_id="r2"))
    await eventually(lambda: _true(agent.stats().published == 2), what="both publishes")
    await store.check_out("acme", "c2")

    # The node's registration lapses (a control-plane outage longer than its lease);
    # the eviction leader purges its handles.
    record = await store.get_node(node.node_id)
    assert record is not None
    await store.revoke_lease(record.lease)
    await eventually(
        lambda: _none(store.get_handle_record("acme", "c1")), what="the purge of the node's handles"
    )

    await eventually(lambda: _true(agent.stats().registrations >= 2), what="re-registration")
    await eventually(lambda: _true(sorted(engine.freed) == ["r1", "r3"]), what="unreferenced blocks freed")
    assert engine.held == {"r2"}, "the checked-out handle waits for its reader"
    assert agent.stats().reconciled_freed == 2


async def _true(value: bool) -> bool:
    return value


async def _none(awaitable: object) -> bool:
    return await awaitable is None  # type: ignore[misc]
