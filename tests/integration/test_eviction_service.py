"""The eviction service's command stream opens only for the node itself, after a hello, and the
status names the leader. (Delivery: test_eviction_commands.py; standbys: test_eviction_failover.py.)"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest

from kvplane.services.dev.local_etcd import LocalEtcd
from kvplane.services.eviction.service import SERVICE_NAME
from kvplane.services.process import ServiceProcess
from kvplane.v1 import eviction_pb2, eviction_pb2_grpc
from tests.conftest import NODE_HEADERS, OPERATOR_HEADERS, tenant_headers
from tests.support.eviction_nodes import coordinator_of, start_replica, target_of
from tests.support.polling import eventually

NO_POLICY: dict[str, list[object]] = {"policies": []}


@pytest.fixture
async def leader(etcd: LocalEtcd, prefix: str) -> AsyncIterator[ServiceProcess]:
    process = await start_replica(etcd, prefix, policy=NO_POLICY)
    try:

        async def leads() -> bool:
            return coordinator_of(process).is_leader

        await eventually(leads, timeout_s=30, what="the replica to lead")
        yield process
    finally:
        await process.stop()


async def _first_reply(
    process: ServiceProcess, first: eviction_pb2.CommandsRequest | None, headers: tuple[tuple[str, str], ...]
) -> grpc.aio.AioRpcError:
    async with grpc.aio.insecure_channel(target_of(process)) as channel:
        stream = eviction_pb2_grpc.EvictionServiceStub(channel).Commands(metadata=headers)
        if first is not None:
            await stream.write(first)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stream.read()
        return raised.value


def _hello(node_id: str) -> eviction_pb2.CommandsRequest:
    return eviction_pb2.CommandsRequest(hello=eviction_pb2.NodeHello(node_id=node_id, incarnation="inc-1"))


async def test_a_stream_must_open_with_a_hello(leader: ServiceProcess) -> None:
    ack = eviction_pb2.CommandsRequest(ack=eviction_pb2.CommandAck(command_id="c1", ok=True))
    error = await _first_reply(leader, ack, NODE_HEADERS)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "hello" in (error.details() or "")


async def test_a_node_opens_only_its_own_stream_and_a_tenant_none(leader: ServiceProcess) -> None:
    other = await _first_reply(leader, _hello("d-other"), NODE_HEADERS)  # NODE_HEADERS act as d0
    assert other.code() == grpc.StatusCode.PERMISSION_DENIED
    # A tenant is refused from its headers, before any message: writing one would race the refusal
    # (a write to a call the server has closed fails with INTERNAL, hiding its status).
    tenant = await _first_reply(leader, None, tenant_headers("acme"))
    assert tenant.code() == grpc.StatusCode.PERMISSION_DENIED


async def test_the_status_names_this_replica_as_leader(leader: ServiceProcess) -> None:
    async with grpc.aio.insecure_channel(target_of(leader)) as channel:
        status = await eviction_pb2_grpc.EvictionServiceStub(channel).GetStatus(
            eviction_pb2.GetStatusRequest(), metadata=OPERATOR_HEADERS
        )
    assert status.leader and status.leader_id == coordinator_of(leader).replica_id
    assert SERVICE_NAME == "kvplane.v1.EvictionService"
