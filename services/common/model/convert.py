"""Protobuf <-> domain conversion, used only at service and storage boundaries."""

from __future__ import annotations

import json

from kvplane.connector.digests import TokenDigests
from kvplane.services.common.model import validation
from kvplane.services.common.model.handles import (
    CacheHandle,
    Claim,
    HandleState,
    KvTier,
    PendingRelease,
    ReleaseReason,
    VllmHandle,
)
from kvplane.services.common.model.nodes import Fingerprint, Node, NodeLoad, NodeRole
from kvplane.v1 import handle_pb2, node_pb2

_ROLE_TO_PB = {
    NodeRole.PREFILL: node_pb2.NODE_ROLE_PREFILL,
    NodeRole.DECODE: node_pb2.NODE_ROLE_DECODE,
    NodeRole.BOTH: node_pb2.NODE_ROLE_BOTH,
}
_ROLE_FROM_PB = {v: k for k, v in _ROLE_TO_PB.items()}

_REASON_TO_PB = {
    ReleaseReason.REQUESTED: handle_pb2.RELEASE_REASON_REQUESTED,
    ReleaseReason.SUPERSEDED: handle_pb2.RELEASE_REASON_SUPERSEDED,
    ReleaseReason.MAX_AGE: handle_pb2.RELEASE_REASON_MAX_AGE,
    ReleaseReason.NODE_BUDGET: handle_pb2.RELEASE_REASON_NODE_BUDGET,
    ReleaseReason.TENANT_BUDGET: handle_pb2.RELEASE_REASON_TENANT_BUDGET,
    ReleaseReason.LOW_VALUE: handle_pb2.RELEASE_REASON_LOW_VALUE,
    ReleaseReason.CONVERSATION_ENDED: handle_pb2.RELEASE_REASON_CONVERSATION_ENDED,
    ReleaseReason.HOLDER_DOWN: handle_pb2.RELEASE_REASON_HOLDER_DOWN,
    ReleaseReason.DRAIN: handle_pb2.RELEASE_REASON_DRAIN,
    ReleaseReason.FREED_BY_ENGINE: handle_pb2.RELEASE_REASON_FREED_BY_ENGINE,
    ReleaseReason.CLAIM_UNUSED: handle_pb2.RELEASE_REASON_CLAIM_UNUSED,
}
_REASON_FROM_PB = {v: k for k, v in _REASON_TO_PB.items()}

_TIER_TO_PB = {KvTier.DEVICE: handle_pb2.KV_TIER_DEVICE, KvTier.HOST: handle_pb2.KV_TIER_HOST}
# UNSPECIFIED (a handle from before tiers) reads as DEVICE.
_TIER_FROM_PB = {v: k for k, v in _TIER_TO_PB.items()}

_STATE_TO_PB = {
    HandleState.RETAINED: handle_pb2.HANDLE_STATE_RETAINED,
    HandleState.CHECKED_OUT: handle_pb2.HANDLE_STATE_CHECKED_OUT,
    HandleState.RELEASED: handle_pb2.HANDLE_STATE_RELEASED,
}


def role_to_pb(role: NodeRole) -> node_pb2.NodeRole.ValueType:
    return _ROLE_TO_PB[role]


def role_from_pb(role: node_pb2.NodeRole.ValueType) -> NodeRole:
    """Raises KeyError for UNSPECIFIED; validation rejects it earlier."""
    return _ROLE_FROM_PB[role]


def reason_to_pb(reason: ReleaseReason) -> handle_pb2.ReleaseReason.ValueType:
    return _REASON_TO_PB[reason]


def reason_from_pb(reason: handle_pb2.ReleaseReason.ValueType) -> ReleaseReason:
    return _REASON_FROM_PB.get(reason, ReleaseReason.REQUESTED)


def state_to_pb(state: HandleState) -> handle_pb2.HandleState.ValueType:
    return _STATE_TO_PB[state]


def node_to_pb(node: Node) -> node_pb2.Node:
    return node_pb2.Node(
        node_id=node.node_id,
        incarnation=node.incarnation,
        role=role_to_pb(node.role),
        engine_id=node.engine_id,
        http_url=node.http_url,
        side_channel_host=node.side_channel_host,
        side_channel_port=node.side_channel_port,
        dp_rank=node.dp_rank,
        tp_size=node.tp_size,
        pp_size=node.pp_size,
        dcp_size=node.dcp_size,
        block_size=node.block_size,
        fingerprint=node_pb2.CompatibilityFingerprint(
            model=node.fingerprint.model,
            kv_dtype=node.fingerprint.kv_dtype,
            kv_layout=node.fingerprint.kv_layout,
            extra=node.fingerprint.extra,
        ),
        kv_capacity_bytes=node.kv_capacity_bytes,
        kv_bytes_per_token=node.kv_bytes_per_token,
        labels=dict(node.labels),
        draining=node.draining,
        registered_unix_ms=node.registered_unix_ms,
    )


def node_from_pb(pb: node_pb2.Node) -> Node:
    fp = pb.fingerprint
    return Node(
        node_id=pb.node_id,
        incarnation=pb.incarnation,
        role=role_from_pb(pb.role),
        engine_id=pb.engine_id,
        http_url=pb.http_url,
        side_channel_host=pb.side_channel_host,
        side_channel_port=pb.side_channel_port,
        fingerprint=Fingerprint(fp.model, fp.kv_dtype, fp.kv_layout, fp.extra),
        block_size=pb.block_size,
        kv_capacity_bytes=pb.kv_capacity_bytes,
        kv_bytes_per_token=pb.kv_bytes_per_token,
        dp_rank=pb.dp_rank,
        tp_size=pb.tp_size or 1,
        pp_size=pb.pp_size or 1,
        dcp_size=pb.dcp_size or 1,
        labels=dict(pb.labels),
        draining=pb.draining,
        registered_unix_ms=pb.registered_unix_ms,
    )


def load_to_pb(load: NodeLoad) -> node_pb2.NodeLoad:
    return node_pb2.NodeLoad(
        node_id=load.node_id,
        incarnation=load.incarnation,
        queued_requests=load.queued_requests,
        queued_prefill_tokens=load.queued_prefill_tokens,
        running_requests=load.running_requests,
        free_kv_blocks=load.free_kv_blocks,
        total_kv_blocks=load.total_kv_blocks,
        retained_bytes=load.retained_bytes,
        reported_unix_ms=load.reported_unix_ms,
        waiting_kv_blocks=load.waiting_kv_blocks,
    )


def checked_load_from_pb(pb: node_pb2.NodeLoad) -> NodeLoad:
    """A load a node sent, as a domain value; raises InvalidArgument for a count out of range."""
    for name in (
        "queued_requests",
        "queued_prefill_tokens",
        "running_requests",
        "free_kv_blocks",
        "total_kv_blocks",
        "retained_bytes",
        "waiting_kv_blocks",
    ):
        validation.in_range(getattr(pb, name), f"load.{name}", 0, validation.MAX_COUNT)
    validation.in_range(pb.reported_unix_ms, "load.reported_unix_ms", 0, validation.MAX_COUNT)
    return load_from_pb(pb)


def load_from_pb(pb: node_pb2.NodeLoad) -> NodeLoad:
    return NodeLoad(
        node_id=pb.node_id,
        incarnation=pb.incarnation,
        queued_requests=pb.queued_requests,
        queued_prefill_tokens=pb.queued_prefill_tokens,
        running_requests=pb.running_requests,
        free_kv_blocks=pb.free_kv_blocks,
        total_kv_blocks=pb.total_kv_blocks,
        retained_bytes=pb.retained_bytes,
        reported_unix_ms=pb.reported_unix_ms,
        waiting_kv_blocks=pb.waiting_kv_blocks,
    )


def digests_to_pb(d: TokenDigests) -> handle_pb2.TokenDigests:
    return handle_pb2.TokenDigests(
        block_size=d.block_size, num_blocks=d.num_blocks, version=d.version, values=d.values
    )


def digests_from_pb(pb: handle_pb2.TokenDigests) -> TokenDigests:
    return TokenDigests(pb.block_size, pb.num_blocks, tuple(pb.values), pb.version)


def vllm_to_pb(v: VllmHandle) -> handle_pb2.VllmHandle:
    pb = handle_pb2.VllmHandle(
        remote_engine_id=v.remote_engine_id,
        remote_request_id=v.remote_request_id,
        remote_block_ids=[handle_pb2.BlockIdGroup(block_ids=g) for g in v.remote_block_ids],
        remote_num_tokens=v.remote_num_tokens,
        remote_host=v.remote_host,
        remote_port=v.remote_port,
        tp_size=v.tp_size,
        transfer_mode=v.transfer_mode,
        extra_json=v.extra_json(),
    )
    if v.dcp_size is not None:
        pb.dcp_size = v.dcp_size
    if v.pp_size is not None:
        pb.pp_size = v.pp_size
    if v.remote_blocks_expiry_time is not None:
        pb.remote_blocks_expiry_time = v.remote_blocks_expiry_time
    if v.remote_registration_generation is not None:
        pb.remote_registration_generation = v.remote_registration_generation
    return pb


def vllm_from_pb(pb: handle_pb2.VllmHandle) -> VllmHandle:
    return VllmHandle(
        remote_engine_id=pb.remote_engine_id,
        remote_request_id=pb.remote_request_id,
        remote_block_ids=tuple(tuple(g.block_ids) for g in pb.remote_block_ids),
        remote_num_tokens=pb.remote_num_tokens,
        remote_host=pb.remote_host,
        remote_port=pb.remote_port,
        tp_size=pb.tp_size,
        dcp_size=pb.dcp_size if pb.HasField("dcp_size") else None,
        pp_size=pb.pp_size if pb.HasField("pp_size") else None,
        remote_blocks_expiry_time=(
            pb.remote_blocks_expiry_time if pb.HasField("remote_blocks_expiry_time") else None
        ),
        remote_registration_generation=(
            pb.remote_registration_generation if pb.HasField("remote_registration_generation") else None
        ),
        transfer_mode=pb.transfer_mode,
        extra=json.loads(pb.extra_json) if pb.extra_json else {},
    )


def handle_to_pb(h: CacheHandle) -> handle_pb2.CacheHandle:
    pb = handle_pb2.CacheHandle(
        handle_id=h.handle_id,
        tenant=h.tenant,
        conversation=h.conversation,
        holder_node_id=h.holder_node_id,
        holder_incarnation=h.holder_incarnation,
        vllm=vllm_to_pb(h.vllm),
        wall_expiry_unix_ms=h.wall_expiry_unix_ms,
        retained_bytes=h.retained_bytes,
        published_unix_ms=h.published_unix_ms,
        model=h.model,
        tier=_TIER_TO_PB[h.tier],
        relocates_handle_id=h.relocates_handle_id,
    )
    if h.digests is not None:
        pb.digests.CopyFrom(digests_to_pb(h.digests))
    return pb


def handle_from_pb(pb: handle_pb2.CacheHandle) -> CacheHandle:
    return CacheHandle(
        handle_id=pb.handle_id,
        tenant=pb.tenant,
        conversation=pb.conversation,
        holder_node_id=pb.holder_node_id,
        holder_incarnation=pb.holder_incarnation,
        vllm=vllm_from_pb(pb.vllm),
        wall_expiry_unix_ms=pb.wall_expiry_unix_ms,
        retained_bytes=pb.retained_bytes,
        digests=digests_from_pb(pb.digests) if pb.HasField("digests") else None,
        published_unix_ms=pb.published_unix_ms,
        model=pb.model,
        tier=_TIER_FROM_PB.get(pb.tier, KvTier.DEVICE),
        relocates_handle_id=pb.relocates_handle_id,
    )


def claim_to_pb(c: Claim) -> handle_pb2.Claim:
    return handle_pb2.Claim(
        claim_id=c.claim_id,
        handle=handle_to_pb(c.handle),
        route_id=c.route_id,
        claimed_unix_ms=c.claimed_unix_ms,
    )


def claim_from_pb(pb: handle_pb2.Claim) -> Claim:
    return Claim(pb.claim_id, handle_from_pb(pb.handle), pb.route_id, pb.claimed_unix_ms)


def pending_to_pb(p: PendingRelease) -> handle_pb2.PendingRelease:
    return handle_pb2.PendingRelease(
        command_id=p.command_id,
        handle=handle_to_pb(p.handle),
        reason=reason_to_pb(p.reason),
        decided_unix_ms=p.decided_unix_ms,
    )


def pending_from_pb(pb: handle_pb2.PendingRelease) -> PendingRelease:
    return PendingRelease(
        pb.command_id, handle_from_pb(pb.handle), reason_from_pb(pb.reason), pb.decided_unix_ms
    )
