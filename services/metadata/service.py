"""The metadata service: node registry, handle map and check-out, over gRPC.

Stateless apart from etcd: any replica answers any call, and a restart loses
nothing. Protobuf stops at this boundary; the store works on domain types.
A dead node's handles are purged by the eviction leader, their one owner
(`kvplane.services.eviction.coordinator`), not here.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Sequence

from kvplane.connector.digests import DigestFormatError, checkpoints
from kvplane.services.common.model import convert, validation
from kvplane.services.common.model.errors import (
    InvalidArgument,
    NodeNotRegistered,
    NotFound,
    StoreUnavailable,
)
from kvplane.services.common.model.handles import CacheHandle, HandleFormatError, ReleaseReason
from kvplane.services.common.model.nodes import Node
from kvplane.services.common.runtime.auth import Principal, PrincipalKind
from kvplane.services.common.runtime.grpc_errors import rpc_method
from kvplane.services.common.runtime.server import Context, caller
from kvplane.services.common.runtime.telemetry import Telemetry
from kvplane.services.common.store import Compacted, FreedBlocks, NodeRecord, PublishHint, Store, WatchEvent
from kvplane.services.common.store.cluster_view import ClusterView
from kvplane.services.metadata.settings import MetadataSection
from kvplane.v1 import handle_pb2, metadata_pb2, metadata_pb2_grpc, node_pb2

log = logging.getLogger(__name__)

SERVICE_NAME = metadata_pb2.DESCRIPTOR.services_by_name["MetadataService"].full_name
_INTERNAL = (PrincipalKind.NODE, PrincipalKind.OPERATOR)


class MetadataService(metadata_pb2_grpc.MetadataServiceServicer):
    """Implements kvplane.v1.MetadataService over the etcd store."""

    def __init__(
        self, store: Store, settings: MetadataSection, telemetry: Telemetry, view: ClusterView | None = None
    ) -> None:
        self.store = store
        self.settings = settings
        self.telemetry = telemetry
        # The process's watch-fed view: what it holds of a node or a conversation saves the
        # read before a keep-alive, a load report or a publish (each write stays fenced).
        self.view = view

    def _node_hint(self, node_id: str) -> NodeRecord | None:
        view = self.view
        return view.nodes.get(node_id) if view is not None and view.healthy else None

    def _publish_hint(self, handle: CacheHandle) -> PublishHint | None:
        view = self.view
        if view is None or not view.healthy:
            return None
        node = view.nodes.get(handle.holder_node_id)
        return PublishHint(node, view.handle(handle.tenant, handle.conversation))

    def _caller(self, context: Context) -> Principal:
        return caller(self, context)

    # -- nodes ------------------------------------------------------------------

    @rpc_method
    async def RegisterNode(
        self, request: metadata_pb2.RegisterNodeRequest, context: Context
    ) -> metadata_pb2.RegisterNodeResponse:
        principal = self._caller(context)
        principal.require(PrincipalKind.NODE)
        node = _valid_node(request.node)
        principal.as_node(node.node_id, "node.node_id")
        ttl = request.lease_ttl_s or self.settings.default_lease_ttl_s
        validation.in_range(ttl, "lease_ttl_s", 2, 300)
        lease = await self.store.register_node(node, ttl)
        log.info("node registered", extra={"node": node.node_id, "incarnation": node.incarnation})
        return metadata_pb2.RegisterNodeResponse(lease_id=lease, lease_ttl_s=ttl)

    @rpc_method
    async def KeepAlive(
        self, request: metadata_pb2.KeepAliveRequest, context: Context
    ) -> metadata_pb2.KeepAliveResponse:
        principal = self._caller(context)
        principal.require(PrincipalKind.NODE)
        principal.as_node(validation.ident(request.node_id, "node_id"), "node_id")
        validation.ident(request.incarnation, "incarnation")
        ttl = await self.store.keep_alive(
            request.node_id, request.incarnation, request.lease_id, self._node_hint(request.node_id)
        )
        return metadata_pb2.KeepAliveResponse(lease_ttl_s=ttl)

    @rpc_method
    async def ReportLoad(
        self, request: metadata_pb2.ReportLoadRequest, context: Context
    ) -> metadata_pb2.ReportLoadResponse:
        principal = self._caller(context)
        principal.require(PrincipalKind.NODE)
        principal.as_node(validation.ident(request.load.node_id, "load.node_id"), "load.node_id")
        validation.ident(request.load.incarnation, "load.incarnation")
        load = convert.checked_load_from_pb(request.load)
        await self.store.report_load(load, self._node_hint(request.load.node_id))
        return metadata_pb2.ReportLoadResponse()

    @rpc_method
    async def DrainNode(
        self, request: metadata_pb2.DrainNodeRequest, context: Context
    ) -> metadata_pb2.DrainNodeResponse:
        principal = self._caller(context)
        principal.require(*_INTERNAL)
        node_id = principal.as_node(validation.ident(request.node_id, "node_id"), "node_id", operator=True)
        await self.store.set_draining(node_id)
        return metadata_pb2.DrainNodeResponse()

    @rpc_method
    async def DeregisterNode(
        self, request: metadata_pb2.DeregisterNodeRequest, context: Context
    ) -> metadata_pb2.DeregisterNodeResponse:
        principal = self._caller(context)
        principal.require(*_INTERNAL)
        node_id = principal.as_node(validation.ident(request.node_id, "node_id"), "node_id", operator=True)
        await self.store.deregister_node(node_id, validation.ident(request.incarnation, "incarnation"))
        return metadata_pb2.DeregisterNodeResponse()

    @rpc_method
    async def ListNodes(
        self, request: metadata_pb2.ListNodesRequest, context: Context
    ) -> metadata_pb2.ListNodesResponse:
        # Engine addresses: never a tenant's to see.
        self._caller(context).require(*_INTERNAL)
        _, nodes = await self.store.list_nodes()
        return metadata_pb2.ListNodesResponse(
            nodes=[
                metadata_pb2.NodeStatus(
                    node=convert.node_to_pb(record.node), load=convert.load_to_pb(load) if load else None
                )
                for record, load in nodes
            ]
        )

    # -- handles ----------------------------------------------------------------

    @rpc_method
    async def PublishHandles(
        self, request: metadata_pb2.PublishHandlesRequest, context: Context
    ) -> metadata_pb2.PublishHandlesResponse:
        principal = self._caller(context)
        principal.require(PrincipalKind.NODE)
        validation.count(len(request.handles), "handles", 1, validation.MAX_PUBLISH_BATCH)
        handles = [_valid_handle(pb, f"handles[{i}]") for i, pb in enumerate(request.handles)]
        for i, handle in enumerate(handles):
            # A node publishes only blocks it holds itself.
            principal.as_node(handle.holder_node_id, f"handles[{i}].holder_node_id")
        freed = _freed_with(handles, request.released_remote_request_ids)
        results = []
        for handle in handles:
            # The freed requests are recorded before or with the first handle (an engine frees a
            # request's blocks before it retains the next turn's).
            outcome = await self.store.publish_handle(handle, self._publish_hint(handle), freed)
            freed = None
            if outcome.relocation_refused:
                results.append(metadata_pb2.PublishResult(relocation_refused=True))
                continue
            if outcome.freed:
                results.append(metadata_pb2.PublishResult(blocks_freed=True))
                continue
            results.append(
                metadata_pb2.PublishResult(
                    handle_id=outcome.handle.handle_id,
                    superseded_handle_id=outcome.superseded.handle.handle_id if outcome.superseded else "",
                )
            )
        return metadata_pb2.PublishHandlesResponse(
            results=results, released_recorded=len(request.released_remote_request_ids)
        )

    @rpc_method
    async def ReportReleased(
        self, request: metadata_pb2.ReportReleasedRequest, context: Context
    ) -> metadata_pb2.ReportReleasedResponse:
        principal = self._caller(context)
        principal.require(PrincipalKind.NODE)
        principal.as_node(validation.ident(request.node_id, "node_id"), "node_id")
        validation.ident(request.incarnation, "incarnation")
        validation.count(
            len(request.remote_request_ids), "remote_request_ids", 1, validation.MAX_RELEASE_REPORT
        )
        for i, rid in enumerate(request.remote_request_ids):
            validation.ident(rid, f"remote_request_ids[{i}]")
        removed = await self.store.release_freed(
            request.node_id, request.incarnation, request.remote_request_ids
        )
        return metadata_pb2.ReportReleasedResponse(removed=removed)

    @rpc_method
    async def ReconcileRetained(
        self, request: metadata_pb2.ReconcileRetainedRequest, context: Context
    ) -> metadata_pb2.ReconcileRetainedResponse:
        principal = self._caller(context)
        principal.require(PrincipalKind.NODE)
        principal.as_node(validation.ident(request.node_id, "node_id"), "node_id")
        validation.ident(request.incarnation, "incarnation")
        validation.count(
            len(request.remote_request_ids), "remote_request_ids", 0, validation.MAX_RELEASE_REPORT
        )
        for i, rid in enumerate(request.remote_request_ids):
            validation.ident(rid, f"remote_request_ids[{i}]")
        # Only the registered incarnation may free its blocks this way.
        record = await self.store.get_node(request.node_id)
        if record is None or record.node.incarnation != request.incarnation:
            raise NodeNotRegistered(
                f"node {request.node_id!r} incarnation {request.incarnation!r} is not registered"
            )
        unreferenced = await self.store.unreferenced(
            request.node_id, request.incarnation, request.remote_request_ids
        )
        return metadata_pb2.ReconcileRetainedResponse(unreferenced_request_ids=unreferenced)

    @rpc_method
    async def GetHandle(
        self, request: metadata_pb2.GetHandleRequest, context: Context
    ) -> metadata_pb2.GetHandleResponse:
        principal = self._caller(context)
        tenant = principal.acts_for(request.tenant)
        conversation = validation.conversation(request.conversation)
        view = await self.store.get_handle(tenant, conversation)
        if view is None:
            raise NotFound(f"no handle for conversation {conversation!r}")
        return metadata_pb2.GetHandleResponse(
            handle=_as_seen_by(principal, convert.handle_to_pb(view.handle)),
            state=convert.state_to_pb(view.state),
        )

    @rpc_method
    async def CheckOutHandle(
        self, request: metadata_pb2.CheckOutHandleRequest, context: Context
    ) -> metadata_pb2.CheckOutHandleResponse:
        principal = self._caller(context)
        tenant = principal.acts_for(request.tenant)
        principal.require_engine_access("CheckOutHandle")
        conversation = validation.conversation(request.conversation)
        validation.ident(request.handle_id, "handle_id", required=False)
        validation.ident(request.route_id, "route_id", required=False)
        checkout = await self.store.check_out(
            tenant, conversation, route_id=request.route_id, handle_id=request.handle_id
        )
        return metadata_pb2.CheckOutHandleResponse(
            handle=convert.handle_to_pb(checkout.handle), claim_id=checkout.claim_id
        )

    @rpc_method
    async def ReleaseHandle(
        self, request: metadata_pb2.ReleaseHandleRequest, context: Context
    ) -> metadata_pb2.ReleaseHandleResponse:
        tenant = self._caller(context).acts_for(request.tenant)
        conversation = validation.conversation(request.conversation)
        validation.ident(request.handle_id, "handle_id", required=False)
        reason = (
            convert.reason_from_pb(request.reason)
            if request.reason != handle_pb2.RELEASE_REASON_UNSPECIFIED
            else ReleaseReason.REQUESTED
        )
        pending = await self.store.release(tenant, conversation, reason, handle_id=request.handle_id)
        return metadata_pb2.ReleaseHandleResponse(
            handle=convert.handle_to_pb(pending.handle), command_id=pending.command_id
        )

    @rpc_method
    async def ListHandles(
        self, request: metadata_pb2.ListHandlesRequest, context: Context
    ) -> metadata_pb2.ListHandlesResponse:
        principal = self._caller(context)
        node_id = validation.ident(request.node_id, "node_id", required=False)
        if principal.kind is PrincipalKind.NODE:
            # A node lists only the handles it holds.
            if not node_id and principal.name.endswith("*"):
                raise InvalidArgument("node_id", "is required for a token shared by several nodes")
            node_id = principal.as_node(node_id or principal.name, "node_id")
            tenant = validation.tenant(request.tenant, "tenant") if request.tenant else ""
        else:
            tenant = principal.acts_for(request.tenant) if (request.tenant or principal.tenant) else ""
        page_size = request.page_size or 100
        validation.in_range(page_size, "page_size", 1, 1000)
        token = _decode_page_token(request.page_token)
        handles, next_token = await self.store.list_handles(
            tenant=tenant, node_id=node_id, page_size=page_size, page_token=token
        )
        return metadata_pb2.ListHandlesResponse(
            handles=[_as_seen_by(principal, convert.handle_to_pb(h)) for h in handles],
            next_page_token=next_token.hex(),
        )

    @rpc_method
    async def Watch(
        self, request: metadata_pb2.WatchRequest, context: Context
    ) -> AsyncIterator[metadata_pb2.WatchResponse]:
        # Every tenant's handles and every engine's address: operators only.
        self._caller(context).require(PrincipalKind.OPERATOR)
        kinds = set(request.kinds) or {
            metadata_pb2.WATCH_KIND_NODES,
            metadata_pb2.WATCH_KIND_LOADS,
            metadata_pb2.WATCH_KIND_HANDLES,
        }
        keys = self.store.keys
        prefixes = {
            metadata_pb2.WATCH_KIND_NODES: keys.nodes_prefix(),
            metadata_pb2.WATCH_KIND_LOADS: keys.loads_prefix(),
            metadata_pb2.WATCH_KIND_HANDLES: keys.handles_prefix(),
        }
        wanted = tuple(prefixes[k] for k in kinds if k in prefixes)
        revision, events = await self.store.read_prefix(keys.prefix.encode())
        for event in events:
            if event.key.startswith(wanted):
                yield self._watch_response(event)
        yield metadata_pb2.WatchResponse(revision=revision, snapshot_done=True)
        try:
            async for batch in self.store.watch_prefix(keys.prefix.encode(), revision + 1):
                for event in batch:
                    if event.key.startswith(wanted):
                        yield self._watch_response(event)
        except Compacted as exc:
            raise StoreUnavailable(f"watch fell behind ({exc}); watch again") from exc

    def _watch_response(self, event: WatchEvent) -> metadata_pb2.WatchResponse:
        keys = self.store.keys
        out = metadata_pb2.WatchResponse(revision=event.revision, deleted=event.deleted)
        value = event.prev_value if event.deleted else event.value
        if event.key.startswith(keys.nodes_prefix()):
            if value:
                out.node.CopyFrom(node_pb2.Node.FromString(value))
        elif event.key.startswith(keys.loads_prefix()):
            if value:
                out.load.CopyFrom(node_pb2.NodeLoad.FromString(value))
        elif value:
            out.handle.CopyFrom(handle_pb2.CacheHandle.FromString(value))
        return out


def _as_seen_by(principal: Principal, pb: handle_pb2.CacheHandle) -> handle_pb2.CacheHandle:
    """The handle without engine addresses and block ids when a tenant asks."""
    if principal.kind is PrincipalKind.TENANT:
        pb.vllm.ClearField("remote_host")
        pb.vllm.ClearField("remote_port")
        pb.vllm.ClearField("remote_engine_id")
        pb.vllm.ClearField("remote_block_ids")
        pb.vllm.ClearField("extra_json")
    return pb


def _decode_page_token(token: str) -> bytes:
    try:
        return bytes.fromhex(token)
    except ValueError:
        raise InvalidArgument("page_token", "is not a token this service issued") from None


def _valid_node(pb: node_pb2.Node) -> Node:
    validation.ident(pb.node_id, "node.node_id")
    validation.ident(pb.incarnation, "node.incarnation")
    validation.ident(pb.engine_id, "node.engine_id")
    if pb.role == node_pb2.NODE_ROLE_UNSPECIFIED:
        raise InvalidArgument("node.role", "is required (prefill, decode or both)")
    if pb.role not in (node_pb2.NODE_ROLE_PREFILL, node_pb2.NODE_ROLE_DECODE, node_pb2.NODE_ROLE_BOTH):
        raise InvalidArgument("node.role", f"unknown role {pb.role}")
    validation.http_url(pb.http_url, "node.http_url")
    validation.host(pb.side_channel_host, "node.side_channel_host")
    validation.in_range(pb.side_channel_port, "node.side_channel_port", 1, 65535)
    validation.in_range(pb.block_size, "node.block_size", 1, 1 << 20)
    for name in ("tp_size", "pp_size", "dcp_size"):
        value = getattr(pb, name)
        if value:
            validation.in_range(value, f"node.{name}", 1, 4096)
    validation.text(pb.fingerprint.model, "node.fingerprint.model", max_bytes=256)
    validation.count(len(pb.labels), "node.labels", 0, validation.MAX_LABELS)
    for key, value in pb.labels.items():
        validation.text(key, "node.labels key", max_bytes=63)
        validation.text(value, f"node.labels[{key}]", max_bytes=256, required=False)
    return convert.node_from_pb(pb)


def _freed_with(handles: list[CacheHandle], request_ids: Sequence[str]) -> FreedBlocks | None:
    """The freed requests a publish reports (`released_remote_request_ids`), of the one holder
    incarnation its handles name; None when there are none."""
    validation.count(len(request_ids), "released_remote_request_ids", 0, validation.MAX_RELEASE_REPORT)
    if not request_ids:
        return None
    for i, rid in enumerate(request_ids):
        validation.ident(rid, f"released_remote_request_ids[{i}]")
    holders = {(h.holder_node_id, h.holder_incarnation) for h in handles}
    if len(holders) != 1:
        raise InvalidArgument(
            "released_remote_request_ids", "needs every handle to name one holder incarnation"
        )
    ((node_id, incarnation),) = holders
    return FreedBlocks(node_id, incarnation, tuple(dict.fromkeys(request_ids)))


def _valid_handle(pb: handle_pb2.CacheHandle, field: str) -> CacheHandle:
    validation.tenant(pb.tenant, f"{field}.tenant")
    validation.conversation(pb.conversation, f"{field}.conversation")
    validation.ident(pb.handle_id, f"{field}.handle_id", required=False)
    validation.ident(pb.relocates_handle_id, f"{field}.relocates_handle_id", required=False)
    if pb.tier not in handle_pb2.KvTier.values():
        raise InvalidArgument(f"{field}.tier", f"unknown tier {pb.tier}")
    validation.ident(pb.holder_node_id, f"{field}.holder_node_id")
    validation.ident(pb.holder_incarnation, f"{field}.holder_incarnation")
    v = pb.vllm
    validation.ident(v.remote_engine_id, f"{field}.vllm.remote_engine_id")
    validation.ident(v.remote_request_id, f"{field}.vllm.remote_request_id")
    validation.host(v.remote_host, f"{field}.vllm.remote_host")
    validation.in_range(v.remote_port, f"{field}.vllm.remote_port", 1, 65535)
    validation.count(len(v.remote_block_ids), f"{field}.vllm.remote_block_ids", 1, validation.MAX_GROUPS)
    for i, group in enumerate(v.remote_block_ids):
        validation.count(
            len(group.block_ids), f"{field}.vllm.remote_block_ids[{i}]", 1, validation.MAX_BLOCKS_PER_GROUP
        )
    if v.remote_num_tokens <= 0:
        raise InvalidArgument(f"{field}.vllm.remote_num_tokens", "must be positive")
    if pb.wall_expiry_unix_ms <= 0:
        raise InvalidArgument(f"{field}.wall_expiry_unix_ms", "is required (ms since the Unix epoch)")
    if pb.HasField("digests"):
        d = pb.digests
        if d.block_size <= 0:
            raise InvalidArgument(f"{field}.digests.block_size", "must be positive")
        if len(d.values) != len(checkpoints(d.num_blocks)):
            raise InvalidArgument(f"{field}.digests.values", "do not match the checkpoints of num_blocks")
    if v.extra_json:
        try:
            if not isinstance(json.loads(v.extra_json), dict):
                raise ValueError
        except ValueError:
            raise InvalidArgument(f"{field}.vllm.extra_json", "must be a JSON object") from None
    try:
        handle = convert.handle_from_pb(pb)
    except (HandleFormatError, DigestFormatError, ValueError) as exc:
        raise InvalidArgument(field, str(exc)) from None
    return validation.cache_handle(handle, field, now_unix_ms=int(time.time() * 1000))
