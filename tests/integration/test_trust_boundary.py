"""The trust boundary of the gRPC services, against a real control plane (metadata, routing,
eviction) on loopback with real etcd: who may call, as whom, on what, with which input.

Methods are enumerated from the API's service descriptors, so a method added later is covered
without editing this file.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from grpc_reflection.v1alpha import reflection_pb2_grpc

from kvplane.services.common.model import convert
from kvplane.services.dev.local_etcd import LocalEtcd
from kvplane.services.process import ServiceProcess
from kvplane.v1 import (
    eviction_pb2,
    eviction_pb2_grpc,
    handle_pb2,
    metadata_pb2,
    metadata_pb2_grpc,
    node_pb2,
    routing_pb2,
    routing_pb2_grpc,
)
from tests.conftest import MESH_SECRET, make_node
from tests.support.eviction_nodes import coordinator_of
from tests.support.factories import make_handle, vllm_params
from tests.support.polling import eventually
from tests.support.trust import (
    all_methods,
    bearer,
    kvplane_services,
    method_id,
    plane_settings,
    raw_call,
    raw_channel,
    start_plane,
    target,
    token_auth,
)

METHODS = all_methods()
MESH_AUTH = {"mode": "mesh", "mesh_experimental": True, "mesh": {"secrets": [MESH_SECRET]}}


@pytest.fixture
async def token_plane(etcd: LocalEtcd, prefix: str) -> AsyncIterator[ServiceProcess]:
    process = await start_plane(plane_settings(etcd, prefix, token_auth()))
    try:
        yield process
    finally:
        await process.stop()


@pytest.fixture
async def mesh_plane(etcd: LocalEtcd, prefix: str) -> AsyncIterator[ServiceProcess]:
    process = await start_plane(plane_settings(etcd, prefix, MESH_AUTH))
    try:
        yield process
    finally:
        await process.stop()


@pytest.fixture
async def token_channel(token_plane: ServiceProcess) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(target(token_plane)) as channel:
        yield channel


@pytest.fixture
def token_raw(token_plane: ServiceProcess) -> Iterator[grpc.Channel]:
    """A synchronous channel to the token-mode plane, for `raw_call`."""
    with raw_channel(target(token_plane)) as channel:
        yield channel


def test_the_method_list_covers_every_service_of_the_api() -> None:
    names = {s.full_name for s in kvplane_services()}
    assert names == {"kvplane.v1.MetadataService", "kvplane.v1.RoutingService", "kvplane.v1.EvictionService"}
    assert len(METHODS) == sum(len(s.methods) for s in kvplane_services())


# -- closed by default --------------------------------------------------------------------------


async def _assert_every_method_refuses(
    channel: grpc.Channel, metadata: tuple[tuple[str, str], ...], what: str
) -> None:
    for service, method in METHODS:
        outcome = await raw_call(channel, service, method, [b""], metadata)
        assert outcome.code == grpc.StatusCode.UNAUTHENTICATED, (
            f"{service.name}.{method.name} {what}: {outcome}"
        )
        assert outcome.responses == 0


async def test_every_method_refuses_an_anonymous_caller_in_token_mode(token_raw: grpc.Channel) -> None:
    await _assert_every_method_refuses(token_raw, (), "without credentials")
    await _assert_every_method_refuses(token_raw, bearer("nobody"), "with an unknown token")
    # Identity headers mean nothing in token mode.
    headers = (("x-kvplane-role", "operator"), ("x-kvplane-tenant", "acme"))
    await _assert_every_method_refuses(token_raw, headers, "with bare identity headers")


async def test_every_method_refuses_an_anonymous_caller_in_mesh_mode(mesh_plane: ServiceProcess) -> None:
    with raw_channel(target(mesh_plane)) as channel:
        await _assert_every_method_refuses(channel, (), "without credentials")
        # Headers a mesh proxy would set, sent by a bare client: not believed.
        for headers in (
            (("x-kvplane-role", "operator"),),
            (("x-kvplane-role", "node"), ("x-kvplane-node", "d0")),
            (("x-kvplane-tenant", "acme"),),
        ):
            await _assert_every_method_refuses(channel, headers, f"with bare headers {headers}")
            forged = (("x-kvplane-mesh-secret", "not-the-secret"), *headers)
            await _assert_every_method_refuses(channel, forged, "with a wrong proxy secret")
        # The proxy vouches, but names nobody.
        await _assert_every_method_refuses(
            channel, (("x-kvplane-mesh-secret", MESH_SECRET),), "from the proxy naming no caller"
        )


def test_serve_refuses_to_start_without_an_authentication_mode(etcd: LocalEtcd) -> None:
    import subprocess
    import sys

    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("KVPLANE_AUTH")}
    result = subprocess.run(
        [sys.executable, "-m", "kvplane.services.cli", "serve", "all", "--etcd", etcd.endpoint],
        env=env,
        capture_output=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert b"auth.mode is required" in result.stderr


async def test_reflection_is_off_unless_enabled(token_channel: grpc.aio.Channel) -> None:
    stub = reflection_pb2_grpc.ServerReflectionStub(token_channel)
    # No request message: a server without reflection ends the call at once, and a message still
    # being sent then fails on the client's side (INTERNAL), whatever the server answered.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        async for _ in stub.ServerReflectionInfo(iter(())):
            pass
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


# -- principals bound to resources --------------------------------------------------------------


async def _register(
    stub: metadata_pb2_grpc.MetadataServiceStub, node_id: str
) -> metadata_pb2.RegisterNodeResponse:
    node = make_node(node_id)
    response: metadata_pb2.RegisterNodeResponse = await stub.RegisterNode(
        metadata_pb2.RegisterNodeRequest(node=convert.node_to_pb(node), lease_ttl_s=30),
        metadata=bearer(node_id),
    )
    return response


async def test_node_a_cannot_act_as_node_b_on_any_method(token_channel: grpc.aio.Channel) -> None:
    meta = metadata_pb2_grpc.MetadataServiceStub(token_channel)
    evict = eviction_pb2_grpc.EvictionServiceStub(token_channel)
    routing = routing_pb2_grpc.RoutingServiceStub(token_channel)
    b = make_node("node-b")
    registered = await meta.RegisterNode(
        metadata_pb2.RegisterNodeRequest(node=convert.node_to_pb(b), lease_ttl_s=30),
        metadata=bearer("node-b"),
    )
    published = await meta.PublishHandles(
        metadata_pb2.PublishHandlesRequest(handles=[convert.handle_to_pb(make_handle(b, conversation="c1"))]),
        metadata=bearer("node-b"),
    )
    handle_id = published.results[0].handle_id
    # A release for B is waiting in B's outbox.
    await meta.PublishHandles(
        metadata_pb2.PublishHandlesRequest(handles=[convert.handle_to_pb(make_handle(b, conversation="c2"))]),
        metadata=bearer("node-b"),
    )
    await meta.ReleaseHandle(
        metadata_pb2.ReleaseHandleRequest(tenant="acme", conversation="c2"), metadata=bearer("ops")
    )

    as_a = bearer("node-a")
    impostor = convert.node_to_pb(make_node("node-b", port=9999))
    other_handle = convert.handle_to_pb(make_handle(b, conversation="c3"))
    calls = {
        "RegisterNode": meta.RegisterNode(metadata_pb2.RegisterNodeRequest(node=impostor), metadata=as_a),
        "KeepAlive": meta.KeepAlive(
            metadata_pb2.KeepAliveRequest(
                node_id="node-b", incarnation=b.incarnation, lease_id=registered.lease_id
            ),
            metadata=as_a,
        ),
        "ReportLoad": meta.ReportLoad(
            metadata_pb2.ReportLoadRequest(
                load=node_pb2.NodeLoad(node_id="node-b", incarnation=b.incarnation)
            ),
            metadata=as_a,
        ),
        "PublishHandles": meta.PublishHandles(
            metadata_pb2.PublishHandlesRequest(handles=[other_handle]), metadata=as_a
        ),
        "ReportReleased": meta.ReportReleased(
            metadata_pb2.ReportReleasedRequest(
                node_id="node-b", incarnation=b.incarnation, remote_request_ids=["x"]
            ),
            metadata=as_a,
        ),
        "DrainNode": meta.DrainNode(metadata_pb2.DrainNodeRequest(node_id="node-b"), metadata=as_a),
        "DeregisterNode": meta.DeregisterNode(
            metadata_pb2.DeregisterNodeRequest(node_id="node-b", incarnation=b.incarnation), metadata=as_a
        ),
        "ListHandles": meta.ListHandles(metadata_pb2.ListHandlesRequest(node_id="node-b"), metadata=as_a),
        # A node acts for no tenant: no reads, check-outs, releases or routes.
        "GetHandle": meta.GetHandle(
            metadata_pb2.GetHandleRequest(tenant="acme", conversation="c1"), metadata=as_a
        ),
        "CheckOutHandle": meta.CheckOutHandle(
            metadata_pb2.CheckOutHandleRequest(tenant="acme", conversation="c1"), metadata=as_a
        ),
        "ReleaseHandle": meta.ReleaseHandle(
            metadata_pb2.ReleaseHandleRequest(tenant="acme", conversation="c1"), metadata=as_a
        ),
        "Watch": _drain(meta.Watch(metadata_pb2.WatchRequest(), metadata=as_a)),
        "Route": routing.Route(
            routing_pb2.RouteRequest(tenant="acme", conversation="c1", model="tiny", prompt_tokens=10),
            metadata=as_a,
        ),
        "ReportTurn": routing.ReportTurn(
            routing_pb2.ReportTurnRequest(tenant="acme", conversation="c1", success=True), metadata=as_a
        ),
        "EndConversation": routing.EndConversation(
            routing_pb2.EndConversationRequest(tenant="acme", conversation="c1"), metadata=as_a
        ),
        "Commands": _drain(
            evict.Commands(
                iter(
                    [
                        eviction_pb2.CommandsRequest(
                            hello=eviction_pb2.NodeHello(node_id="node-b", incarnation=b.incarnation)
                        )
                    ]
                ),
                metadata=as_a,
                timeout=5,
            )
        ),
    }
    refused = {}
    for name, call in calls.items():
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        refused[name] = err.value.code()
    assert refused == dict.fromkeys(calls, grpc.StatusCode.PERMISSION_DENIED)

    # B is as B left it: its URL, not draining, its handle retained, its command undelivered.
    nodes = await meta.ListNodes(metadata_pb2.ListNodesRequest(), metadata=bearer("ops"))
    assert [(n.node.node_id, n.node.http_url, n.node.draining) for n in nodes.nodes] == [
        ("node-b", b.http_url, False)
    ]
    got = await meta.GetHandle(
        metadata_pb2.GetHandleRequest(tenant="acme", conversation="c1"), metadata=bearer("ops")
    )
    assert got.handle.handle_id == handle_id
    status = await evict.GetStatus(eviction_pb2.GetStatusRequest(), metadata=bearer("ops"))
    assert status.pending_commands == 1
    # B itself receives its command over its own stream.
    received = await _first_command(evict, "node-b", b.incarnation)
    assert received.release.conversation == "c2"


async def _drain(call: object) -> None:
    async for _ in call:  # type: ignore[attr-defined]
        pass


async def _first_command(
    stub: eviction_pb2_grpc.EvictionServiceStub, node_id: str, incarnation: str
) -> eviction_pb2.CommandsResponse:
    hello = eviction_pb2.CommandsRequest(
        hello=eviction_pb2.NodeHello(node_id=node_id, incarnation=incarnation)
    )

    async def requests() -> AsyncIterator[eviction_pb2.CommandsRequest]:
        yield hello
        await _forever()

    async def first() -> eviction_pb2.CommandsResponse | None:
        call = stub.Commands(requests(), metadata=bearer(node_id), timeout=5)
        try:
            async for command in call:
                return command  # type: ignore[no-any-return]
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNAVAILABLE:  # not yet leader: try again
                raise
        finally:
            call.cancel()
        return None

    result: eviction_pb2.CommandsResponse = await eventually(first, what=f"a command on {node_id}'s stream")
    return result


async def _true(value: bool) -> bool:
    return value


async def _forever() -> None:
    import asyncio

    await asyncio.Event().wait()  # the node keeps its side of the stream open


async def test_tenants_see_only_their_own_handles_and_never_engine_addresses(
    token_channel: grpc.aio.Channel,
) -> None:
    meta = metadata_pb2_grpc.MetadataServiceStub(token_channel)
    routing = routing_pb2_grpc.RoutingServiceStub(token_channel)
    b = make_node("node-b")
    await meta.RegisterNode(
        metadata_pb2.RegisterNodeRequest(node=convert.node_to_pb(b), lease_ttl_s=30),
        metadata=bearer("node-b"),
    )
    await meta.PublishHandles(
        metadata_pb2.PublishHandlesRequest(
            handles=[convert.handle_to_pb(make_handle(b, "acme", "shared-id"))]
        ),
        metadata=bearer("node-b"),
    )
    globex = bearer("globex")
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await meta.GetHandle(metadata_pb2.GetHandleRequest(conversation="shared-id"), metadata=globex)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert not (await meta.ListHandles(metadata_pb2.ListHandlesRequest(), metadata=globex)).handles
    # Naming the other tenant in the body is refused on every tenant-scoped method.
    for call in (
        meta.GetHandle(
            metadata_pb2.GetHandleRequest(tenant="acme", conversation="shared-id"), metadata=globex
        ),
        meta.CheckOutHandle(
            metadata_pb2.CheckOutHandleRequest(tenant="acme", conversation="shared-id"), metadata=globex
        ),
        meta.ReleaseHandle(
            metadata_pb2.ReleaseHandleRequest(tenant="acme", conversation="shared-id"), metadata=globex
        ),
        meta.ListHandles(metadata_pb2.ListHandlesRequest(tenant="acme"), metadata=globex),
        routing.EndConversation(
            routing_pb2.EndConversationRequest(tenant="acme", conversation="shared-id"), metadata=globex
        ),
        routing.Route(
            routing_pb2.RouteRequest(tenant="acme", conversation="shared-id", model="tiny", prompt_tokens=10),
            metadata=globex,
        ),
        # Engine addresses and every tenant's handles.
        meta.ListNodes(metadata_pb2.ListNodesRequest(), metadata=globex),
        _drain(meta.Watch(metadata_pb2.WatchRequest(), metadata=globex)),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # Globex's own EndConversation of the same id touches nothing of acme's.
    ended = await routing.EndConversation(
        routing_pb2.EndConversationRequest(conversation="shared-id"), metadata=globex
    )
    assert not ended.released
    # The owner sees its handle, without where its KV lives.
    mine = await meta.GetHandle(
        metadata_pb2.GetHandleRequest(conversation="shared-id"), metadata=bearer("acme")
    )
    v = mine.handle.vllm
    assert mine.state == handle_pb2.HANDLE_STATE_RETAINED
    assert (v.remote_host, v.remote_port, v.remote_engine_id, len(v.remote_block_ids)) == ("", 0, "", 0)
    listed = await meta.ListHandles(metadata_pb2.ListHandlesRequest(), metadata=bearer("acme"))
    assert [(h.conversation, h.vllm.remote_host) for h in listed.handles] == [("shared-id", "")]


async def test_operator_methods_need_an_operator(token_channel: grpc.aio.Channel) -> None:
    meta = metadata_pb2_grpc.MetadataServiceStub(token_channel)
    evict = eviction_pb2_grpc.EvictionServiceStub(token_channel)
    for who in ("acme", "node-a"):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await _drain(meta.Watch(metadata_pb2.WatchRequest(), metadata=bearer(who)))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await evict.GetStatus(eviction_pb2.GetStatusRequest(), metadata=bearer("acme"))
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED

    async def leader() -> str:
        return str((await evict.GetStatus(eviction_pb2.GetStatusRequest(), metadata=bearer("ops"))).leader_id)

    assert await eventually(leader, what="the operator to read the leader")


# -- every input validated the same way ---------------------------------------------------------


async def test_report_turn_refuses_the_hosts_ports_and_integers_publish_refuses(
    token_plane: ServiceProcess, token_channel: grpc.aio.Channel
) -> None:
    meta = metadata_pb2_grpc.MetadataServiceStub(token_channel)
    routing = routing_pb2_grpc.RoutingServiceStub(token_channel)
    d = make_node("node-b")
    await meta.RegisterNode(
        metadata_pb2.RegisterNodeRequest(node=convert.node_to_pb(d), lease_ttl_s=30),
        metadata=bearer("node-b"),
    )
    view = token_plane.ctx.view
    assert await view.wait_for(lambda: any(r.node.node_id == "node-b" for r in view.nodes.values()), 10)
    bad = {
        "remote_host": "evil/../x",
        "remote_port": 99999,
        "remote_num_tokens": 1 << 70,
        "tp_size": 0,
        "remote_block_ids": [[-1]],
    }
    for key, value in bad.items():
        params = {**vllm_params(d), key: value}
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await routing.ReportTurn(
                routing_pb2.ReportTurnRequest(
                    tenant="acme",
                    conversation="c",
                    success=True,
                    decode_kv_transfer_params_json=json.dumps(params),
                ),
                metadata=bearer("ops"),
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, key
        assert key in (err.value.details() or ""), err.value.details()
    # The same host and port through PublishHandles, and an expiry beyond any engine's TTL.
    for mutate, field in (
        (lambda h: setattr(h.vllm, "remote_host", "evil/../x"), "remote_host"),
        (lambda h: setattr(h.vllm, "remote_port", 99999), "remote_port"),
        (
            lambda h: setattr(h, "wall_expiry_unix_ms", int(time.time() * 1000) + 400 * 24 * 3600 * 1000),
            "wall_expiry",
        ),
    ):
        pb = convert.handle_to_pb(make_handle(d, conversation="c"))
        mutate(pb)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await meta.PublishHandles(
                metadata_pb2.PublishHandlesRequest(handles=[pb]), metadata=bearer("node-b")
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in (err.value.details() or "")
    listed = await meta.ListHandles(metadata_pb2.ListHandlesRequest(), metadata=bearer("ops"))
    assert not listed.handles


def _invalid_utf8(method: MethodDescriptor) -> bytes | None:
    """A request whose first string field holds invalid UTF-8; None if it has no string field."""
    from google.protobuf import message_factory

    cls = message_factory.GetMessageClass(method.input_type)
    for field in method.input_type.fields:
        if field.type == field.TYPE_STRING and not field.is_repeated:
            wire = cls(**{field.name: "QQ"}).SerializeToString()
            return wire.replace(b"QQ", b"\xc3\x28")
    return None


@pytest.mark.parametrize(
    ("service", "method"), [pytest.param(s, m, id=method_id((s, m))) for s, m in METHODS]
)
async def test_corrupt_wire_bytes_and_invalid_utf8_are_invalid_argument(
    token_plane: ServiceProcess,
    token_raw: grpc.Channel,
    service: ServiceDescriptor,
    method: MethodDescriptor,
) -> None:
    if method.name == "Commands":
        # Only the leader reads a command stream's messages.
        await eventually(lambda: _true(coordinator_of(token_plane).is_leader), what="leadership")
    # As the operator (the node, for its streams), so the request itself is what is judged.
    who = bearer("node-a") if method.name in ("Commands", "StreamPrefixCache") else bearer("ops")
    for payload in (b"\xff\xff\xff\xff", b"\x0a\xff", _invalid_utf8(method)):
        if payload is None:
            continue
        outcome = await raw_call(token_raw, service, method, [payload], who)
        assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT, (payload, outcome)
        assert "Traceback" not in outcome.details and "Exception" not in outcome.details


async def test_a_node_agent_whose_token_is_refused_says_so_at_warning_level(
    token_plane: ServiceProcess, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    from kvplane.connector.node_agent import NodeAgent, NodeAgentSettings
    from kvplane.services.client.credentials import ClientCredentials
    from kvplane.services.common.model.nodes import NodeLoad

    node = make_node("node-a", incarnation="")
    agent = NodeAgent(
        NodeAgentSettings(
            metadata_target=target(token_plane),
            backoff_initial_s=0.02,
            backoff_max_s=0.2,
            credentials=ClientCredentials(token="not-a-known-token"),
        ),
        node,
        lambda: NodeLoad("node-a", ""),
        lambda _request_id: None,
    )
    with caplog.at_level(logging.WARNING, logger="kvplane.connector.node_agent"):
        agent.start()
        try:

            async def warned() -> bool:
                return any(
                    r.levelno == logging.WARNING and "UNAUTHENTICATED" in r.getMessage()
                    for r in caplog.records
                )

            await eventually(warned, what="a warning naming the refusal")
        finally:
            agent.stop(timeout_s=5)
    message = next(r.getMessage() for r in caplog.records if "UNAUTHENTICATED" in r.getMessage())
    assert "node-a" in message and "bearer token" in message and "not-a-known-token" not in message
    assert not agent.stats().registered


async def test_tenants_are_told_no_engine_address_unless_the_deployment_allows_it(
    token_channel: grpc.aio.Channel, etcd: LocalEtcd, prefix: str
) -> None:
    # By default (auth.tenants_see_engines off) tenants route through the gateway only.
    meta = metadata_pb2_grpc.MetadataServiceStub(token_channel)
    routing = routing_pb2_grpc.RoutingServiceStub(token_channel)
    acme = bearer("acme")
    for call in (
        routing.Route(
            routing_pb2.RouteRequest(conversation="c", model="tiny", prompt_tokens=10), metadata=acme
        ),
        meta.CheckOutHandle(metadata_pb2.CheckOutHandleRequest(conversation="c"), metadata=acme),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "gateway" in (err.value.details() or "")
    # The gateway (an operator) routes for the tenant.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await routing.Route(
            routing_pb2.RouteRequest(tenant="acme", conversation="c", model="tiny", prompt_tokens=10),
            metadata=bearer("ops"),
        )
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # past authorization: no nodes yet
    # A deployment that lets tenants drive engines themselves says so.
    allowed = await start_plane(
        plane_settings(etcd, prefix + "open/", {**token_auth(), "tenants_see_engines": True})
    )
    try:
        async with grpc.aio.insecure_channel(target(allowed)) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await routing_pb2_grpc.RoutingServiceStub(channel).Route(
                    routing_pb2.RouteRequest(conversation="c", model="tiny", prompt_tokens=10), metadata=acme
                )
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await allowed.stop()


async def test_a_rewritten_tokens_file_is_served_without_a_restart(
    etcd: LocalEtcd, prefix: str, tmp_path: Path
) -> None:
    tokens = tmp_path / "tokens.json"

    def write(entries: list[dict[str, str]]) -> None:
        tokens.write_text(json.dumps(entries))
        later = tokens.stat().st_mtime + 5  # whatever the file system's clock resolution
        os.utime(tokens, (later, later))

    write([{"token": "ops-token-before-rotation", "kind": "operator", "name": "ops"}])
    process = await start_plane(plane_settings(etcd, prefix, {"mode": "token", "tokens_file": str(tokens)}))
    try:
        async with grpc.aio.insecure_channel(target(process)) as channel:
            stub = metadata_pb2_grpc.MetadataServiceStub(channel)

            async def list_nodes(token: str) -> grpc.StatusCode:
                try:
                    await stub.ListNodes(
                        metadata_pb2.ListNodesRequest(),
                        metadata=(("authorization", f"Bearer {token}"),),
                        timeout=5,
                    )
                except grpc.aio.AioRpcError as exc:
                    return exc.code()
                return grpc.StatusCode.OK

            assert await list_nodes("ops-token-before-rotation") == grpc.StatusCode.OK
            assert await list_nodes("ops-token-after-rotation") == grpc.StatusCode.UNAUTHENTICATED
            write([{"token": "ops-token-after-rotation", "kind": "operator", "name": "ops"}])

            async def rotated() -> bool:
                return await list_nodes("ops-token-after-rotation") == grpc.StatusCode.OK

            await eventually(rotated, what="the rotated token accepted")
            # The token taken out of the file is refused from then on.
            assert await list_nodes("ops-token-before-rotation") == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await process.stop()
