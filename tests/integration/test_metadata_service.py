"""The metadata service over real gRPC and a real etcd."""

from __future__ import annotations

import asyncio
import dataclasses
import urllib.request

import grpc
import pytest
from aetcd import rpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvplane.services.common.model import convert
from kvplane.services.common.model.handles import CacheHandle, HandleState
from kvplane.services.common.model.nodes import Node, NodeLoad
from kvplane.services.common.runtime.telemetry import Telemetry
from kvplane.services.dev.local_etcd import LocalEtcd
from kvplane.services.metadata.app import install
from kvplane.services.process import ServiceProcess
from kvplane.v1 import handle_pb2, metadata_pb2, metadata_pb2_grpc
from tests.conftest import NODE_HEADERS, OPERATOR_HEADERS, make_node, settings_for, tenant_headers
from tests.support.factories import make_handle
from tests.support.polling import eventually

HOSTILE_CONVERSATIONS = ["a/b", "..", "../../nodes/d0", "\x00", "x\x00y", "会话🙂", "c" * 256, "a%2Fb", "a b"]


async def _register(stub: metadata_pb2_grpc.MetadataServiceStub, node_id: str = "d0"):  # type: ignore[no-untyped-def]
    node = make_node(node_id)
    await stub.RegisterNode(
        metadata_pb2.RegisterNodeRequest(node=convert.node_to_pb(node), lease_ttl_s=30), metadata=NODE_HEADERS
    )
    return node


async def _publish(stub: metadata_pb2_grpc.MetadataServiceStub, handle) -> str:  # type: ignore[no-untyped-def]
    resp = await stub.PublishHandles(
        metadata_pb2.PublishHandlesRequest(handles=[convert.handle_to_pb(handle)]), metadata=NODE_HEADERS
    )
    return resp.results[0].handle_id


def _etcd_calls(process: ServiceProcess, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The operation names of the etcd requests `process` makes from now on, in order."""
    calls: list[str] = []
    real = process.store.etcd.call

    async def counted(op: str, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(op)
        return await real(op, *args, **kwargs)

    monkeypatch.setattr(process.store.etcd, "call", counted)
    return calls


async def test_publish_get_checkout_over_grpc_is_single_use(metadata_channel: grpc.aio.Channel) -> None:
    stub = metadata_pb2_grpc.MetadataServiceStub(metadata_channel)
    node = await _register(stub)
    handle_id = await _publish(stub, make_handle(node))
    got = await stub.GetHandle(
        metadata_pb2.GetHandleRequest(conversation="conv-1"), metadata=tenant_headers("acme")
    )
    assert got.handle.handle_id == handle_id and got.state == handle_pb2.HANDLE_STATE_RETAINED

    async def checkout() -> grpc.StatusCode:
        try:
            await stub.CheckOutHandle(
                metadata_pb2.CheckOutHandleRequest(conversation="conv-1"), metadata=tenant_headers("acme")
            )
            return grpc.StatusCode.OK
        except grpc.aio.AioRpcError as exc:
            return exc.code()

    codes = await asyncio.gather(*[checkout() for _ in range(20)])
    assert codes.count(grpc.StatusCode.OK) == 1
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND}


async def test_release_of_a_checked_out_handle_is_refused(metadata_channel: grpc.aio.Channel) -> None:
    stub = metadata_pb2_grpc.MetadataServiceStub(metadata_channel)
    node = await _register(stub)
    handle_id = await _publish(stub, make_handle(node))
    await stub.CheckOutHandle(
        metadata_pb2.CheckOutHandleRequest(conversation="conv-1"), metadata=tenant_headers("acme")
    )
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.ReleaseHandle(
            metadata_pb2.ReleaseHandleRequest(conversation="conv-1", handle_id=handle_id),
            metadata=tenant_headers("acme"),
        )
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_tenant_comes_from_credentials_not_the_body(metadata_channel: grpc.aio.Channel) -> None:
    stub = metadata_pb2_grpc.MetadataServiceStub(metadata_channel)
    node = await _register(stub)
    await _publish(stub, make_handle(node, tenant="acme", conversation="shared-id"))
    # Tenant B names tenant A in the body: refused.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.CheckOutHandle(
            metadata_pb2.CheckOutHandleRequest(tenant="acme", conversation="shared-id"),
            metadata=tenant_headers("bravo"),
        )
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # Tenant B with the same conversation id sees nothing.
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.CheckOutHandle(
            metadata_pb2.CheckOutHandleRequest(conversation="shared-id"), metadata=tenant_headers("bravo")
        )
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


async def test_hostile_conversation_ids_stay_in_their_own_key(metadata_channel: grpc.aio.Channel) -> None:
    stub = metadata_pb2_grpc.MetadataServiceStub(metadata_channel)
    node = await _register(stub)
    ids = {}
    for conv in HOSTILE_CONVERSATIONS:
        ids[conv] = await _publish(stub, make_handle(node, conversation=conv))
    for conv in HOSTILE_CONVERSATIONS:
        got = await stub.GetHandle(
            metadata_pb2.GetHandleRequest(conversation=conv), metadata=tenant_headers("acme")
        )
        assert got.handle.handle_id == ids[conv]
        assert got.handle.conversation == conv
    # The node record was not overwritten through "../../nodes/d0".
    nodes = await stub.ListNodes(metadata_pb2.ListNodesRequest(), metadata=OPERATOR_HEADERS)
    assert [n.node.node_id for n in nodes.nodes] == ["d0"]
    listed = await stub.ListHandles(
        metadata_pb2.ListHandlesRequest(tenant="acme", page_size=4), metadata=OPERATOR_HEADERS
    )
    seen = [h.conversation for h in listed.handles]
    while listed.next_page_token:
        listed = await stub.ListHandles(
            metadata_pb2.ListHandlesRequest(tenant="acme", page_size=4, page_token=listed.next_page_token),
            metadata=OPERATOR_HEADERS,
        )
        seen += [h.conversation for h in listed.handles]
    assert sorted(seen) == sorted(HOSTILE_CONVERSATIONS)


INVALID = [
    ("conversation", metadata_pb2.GetHandleRequest(conversation="")),
    ("conversation", metadata_pb2.GetHandleRequest(conversation="x" * 513)),
    ("page_size", metadata_pb2.ListHandlesRequest(page_size=5000)),
    ("page_token", metadata_pb2.ListHandlesRequest(page_token="zz")),
]


@pytest.mark.parametrize(("field", "request_"), INVALID)
async def test_invalid_reads_name_the_field(
    metadata_channel: grpc.aio.Channel, field: str, request_: object
) -> None:
    stub = metadata_pb2_grpc.MetadataServiceStub(metadata_channel)
    method = stub.GetHandle if isinstance(request_, metadata_pb2.GetHandleRequest) else stub.ListHandles
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await method(request_, metadata=tenant_headers("acme"))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in (err.value.details() or "")


def _bad_handle_cases():  # type: ignore[no-untyped-def]
    node = make_node()
    good = convert.handle_to_pb(make_handle(node))
    cases = []
    for field, mutate in [
        ("handles[0].tenant", lambda h: setattr(h, "tenant", "")),
        ("handles[0].conversation", lambda h: setattr(h, "conversation", "x" * 600)),
        ("handles[0].holder_node_id", lambda h: setattr(h, "holder_node_id", "")),
        ("handles[0].vllm.remote_port", lambda h: setattr(h.vllm, "remote_port", 0)),
        ("handles[0].vllm.remote_host", lambda h: setattr(h.vllm, "remote_host", "[::1]")),
        ("handles[0].vllm.remote_block_ids", lambda h: h.vllm.ClearField("remote_block_ids")),
        ("handles[0].vllm.remote_num_tokens", lambda h: setattr(h.vllm, "remote_num_tokens", 0)),
        ("handles[0].wall_expiry_unix_ms", lambda h: setattr(h, "wall_expiry_unix_ms", 0)),
        ("handles[0].digests.values", lambda h: h.digests.values.append(1)),
        ("handles[0].vllm.extra_json", lambda h: setattr(h.vllm, "extra_json", "[1]")),
        ("handles[0].tier", lambda h: setattr(h, "tier", 7)),
        ("handles[0].relocates_handle_id", lambda h: setattr(h, "relocates_handle_id", "r" * 10_000)),
    ]:
        pb = handle_pb2.CacheHandle()
        pb.CopyFrom(good)
        mutate(pb)
        cases.append((field, pb))
    return cases


@pytest.mark.parametrize(("field", "handle"), _bad_handle_cases())
async def test_invalid_handles_name_the_field(
    metadata_channel: grpc.aio.Channel, field: str, handle: handle_pb2.CacheHandle
) -> None:
    stub = metadata_pb2_grpc.MetadataServiceStub(metadata_channel)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.PublishHandles(metadata_pb2.PublishHandlesRequest(handles=[handle]), metadata=NODE_HEADERS)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in (err.value.details() or "")


@pytest.mark.parametrize(
    ("field", "mutate"),
    [
        ("node.node_id", lambda n: setattr(n, "node_id", "")),
        ("node.role", lambda n: setattr(n, "role", 0)),
        ("node.http_url", lambda n: setattr(n, "http_url", "http://fd00::1:80")),
        ("node.side_channel_port", lambda n: setattr(n, "side_channel_port", 70000)),
        ("node.block_size", lambda n: setattr(n, "block_size", 0)),
    ],
)
async def test_invalid_nodes_name_the_field(metadata_channel: grpc.aio.Channel, field: str, mutate) -> None:  # type: ignore[no-untyped-def]
    stub = metadata_pb2_grpc.MetadataServiceStub(metadata_channel)
    pb = convert.node_to_pb(make_node())
    mutate(pb)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.RegisterNode(metadata_pb2.RegisterNodeRequest(node=pb), metadata=NODE_HEADERS)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in (err.value.details() or "")


async def test_tenants_cannot_register_nodes_or_publish(metadata_channel: grpc.aio.Channel) -> None:
    stub = metadata_pb2_grpc.MetadataServiceStub(metadata_channel)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await stub.RegisterNode(
            metadata_pb2.RegisterNodeRequest(node=convert.node_to_pb(make_node())),
            metadata=tenant_headers("acme"),
        )
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED


async def test_restarting_the_service_loses_nothing(etcd: LocalEtcd, prefix: str) -> None:
    settings = settings_for(etcd, prefix)
    first = ServiceProcess(settings, [install], Telemetry.disabled())
    await first.start()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{first.grpc_port}") as ch:
        stub = metadata_pb2_grpc.MetadataServiceStub(ch)
        node = await _register(stub)
        ids = [await _publish(stub, make_handle(node, conversation=f"c{i}")) for i in range(10)]
    await first.stop()

    second = ServiceProcess(settings, [install], Telemetry.disabled())
    await second.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{second.grpc_port}") as ch:
            stub = metadata_pb2_grpc.MetadataServiceStub(ch)
            for i, handle_id in enumerate(ids):
                got = await stub.GetHandle(
                    metadata_pb2.GetHandleRequest(conversation=f"c{i}"), metadata=tenant_headers("acme")
                )
                assert got.handle.handle_id == handle_id
            nodes = await stub.ListNodes(metadata_pb2.ListNodesRequest(), metadata=OPERATOR_HEADERS)
            assert [n.node.incarnation for n in nodes.nodes] == [node.incarnation]
    finally:
        await second.stop()


async def test_serve_all_health_reflection_metrics_and_checkout_trace(etcd: LocalEtcd, prefix: str) -> None:
    from kvplane.services.cli import available_services, installers

    exporter = InMemorySpanExporter()
    telemetry = Telemetry.create("kvplane-test", exporter=exporter)
    # Reflection is off unless enabled.
    settings = settings_for(etcd, prefix, grpc={"reflection": True})
    process = ServiceProcess(settings, installers(available_services()), telemetry)
    await process.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{process.grpc_port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            for service in ["", "kvplane.v1.MetadataService"]:
                resp = await health.Check(health_pb2.HealthCheckRequest(service=service))
                assert resp.status == health_pb2.HealthCheckResponse.SERVING

            reflect = reflection_pb2_grpc.ServerReflectionStub(ch)
            names: list[str] = []
            async for resp in reflect.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")])
            ):
                names = [s.name for s in resp.list_services_response.service]
            assert "kvplane.v1.MetadataService" in names
            assert "grpc.health.v1.Health" in names

            stub = metadata_pb2_grpc.MetadataServiceStub(ch)
            node = await _register(stub)
            await _publish(stub, make_handle(node))
            exporter.clear()
            await stub.CheckOutHandle(
                metadata_pb2.CheckOutHandleRequest(conversation="conv-1"), metadata=tenant_headers("acme")
            )

        def checkout_trace() -> bool:
            spans = exporter.get_finished_spans()
            rpc = [s for s in spans if s.name.endswith("CheckOutHandle")]
            txn = [s for s in spans if s.name == "etcd.check_out"]
            return bool(
                rpc and txn and txn[0].parent is not None and txn[0].parent.span_id == rpc[0].context.span_id
            )

        async def traced() -> bool:
            return checkout_trace()

        await eventually(traced, timeout_s=10, what="check-out trace exported")

        url = f"http://127.0.0.1:{process.metrics_port}/metrics"
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
        assert "# TYPE kvplane_etcd_request_seconds histogram" in body
        assert 'kvplane_handle_transitions_total{reason="",transition="checked_out"} 1.0' in body
    finally:
        await process.stop()


async def test_keep_alives_load_reports_and_publishes_read_nothing_the_view_holds(
    metadata_process: ServiceProcess, metadata_channel: grpc.aio.Channel, monkeypatch: pytest.MonkeyPatch
) -> None:
    stub = metadata_pb2_grpc.MetadataServiceStub(metadata_channel)
    node = make_node("d0")
    registered = await stub.RegisterNode(
        metadata_pb2.RegisterNodeRequest(node=convert.node_to_pb(node), lease_ttl_s=30), metadata=NODE_HEADERS
    )
    view = metadata_process.ctx.view
    assert await view.wait_for(lambda: view.live_node("d0", node.incarnation) is not None, 10.0)
    handle_id = await _publish(stub, make_handle(node, conversation="c-view", request_id="r1"))
    assert await view.wait_for(lambda: view.handle("acme", "c-view") is not None, 10.0)
    calls = _etcd_calls(metadata_process, monkeypatch)

    await stub.KeepAlive(
        metadata_pb2.KeepAliveRequest(
            node_id="d0", incarnation=node.incarnation, lease_id=registered.lease_id
        ),
        metadata=NODE_HEADERS,
    )
    assert calls == [], "the lease refresh is the keep-alive's only etcd request"
    load = metadata_pb2.ReportLoadRequest(
        load=convert.load_to_pb(NodeLoad("d0", node.incarnation, running_requests=2, reported_unix_ms=1))
    )
    await stub.ReportLoad(load, metadata=NODE_HEADERS)
    assert calls == ["report_load"]
    calls.clear()
    # The next turn's handle supersedes the one the view holds, in one transaction.
    second = make_handle(node, conversation="c-view", request_id="r2")
    resp = await stub.PublishHandles(
        metadata_pb2.PublishHandlesRequest(handles=[convert.handle_to_pb(second)]), metadata=NODE_HEADERS
    )
    assert resp.results[0].superseded_handle_id == handle_id
    assert [op for op in calls if op != "lease_grant"] == ["publish"]


async def _published_and_checked_out(
    stub: metadata_pb2_grpc.MetadataServiceStub, process: ServiceProcess, conversation: str
) -> tuple[Node, CacheHandle]:
    """d0, registered and live in the service's view, and the handle of its request "turn-1" for
    `conversation` (tenant acme), published and then checked out."""
    node = await _register(stub)
    view = process.ctx.view
    assert await view.wait_for(lambda: view.live_node("d0", node.incarnation) is not None, 10.0)
    handle = make_handle(node, conversation=conversation, request_id="turn-1")
    await _publish(stub, handle)
    await stub.CheckOutHandle(
        metadata_pb2.CheckOutHandleRequest(conversation=conversation), metadata=tenant_headers("acme")
    )
    return node, handle


async def test_a_pulled_turns_freed_blocks_and_its_new_handle_are_one_etcd_transaction(
    metadata_process: ServiceProcess, metadata_channel: grpc.aio.Channel, monkeypatch: pytest.MonkeyPatch
) -> None:
    stub = metadata_pb2_grpc.MetadataServiceStub(metadata_channel)
    # P reads turn 1's blocks for turn 2: the handle is checked out, D frees the blocks after.
    node, first = await _published_and_checked_out(stub, metadata_process, "c-pull")
    view = metadata_process.ctx.view
    assert await view.wait_for(lambda: view.handle("acme", "c-pull") is None, 10.0)
    calls = _etcd_calls(metadata_process, monkeypatch)
    second = make_handle(node, conversation="c-pull", request_id="turn-2")
    resp = await stub.PublishHandles(
        metadata_pb2.PublishHandlesRequest(
            handles=[convert.handle_to_pb(second)], released_remote_request_ids=["turn-1"]
        ),
        metadata=NODE_HEADERS,
    )
    assert resp.released_recorded == 1, "the node learns the service recorded them"
    assert [op for op in calls if op != "lease_grant"] == ["publish"]
    store = metadata_process.store
    claim = await store.etcd.read(
        "test", rpc.RangeRequest(key=store.keys.claimed("d0", node.incarnation, "turn-1"))
    )
    tombstone = await store.etcd.read(
        "test", rpc.RangeRequest(key=store.keys.freed("d0", node.incarnation, "turn-1"))
    )
    assert (len(claim.kvs), len(tombstone.kvs)) == (0, 1), "the claim consumed, the blocks recorded freed"
    retained = await store.get_handle("acme", "c-pull")
    assert retained is not None and retained.handle.vllm.remote_request_id == "turn-2"
    assert (await store.publish_handle(first)).freed, "turn 1's blocks can never be published again"


async def test_a_publish_re_sent_after_its_handle_was_handed_out_is_answered_blocks_freed(
    metadata_process: ServiceProcess, metadata_channel: grpc.aio.Channel
) -> None:
    stub = metadata_pb2_grpc.MetadataServiceStub(metadata_channel)
    _, handle = await _published_and_checked_out(stub, metadata_process, "c-late")
    # The node never saw the first answer and sends the same publish again: nothing is stored,
    # and the answer says why, so the node frees the blocks instead of keeping them retained.
    again = await stub.PublishHandles(
        metadata_pb2.PublishHandlesRequest(handles=[convert.handle_to_pb(handle)]), metadata=NODE_HEADERS
    )
    (result,) = again.results
    assert result.blocks_freed and result.handle_id == "" and not result.relocation_refused
    stored = await metadata_process.store.get_handle("acme", "c-late")
    assert stored is not None and stored.state is HandleState.CHECKED_OUT, "not brought back"


async def test_freed_blocks_reported_with_handles_of_two_incarnations_are_refused_whole(
    metadata_process: ServiceProcess, metadata_channel: grpc.aio.Channel
) -> None:
    stub = metadata_pb2_grpc.MetadataServiceStub(metadata_channel)
    node = await _register(stub)
    ours = make_handle(node, conversation="c-one", request_id="r-1")
    other = dataclasses.replace(
        make_handle(node, conversation="c-two", request_id="r-2"), holder_incarnation="old"
    )
    for ids, handles, field in (
        (["r-0"], [ours, other], "released_remote_request_ids"),
        ([""], [ours], "released_remote_request_ids[0]"),
    ):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.PublishHandles(
                metadata_pb2.PublishHandlesRequest(
                    handles=[convert.handle_to_pb(h) for h in handles], released_remote_request_ids=ids
                ),
                metadata=NODE_HEADERS,
            )
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert field in (err.value.details() or "")
    assert await metadata_process.store.get_handle("acme", "c-one") is None, "nothing stored"


async def test_a_relocation_is_stored_over_grpc_while_its_handle_is_retained_and_refused_after(
    metadata_channel: grpc.aio.Channel,
) -> None:
    stub = metadata_pb2_grpc.MetadataServiceStub(metadata_channel)
    node = await _register(stub)
    handle_id = await _publish(stub, make_handle(node, request_id="turn-1"))
    moved = convert.handle_to_pb(make_handle(node, request_id="turn-1"))
    moved.tier = handle_pb2.KV_TIER_HOST
    moved.relocates_handle_id = handle_id

    stored = await stub.PublishHandles(
        metadata_pb2.PublishHandlesRequest(handles=[moved]), metadata=NODE_HEADERS
    )
    again = await stub.PublishHandles(
        metadata_pb2.PublishHandlesRequest(handles=[moved]), metadata=NODE_HEADERS
    )

    (result,) = stored.results
    assert not result.relocation_refused and result.handle_id not in ("", handle_id)
    got = await stub.GetHandle(
        metadata_pb2.GetHandleRequest(conversation="conv-1"), metadata=tenant_headers("acme")
    )
    assert got.handle.handle_id == result.handle_id and got.handle.tier == handle_pb2.KV_TIER_HOST
    # The handle it named is gone (it was moved): the same relocation again stores nothing.
    (refused,) = again.results
    assert refused.relocation_refused and refused.handle_id == ""
