"""The metadata servicer on its own: `MetadataService` on a bare `GrpcServer` (token auth, no
watch-fed view, no reapers) against the real etcd, and the error table its methods answer through.

The full process (`metadata.app.install` in a `ServiceProcess`) is tested in
test_metadata_service.py; here the servicer, the server's guard and `rpc_method` are each named.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import pytest

from kvplane.services.common.model import convert
from kvplane.services.common.model.errors import (
    HandleNotRetained,
    InvalidArgument,
    NodeNotRegistered,
    NotFound,
    NotLeader,
    PermissionDenied,
    StoreUnavailable,
    Unauthenticated,
)
from kvplane.services.common.runtime.auth import Principal, PrincipalKind, TokenAuthenticator
from kvplane.services.common.runtime.grpc_errors import status_for
from kvplane.services.common.runtime.server import GrpcServer
from kvplane.services.common.runtime.telemetry import Telemetry
from kvplane.services.common.store import Store
from kvplane.services.metadata.service import SERVICE_NAME, MetadataService
from kvplane.services.metadata.settings import MetadataSection
from kvplane.v1 import metadata_pb2, metadata_pb2_grpc
from tests.conftest import make_node
from tests.support.factories import make_handle

TOKENS = {
    "node-d0": Principal(PrincipalKind.NODE, "d0"),
    "tenant-acme": Principal(PrincipalKind.TENANT, "acme", tenant="acme", sees_engines=True),
    "tenant-globex": Principal(PrincipalKind.TENANT, "globex", tenant="globex", sees_engines=True),
    "operator": Principal(PrincipalKind.OPERATOR, "ops"),
}


def _as(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


@dataclass
class Served:
    stub: metadata_pb2_grpc.MetadataServiceStub
    channel: grpc.aio.Channel


@pytest.fixture
async def served(store: Store) -> AsyncIterator[Served]:
    server = GrpcServer("127.0.0.1:0", Telemetry.disabled(), TokenAuthenticator(TOKENS))
    servicer = MetadataService(store, MetadataSection(), Telemetry.disabled())
    server.add(SERVICE_NAME, metadata_pb2_grpc.add_MetadataServiceServicer_to_server, servicer)
    port = await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield Served(metadata_pb2_grpc.MetadataServiceStub(channel), channel)
    finally:
        await server.stop(0.1)


async def _registered_with_a_handle(stub: metadata_pb2_grpc.MetadataServiceStub) -> str:
    node = make_node("d0")
    await stub.RegisterNode(
        metadata_pb2.RegisterNodeRequest(node=convert.node_to_pb(node), lease_ttl_s=30),
        metadata=_as("node-d0"),
    )
    published = await stub.PublishHandles(
        metadata_pb2.PublishHandlesRequest(
            handles=[convert.handle_to_pb(make_handle(node, conversation="c1"))]
        ),
        metadata=_as("node-d0"),
    )
    return str(published.results[0].handle_id)


async def _code(call: object) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call  # type: ignore[misc]
    return raised.value.code()


async def test_a_call_without_credentials_is_unauthenticated(served: Served) -> None:
    assert (
        await _code(served.stub.ListNodes(metadata_pb2.ListNodesRequest())) == grpc.StatusCode.UNAUTHENTICATED
    )
    assert (
        await _code(served.stub.ListNodes(metadata_pb2.ListNodesRequest(), metadata=_as("forged")))
        == grpc.StatusCode.UNAUTHENTICATED
    )


async def test_a_request_that_does_not_parse_is_an_invalid_argument(served: Served) -> None:
    raw = served.channel.unary_unary(f"/{SERVICE_NAME}/GetHandle")
    code = await _code(raw(b"\xff\xff\xff", metadata=_as("tenant-acme")))
    assert code == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_published_handle_is_checked_out_once_by_its_own_tenant(served: Served) -> None:
    handle_id = await _registered_with_a_handle(served.stub)
    seen = await served.stub.GetHandle(
        metadata_pb2.GetHandleRequest(conversation="c1"), metadata=_as("tenant-acme")
    )
    assert seen.handle.handle_id == handle_id

    other = served.stub.GetHandle(
        metadata_pb2.GetHandleRequest(conversation="c1"), metadata=_as("tenant-globex")
    )
    assert await _code(other) == grpc.StatusCode.NOT_FOUND, "another tenant's conversation is not there"

    request = metadata_pb2.CheckOutHandleRequest(conversation="c1")
    won = await served.stub.CheckOutHandle(request, metadata=_as("tenant-acme"))
    assert won.handle.handle_id == handle_id and won.claim_id
    again = served.stub.CheckOutHandle(request, metadata=_as("tenant-acme"))
    assert await _code(again) == grpc.StatusCode.NOT_FOUND, "single use: nothing is left to check out"


async def test_a_node_acts_only_as_itself(served: Served) -> None:
    imposter = make_node("d1")
    call = served.stub.RegisterNode(
        metadata_pb2.RegisterNodeRequest(node=convert.node_to_pb(imposter), lease_ttl_s=30),
        metadata=_as("node-d0"),
    )
    assert await _code(call) == grpc.StatusCode.PERMISSION_DENIED
    drain = served.stub.DrainNode(metadata_pb2.DrainNodeRequest(node_id="d0"), metadata=_as("tenant-acme"))
    assert await _code(drain) == grpc.StatusCode.PERMISSION_DENIED, "a tenant drains nothing"


async def test_a_lease_ttl_out_of_range_names_the_field(served: Served) -> None:
    call = served.stub.RegisterNode(
        metadata_pb2.RegisterNodeRequest(node=convert.node_to_pb(make_node("d0")), lease_ttl_s=1),
        metadata=_as("node-d0"),
    )
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "lease_ttl_s" in (raised.value.details() or "")


async def test_an_operator_drains_a_node_and_sees_it_listed_draining(served: Served) -> None:
    await _registered_with_a_handle(served.stub)
    await served.stub.DrainNode(metadata_pb2.DrainNodeRequest(node_id="d0"), metadata=_as("operator"))
    nodes = await served.stub.ListNodes(metadata_pb2.ListNodesRequest(), metadata=_as("operator"))
    assert [(n.node.node_id, n.node.draining) for n in nodes.nodes] == [("d0", True)]


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (InvalidArgument("tenant", "too long"), grpc.StatusCode.INVALID_ARGUMENT),
        (NotFound("gone"), grpc.StatusCode.NOT_FOUND),
        (HandleNotRetained("taken"), grpc.StatusCode.FAILED_PRECONDITION),
        (NodeNotRegistered("who"), grpc.StatusCode.FAILED_PRECONDITION),
        (PermissionDenied("no"), grpc.StatusCode.PERMISSION_DENIED),
        (Unauthenticated("who are you"), grpc.StatusCode.UNAUTHENTICATED),
        (StoreUnavailable("etcd"), grpc.StatusCode.UNAVAILABLE),
        (NotLeader("standby"), grpc.StatusCode.UNAVAILABLE),
    ],
)
def test_each_kvplane_error_has_its_canonical_status_and_keeps_its_message(
    error: Exception, code: grpc.StatusCode
) -> None:
    assert status_for(error) == (code, str(error))


def test_an_unexpected_error_is_internal_and_tells_the_caller_nothing() -> None:
    assert status_for(KeyError("secret detail")) == (grpc.StatusCode.INTERNAL, "internal error")
