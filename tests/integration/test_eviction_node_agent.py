"""The real node agent on the real coordinator: metadata, routing and eviction
in one process, as `kvplane serve all` runs them."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import AsyncIterator

import grpc
import pytest

from kvplane.connector.node_agent.agent import NodeAgent
from kvplane.connector.node_agent.settings import NodeAgentSettings
from kvplane.services.common.model.nodes import NodeLoad
from kvplane.services.common.runtime.telemetry import Telemetry
from kvplane.services.common.store import Store
from kvplane.services.dev.local_etcd import LocalEtcd
from kvplane.services.eviction.app import install as install_eviction
from kvplane.services.metadata.app import install as install_metadata
from kvplane.services.process import ServiceProcess
from kvplane.services.routing.app import install as install_routing
from kvplane.v1 import metadata_pb2, metadata_pb2_grpc, routing_pb2, routing_pb2_grpc
from tests.conftest import MESH_CREDENTIALS, OPERATOR_HEADERS, make_node, settings_for, tenant_headers
from tests.support.eviction_nodes import coordinator_of
from tests.support.factories import make_handle
from tests.support.polling import eventually


class Applied:
    """What the agent's callbacks were given (they run on the agent's thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.released: dict[str, float] = {}
        self.drains = 0

    def on_release(self, remote_request_id: str) -> None:
        with self._lock:
            self.released.setdefault(remote_request_id, time.monotonic())

    def on_drain(self) -> None:
        with self._lock:
            self.drains += 1


@pytest.fixture
async def serve_all(etcd: LocalEtcd, prefix: str) -> AsyncIterator[ServiceProcess]:
    settings = settings_for(
        etcd, prefix, eviction={"lease_ttl_s": 2, "evaluate_interval_s": 0.2, "policy": {"policies": []}}
    )
    process = ServiceProcess(
        settings, [install_metadata, install_routing, install_eviction], Telemetry.disabled()
    )
    await process.start()
    try:
        await eventually(lambda: _true(coordinator_of(process).is_leader), what="the coordinator to lead")
        yield process
    finally:
        await process.stop()


async def test_end_conversation_reaches_the_engine_through_the_real_agent_within_a_second(
    serve_all: ServiceProcess, store: Store
) -> None:
    target = f"127.0.0.1:{serve_all.grpc_port}"
    node = make_node("d-agent", incarnation="")
    applied = Applied()
    agent = NodeAgent(
        NodeAgentSettings(
            metadata_target=target,
            lease_ttl_s=3,
            load_interval_s=0.2,
            backoff_initial_s=0.02,
            backoff_max_s=0.3,
            credentials=MESH_CREDENTIALS,
        ),
        node,
        lambda: NodeLoad(node.node_id, "", total_kv_blocks=100, free_kv_blocks=50),
        applied.on_release,
        on_drain=applied.on_drain,
    )
    agent.start()
    try:
        handle = dataclasses.replace(
            make_handle(node, "acme", "conv-end"), holder_incarnation=agent.incarnation
        )
        await eventually(_registered(store, node.node_id, agent.incarnation), what="the agent to register")
        await eventually(
            lambda: _true(len(coordinator_of(serve_all).sessions) == 1), what="the agent's stream"
        )
        agent.publish(handle)
        await eventually(_retained(store, "conv-end"), what="the published handle")
        started = time.monotonic()
        async with grpc.aio.insecure_channel(target) as channel:
            ended = await routing_pb2_grpc.RoutingServiceStub(channel).EndConversation(
                routing_pb2.EndConversationRequest(conversation="conv-end"), metadata=tenant_headers("acme")
            )
        assert ended.released
        await eventually(
            lambda: _true(handle.vllm.remote_request_id in applied.released),
            timeout_s=1.0,
            interval_s=0.01,
            what="the engine's release callback",
        )
        assert applied.released[handle.vllm.remote_request_id] - started < 1.0
        await eventually(_no_pending(store, node.node_id), what="the acknowledgement")
        # Draining through the metadata API reaches the engine too.
        async with grpc.aio.insecure_channel(target) as channel:
            await metadata_pb2_grpc.MetadataServiceStub(channel).DrainNode(
                metadata_pb2.DrainNodeRequest(node_id=node.node_id), metadata=OPERATOR_HEADERS
            )
        await eventually(lambda: _true(applied.drains == 1), what="the drain callback")
    finally:
        agent.stop(timeout_s=5.0)


async def test_the_agent_repeats_a_lasting_demand_and_withdraws_it_when_it_ends(
    serve_all: ServiceProcess,
) -> None:
    target = f"127.0.0.1:{serve_all.grpc_port}"
    node = make_node("d-demand", incarnation="")
    applied = Applied()
    demand = [0]
    agent = NodeAgent(
        NodeAgentSettings(
            metadata_target=target,
            lease_ttl_s=3,
            demand_refresh_s=0.1,
            backoff_initial_s=0.02,
            backoff_max_s=0.3,
            credentials=MESH_CREDENTIALS,
        ),
        node,
        lambda: NodeLoad(node.node_id, ""),
        applied.on_release,
        demand_fn=lambda: demand[0],
    )
    coordinator = coordinator_of(serve_all)
    agent.start()
    try:
        await eventually(lambda: _true(len(coordinator.sessions) == 1), what="the agent's stream")
        assert agent.stats().demand_reports == 0, "no demand, nothing sent"
        demand[0] = 7
        agent.notify_demand()  # what an engine does when requests start waiting
        await eventually(
            lambda: _true(getattr(coordinator.demands.get(node.node_id), "blocks", 0) == 7),
            what="the demand at the leader",
        )
        sent = agent.stats().demand_reports
        await eventually(lambda: _true(agent.stats().demand_reports >= sent + 2), what="the demand repeated")
        demand[0] = 0
        agent.notify_demand()
        await eventually(lambda: _true(node.node_id not in coordinator.demands), what="the demand withdrawn")
    finally:
        agent.stop(timeout_s=5.0)


def _registered(store: Store, node_id: str, incarnation: str):  # type: ignore[no-untyped-def]
    async def probe() -> bool:
        record = await store.get_node(node_id)
        return record is not None and record.node.incarnation == incarnation

    return probe


def _retained(store: Store, conversation: str):  # type: ignore[no-untyped-def]
    async def probe() -> bool:
        return await store.get_handle_record("acme", conversation) is not None

    return probe


def _no_pending(store: Store, node_id: str):  # type: ignore[no-untyped-def]
    async def probe() -> bool:
        return not await store.pending_releases(node_id)

    return probe


async def _true(value: bool) -> bool:
    return value
