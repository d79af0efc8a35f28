"""All of kvplane's etcd access: nodes, loads, handles, claims and releases.

Every state change of a handle is one etcd transaction, fenced on the
handle key's mod_revision, so that concurrent check-outs, releases and
publishes of one conversation serialize in etcd and exactly one wins.

aetcd supplies the etcd v3 API bindings for grpc.aio; the store drives
them directly so that each request carries its own deadline and every
transaction's outcome is known. A transaction that times out may still
apply: writes that matter carry an id (the claim id, the command id) and an
ambiguous outcome is settled by re-sending the same fenced transaction and
reading that id back (see `_settle`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import grpc
from aetcd import rpc

from kvplane.services.common import convert
from kvplane.services.common.errors import (
    HandleNotRetained,
    NodeNotRegistered,
    NotFound,
    StoreUnavailable,
)
from kvplane.services.common.handles import (
    CacheHandle,
    Claim,
    HandleState,
    PendingRelease,
    ReleaseReason,
)
from kvplane.services.common.keys import KeyLayout, prefix_range_end
from kvplane.services.common.nodes import Node, NodeLoad
from kvplane.services.common.telemetry import Telemetry
from kvplane.v1 import handle_pb2, node_pb2

log = logging.getLogger(__name__)

# gRPC codes after which a write may or may not have been applied.
_AMBIGUOUS = frozenset(
    {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}
)


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True, slots=True)
class StoreSettings:
    endpoints: tuple[str, ...] = ("127.0.0.1:2379",)
    prefix: str = "/kvplane/v1/"
    request_timeout_s: float = 2.0
    # How long an ambiguous write is re-sent before giving up, in seconds.
    settle_timeout_s: float = 10.0


@dataclass(frozen=True, slots=True)
class HandleRecord:
    """A retained handle with the revision that fences changes to it."""

    handle: CacheHandle
    mod_revision: int
    lease: int


@dataclass(frozen=True, slots=True)
class HandleView:
    """What GetHandle reports: the handle and where it is in its life."""

    handle: CacheHandle
    state: HandleState


@dataclass(frozen=True, slots=True)
class PublishOutcome:
    handle: CacheHandle
    mod_revision: int
    superseded: PendingRelease | None


@dataclass(frozen=True, slots=True)
class CheckOut:
    handle: CacheHandle
    claim_id: str
    revision: int


@dataclass(frozen=True, slots=True)
class NodeRecord:
    node: Node
    lease: int
    mod_revision: int


@dataclass(frozen=True, slots=True)
class ElectionRecord:
    """Who leads an election, under which lease, read at `revision`."""

    candidate: str
    lease: int
    mod_revision: int
    revision: int


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One change under a watched prefix."""

    revision: int
    key: bytes
    value: bytes
    deleted: bool
    mod_revision: int
    lease: int
    prev_value: bytes = b""


def _target(endpoints: Sequence[str]) -> str:
    """One gRPC target for all endpoints; pick_first fails over between them."""
    if len(endpoints) == 1:
        return endpoints[0]
    hosts = [e.rsplit(":", 1)[0] for e in endpoints]
    if all(h.startswith("[") for h in hosts):
        return "ipv6:" + ",".join(endpoints)
    if all(h.replace(".", "").isdigit() for h in hosts):
        return "ipv4:" + ",".join(endpoints)
    return endpoints[0]


class Store:
    """kvplane's etcd store. One per process; safe for concurrent tasks."""

    def __init__(self, settings: StoreSettings, telemetry: Telemetry | None = None) -> None:
        self.settings = settings
        self.keys = KeyLayout(settings.prefix)
        self.telemetry = telemetry or Telemetry.disabled()
        self._channel: grpc.aio.Channel | None = None
        self._kv: Any = None
        self._lease: Any = None
        self._watch: Any = None
        # Handle leases are shared per expiry second: one grant serves every
        # handle that expires in the same second.
        self._leases_by_second: dict[int, int] = {}
        self._lease_lock = asyncio.Lock()

    # -- connection ---------------------------------------------------------

    async def connect(self) -> None:
        if self._channel is not None:
            return
        self._channel = grpc.aio.insecure_channel(
            _target(self.settings.endpoints),
            options=[
                ("grpc.lb_policy_name", "pick_first"),
                ("grpc.max_receive_message_length", 64 << 20),
                # Reconnect within a second or two of etcd coming back, not
                # after gRPC's default backoff of up to two minutes.
                ("grpc.initial_reconnect_backoff_ms", 200),
                ("grpc.min_reconnect_backoff_ms", 200),
                ("grpc.max_reconnect_backoff_ms", 1000),
                # Notice a silently dead connection (etcd allows pings every 5 s).
                ("grpc.keepalive_time_ms", 5000),
                ("grpc.keepalive_timeout_ms", 2000),
                ("grpc.keepalive_permit_without_calls", 1),
            ],
        )
        self._kv = rpc.KVStub(self._channel)
        self._lease = rpc.LeaseStub(self._channel)
        self._watch = rpc.WatchStub(self._channel)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def __aenter__(self) -> Store:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _rpc(self, op: str, method: Any, request: Any, **attrs: Any) -> Any:
        if self._channel is None:
            await self.connect()
        with self.telemetry.etcd_span(op, **attrs):
            try:
                return await method(request, timeout=self.settings.request_timeout_s)
            except grpc.aio.AioRpcError as exc:
                if exc.code() in _AMBIGUOUS:
                    raise _Ambiguous(op, exc) from exc
                if "lease not found" in (exc.details() or ""):
                    raise LeaseNotFound(f"etcd {op}: {exc.details()}") from exc
                raise StoreUnavailable(f"etcd {op} failed: {exc.code().name}: {exc.details()}") from exc

    async def _txn(
        self, op: str, compare: list[Any], success: list[Any], failure: list[Any] | None = None, **attrs: Any
    ) -> Any:
        request = rpc.TxnRequest(compare=compare, success=success, failure=failure or [])
        return await self._rpc(op, self._kv.Txn, request, **attrs)

    async def _read(self, op: str, request: Any) -> Any:
        """A range read; reads are idempotent, so a failure is just unavailability."""
        try:
            return await self._rpc(op, self._kv.Range, request)
        except _Ambiguous as exc:
            raise StoreUnavailable(f"etcd {op}: {exc.cause.details()}") from exc

    async def revision(self) -> int:
        """The store's current revision (a cheap read)."""
        resp = await self._read(
            "revision", rpc.RangeRequest(key=self.keys.prefix.encode(), limit=1, keys_only=True)
        )
        return int(resp.header.revision)

    # -- leases -------------------------------------------------------------

    async def grant_lease(self, ttl_s: int) -> int:
        request = rpc.LeaseGrantRequest(TTL=ttl_s)
        try:
            resp = await self._rpc("lease_grant", self._lease.LeaseGrant, request)
        except _Ambiguous as exc:
            # Safe to re-send: an orphan lease from a lost reply expires on its own.
            resp = await self._resend(exc, lambda: self._rpc("lease_grant", self._lease.LeaseGrant, request))
        return int(resp.ID)

    async def refresh_lease(self, lease_id: int) -> int:
        """Keeps a lease alive once; returns the remaining TTL. NotFound if it is gone."""

        async def one() -> Any:
            call = self._lease.LeaseKeepAlive(timeout=self.settings.request_timeout_s)
            await call.write(rpc.LeaseKeepAliveRequest(ID=lease_id))
            reply = await call.read()
            await call.done_writing()
            call.cancel()
            return reply

        with self.telemetry.etcd_span("lease_keepalive"):
            try:
                reply = await asyncio.wait_for(one(), self.settings.request_timeout_s)
            except (TimeoutError, grpc.aio.AioRpcError) as exc:
                raise StoreUnavailable(f"etcd lease keepalive failed: {exc!r}") from exc
        if reply is grpc.aio.EOF or reply.TTL <= 0:
            raise NotFound(f"lease {lease_id:x} has expired")
        return int(reply.TTL)

    async def revoke_lease(self, lease_id: int) -> None:
        try:
            await self._rpc("lease_revoke", self._lease.LeaseRevoke, rpc.LeaseRevokeRequest(ID=lease_id))
        except LeaseNotFound:
            pass
        except _Ambiguous as exc:
            raise StoreUnavailable(f"etcd lease revoke: {exc.cause.details()}") from exc

    async def _lease_for_expiry(self, expiry_unix_ms: int, granularity_s: int = 1) -> int:
        """A lease that ends within `granularity_s` after `expiry_unix_ms`."""
        second = -(-expiry_unix_ms // (1000 * granularity_s)) * granularity_s
        async with self._lease_lock:
            now_s = time.time()
            for stale in [s for s in self._leases_by_second if s < now_s]:
                del self._leases_by_second[stale]
            lease = self._leases_by_second.get(second)
            if lease is None:
                lease = await self.grant_lease(max(1, int(second - now_s) + 1))
                self._leases_by_second[second] = lease
            return lease

    def _forget_lease(self, lease: int) -> None:
        for second, held in list(self._leases_by_second.items()):
            if held == lease:
                del self._leases_by_second[second]

    # -- nodes --------------------------------------------------------------

    async def register_node(self, node: Node, ttl_s: int) -> int:
        """Writes the node under a new lease. A previous incarnation is retired:
        its lease is revoked and its handles purged, so they are never served."""
        previous = await self.get_node(node.node_id)
        lease = await self.grant_lease(ttl_s)
        node = replace(node, registered_unix_ms=now_ms(), draining=False)
        put = rpc.RequestOp(
            request_put=rpc.PutRequest(
                key=self.keys.node(node.node_id),
                value=convert.node_to_pb(node).SerializeToString(),
                lease=lease,
            )
        )
        try:
            await self._txn("register_node", [], [put], node=node.node_id)
        except _Ambiguous as exc:
            # A put is idempotent: re-send until it is known to have applied.
            await self._resend(exc, lambda: self._txn("register_node", [], [put]))
        if previous is not None and previous.node.incarnation != node.incarnation:
            await self.revoke_lease(previous.lease)
            await self.purge_node(node.node_id, previous.node.incarnation, ReleaseReason.HOLDER_DOWN)
        return lease

    async def get_node(self, node_id: str) -> NodeRecord | None:
        resp = await self._read("get_node", rpc.RangeRequest(key=self.keys.node(node_id)))
        if not resp.kvs:
            return None
        kv = resp.kvs[0]
        return NodeRecord(convert.node_from_pb(node_pb2.Node.FromString(kv.value)), kv.lease, kv.mod_revision)

    async def _registered(self, node_id: str, incarnation: str) -> NodeRecord:
        record = await self.get_node(node_id)
        if record is None or record.node.incarnation != incarnation:
            raise NodeNotRegistered(f"node {node_id!r} incarnation {incarnation!r} is not registered")
        return record

    async def keep_alive(self, node_id: str, incarnation: str, lease_id: int) -> int:
        record = await self._registered(node_id, incarnation)
        if record.lease != lease_id:
            raise NotFound(f"lease {lease_id:x} is not node {node_id!r}'s")
        return await self.refresh_lease(lease_id)

    async def report_load(self, load: NodeLoad) -> None:
        record = await self._registered(load.node_id, load.incarnation)
        put = rpc.RequestOp(
            request_put=rpc.PutRequest(
                key=self.keys.load(load.node_id),
                value=convert.load_to_pb(load).SerializeToString(),
                lease=record.lease,
            )
        )
        same_node = _cmp_mod(self.keys.node(load.node_id), record.mod_revision)
        resp = await self._write("report_load", [same_node], [put])
        if not resp.succeeded:
            raise NodeNotRegistered(f"node {load.node_id!r} changed while reporting load")

    async def set_draining(self, node_id: str, draining: bool = True) -> Node:
        for _ in range(8):
            record = await self.get_node(node_id)
            if record is None:
                raise NotFound(f"node {node_id!r} is not registered")
            node = replace(record.node, draining=draining)
            put = rpc.RequestOp(
                request_put=rpc.PutRequest(
                    key=self.keys.node(node_id),
                    value=convert.node_to_pb(node).SerializeToString(),
                    lease=record.lease,
                )
            )
            resp = await self._write(
                "drain_node", [_cmp_mod(self.keys.node(node_id), record.mod_revision)], [put]
            )
            if resp.succeeded:
                return node
        raise StoreUnavailable(f"node {node_id!r} kept changing while being drained")

    async def deregister_node(self, node_id: str, incarnation: str) -> None:
        record = await self.get_node(node_id)
        if record is None or record.node.incarnation != incarnation:
            raise NotFound(f"node {node_id!r} incarnation {incarnation!r} is not registered")
        await self.revoke_lease(record.lease)
        await self.purge_node(node_id, incarnation, ReleaseReason.HOLDER_DOWN)

    async def list_nodes(self) -> tuple[int, list[tuple[NodeRecord, NodeLoad | None]]]:
        """Every node with its latest load, and the revision they were read at."""
        prefix = self.keys.nodes_prefix()
        loads_prefix = self.keys.loads_prefix()
        ops = [
            rpc.RequestOp(request_range=rpc.RangeRequest(key=prefix, range_end=prefix_range_end(prefix))),
            rpc.RequestOp(
                request_range=rpc.RangeRequest(key=loads_prefix, range_end=prefix_range_end(loads_prefix))
            ),
        ]
        try:
            resp = await self._txn("list_nodes", [], ops)
        except _Ambiguous as exc:
            raise StoreUnavailable(f"etcd list_nodes: {exc.cause.details()}") from exc
        loads: dict[str, NodeLoad] = {}
        for kv in resp.responses[1].response_range.kvs:
            reported = convert.load_from_pb(node_pb2.NodeLoad.FromString(kv.value))
            loads[reported.node_id] = reported
        out: list[tuple[NodeRecord, NodeLoad | None]] = []
        for kv in resp.responses[0].response_range.kvs:
            node = convert.node_from_pb(node_pb2.Node.FromString(kv.value))
            load = loads.get(node.node_id)
            if load is not None and load.incarnation != node.incarnation:
                load = None
            out.append((NodeRecord(node, kv.lease, kv.mod_revision), load))
        return int(resp.header.revision), out

    # -- handles ------------------------------------------------------------

    async def get_handle_record(self, tenant: str, conversation: str) -> HandleRecord | None:
        resp = await self._read("get_handle", rpc.RangeRequest(key=self.keys.handle(tenant, conversation)))
        if not resp.kvs:
            return None
        kv = resp.kvs[0]
        return HandleRecord(_handle(kv.value), kv.mod_revision, kv.lease)

    async def get_handle(self, tenant: str, conversation: str) -> HandleView | None:
        """The retained handle, else the newest live claim's handle."""
        record = await self.get_handle_record(tenant, conversation)
        if record is not None:
            return HandleView(record.handle, HandleState.RETAINED)
        prefix = self.keys.claims_prefix(tenant, conversation)
        resp = await self._read(
            "get_claims",
            rpc.RangeRequest(
                key=prefix,
                range_end=prefix_range_end(prefix),
                sort_target=rpc.RangeRequest.MOD,
                sort_order=rpc.RangeRequest.DESCEND,
                limit=1,
            ),
        )
        if not resp.kvs:
            return None
        claim = convert.claim_from_pb(handle_pb2.Claim.FromString(resp.kvs[0].value))
        return HandleView(claim.handle, HandleState.CHECKED_OUT)

    async def publish_handle(self, handle: CacheHandle) -> PublishOutcome:
        """Stores `handle` as its conversation's handle.

        A handle it replaces is released in the same transaction (reason
        SUPERSEDED): its blocks hold an older, shorter prefix. The holder must
        be registered with the handle's incarnation.
        """
        if not handle.handle_id:
            handle = handle.with_id(uuid.uuid4().hex)
        if not handle.published_unix_ms:
            handle = replace(handle, published_unix_ms=now_ms())
        key = self.keys.handle(handle.tenant, handle.conversation)
        index = self.keys.by_node(
            handle.holder_node_id, handle.holder_incarnation, handle.vllm.remote_request_id
        )
        value = convert.handle_to_pb(handle).SerializeToString()
        for _ in range(16):
            node_key = self.keys.node(handle.holder_node_id)
            reads = [
                rpc.RequestOp(request_range=rpc.RangeRequest(key=key)),
                rpc.RequestOp(request_range=rpc.RangeRequest(key=node_key)),
            ]
            try:
                current = await self._txn("publish_read", [], reads)
            except _Ambiguous as exc:
                raise StoreUnavailable(f"etcd publish: {exc.cause.details()}") from exc
            node_kvs = current.responses[1].response_range.kvs
            if not node_kvs:
                raise NodeNotRegistered(f"holder {handle.holder_node_id!r} is not registered")
            node = node_pb2.Node.FromString(node_kvs[0].value)
            if node.incarnation != handle.holder_incarnation:
                raise NodeNotRegistered(
                    f"holder {handle.holder_node_id!r} incarnation {handle.holder_incarnation!r} "
                    "is not registered"
                )
            lease = await self._lease_for_expiry(handle.wall_expiry_unix_ms)
            compare = [_cmp_mod(node_key, node_kvs[0].mod_revision)]
            ops = [_put(key, value, lease), _put(index, key, lease)]
            superseded: PendingRelease | None = None
            old_kvs = current.responses[0].response_range.kvs
            if old_kvs:
                old_kv = old_kvs[0]
                old = _handle(old_kv.value)
                if old.handle_id == handle.handle_id:
                    return PublishOutcome(old, old_kv.mod_revision, None)  # a re-sent publish
                compare.append(_cmp_mod(key, old_kv.mod_revision))
                superseded = PendingRelease(uuid.uuid4().hex, old, ReleaseReason.SUPERSEDED, now_ms())
                # The old index entry goes, unless the new handle reuses its key.
                ops += [
                    op
                    for op in self._release_ops(superseded, old_kv.lease)
                    if not (op.HasField("request_delete_range") and op.request_delete_range.key == index)
                ]
            else:
                compare.append(_cmp_create(key, 0))
            try:
                resp = await self._txn("publish", compare, ops, conversation=handle.conversation)
            except _Ambiguous as exc:
                resp = await self._resend(exc, lambda c=compare, o=ops: self._txn("publish", c, o))
                if not resp.succeeded:
                    # Re-sent after an unseen success: the handle is ours if its id is.
                    again = await self.get_handle_record(handle.tenant, handle.conversation)
                    if again is not None and again.handle.handle_id == handle.handle_id:
                        return PublishOutcome(again.handle, again.mod_revision, superseded)
                    continue
            except LeaseNotFound:
                self._forget_lease(lease)
                continue
            if resp.succeeded:
                self._count("published", "")
                if superseded is not None:
                    self._count("released", superseded.reason.value)
                return PublishOutcome(handle, int(resp.header.revision), superseded)
        raise StoreUnavailable(f"conversation {handle.conversation!r} kept changing while publishing")

    def _release_ops(self, pending: PendingRelease, lease: int) -> list[Any]:
        """Ops that remove a retained handle's index and queue its release command."""
        h = pending.handle
        return [
            rpc.RequestOp(
                request_delete_range=rpc.DeleteRangeRequest(
                    key=self.keys.by_node(h.holder_node_id, h.holder_incarnation, h.vllm.remote_request_id)
                )
            ),
            _put(
                self.keys.release(h.holder_node_id, pending.command_id),
                convert.pending_to_pb(pending).SerializeToString(),
                lease,
            ),
        ]

    async def check_out(
        self,
        tenant: str,
        conversation: str,
        *,
        route_id: str = "",
        handle_id: str = "",
        expected: HandleRecord | None = None,
        claim_id: str = "",
    ) -> CheckOut:
        """Hands the conversation's handle to one caller, at most once.

        One transaction: the handle key's mod_revision still equals the one
        read (or `expected`, from a watch-fed cache, which saves the read);
        then delete the handle and its index, and write a claim under the
        handle's own lease. NotFound if there is no handle; HandleNotRetained if another
        caller won, or if `handle_id` names another handle.
        """
        record = expected or await self.get_handle_record(tenant, conversation)
        if record is None:
            raise NotFound(f"no retained handle for conversation {conversation!r}")
        handle = record.handle
        if handle_id and handle.handle_id != handle_id:
            raise HandleNotRetained(f"handle {handle_id!r} is not the retained one")
        claim_id = claim_id or uuid.uuid4().hex
        claim = Claim(claim_id, handle, route_id, now_ms())
        claim_key = self.keys.claim(tenant, conversation, claim_id)
        # The claim shares the handle's lease: it lives no longer than the
        # blocks could, and the check-out needs no lease grant of its own.
        claim_lease = record.lease
        key = self.keys.handle(tenant, conversation)
        compare = [_cmp_mod(key, record.mod_revision)]
        ops = [
            rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key)),
            rpc.RequestOp(
                request_delete_range=rpc.DeleteRangeRequest(
                    key=self.keys.by_node(
                        handle.holder_node_id, handle.holder_incarnation, handle.vllm.remote_request_id
                    )
                )
            ),
            _put(claim_key, convert.claim_to_pb(claim).SerializeToString(), claim_lease),
        ]
        try:
            resp = await self._txn("check_out", compare, ops, conversation=conversation, claim_id=claim_id)
            won = bool(resp.succeeded)
        except _Ambiguous as exc:
            resp = await self._resend(exc, lambda: self._txn("check_out", compare, ops))
            won = bool(resp.succeeded) or await self._exists(claim_key)
        if not won:
            raise HandleNotRetained(f"handle of conversation {conversation!r} was taken or replaced")
        self._count("checked_out", "")
        return CheckOut(handle, claim_id, int(resp.header.revision))

    async def release(
        self,
        tenant: str,
        conversation: str,
        reason: ReleaseReason,
        *,
        handle_id: str = "",
        expected: HandleRecord | None = None,
    ) -> PendingRelease:
        """Releases the handle only if it is still retained.

        One transaction fenced on the handle's mod_revision deletes the handle
        and its index and queues a release command for the holder, so the
        metadata entry is gone before any command is sent. A checked-out
        handle has no entry left, so it can never be released here.
        """
        record = expected or await self.get_handle_record(tenant, conversation)
        if record is None:
            raise NotFound(f"no retained handle for conversation {conversation!r}")
        if handle_id and record.handle.handle_id != handle_id:
            raise HandleNotRetained(f"handle {handle_id!r} is not the retained one")
        pending = PendingRelease(uuid.uuid4().hex, record.handle, reason, now_ms())
        key = self.keys.handle(tenant, conversation)
        compare = [_cmp_mod(key, record.mod_revision)]
        ops = [
            rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=key)),
            *self._release_ops(pending, record.lease),
        ]
        try:
            resp = await self._txn("release", compare, ops, conversation=conversation, reason=reason.value)
            won = bool(resp.succeeded)
        except _Ambiguous as exc:
            resp = await self._resend(exc, lambda: self._txn("release", compare, ops))
            won = bool(resp.succeeded) or await self._exists(
                self.keys.release(record.handle.holder_node_id, pending.command_id)
            )
        if not won:
            raise HandleNotRetained(f"handle of conversation {conversation!r} is no longer retained")
        self._count("released", reason.value)
        return pending

    async def release_freed(self, node_id: str, incarnation: str, request_ids: Iterable[str]) -> int:
        """Drops handles whose blocks the engine itself freed (TTL, read, abort).

        No command is queued: the blocks are already gone. Returns how many
        retained handles this removed.
        """
        removed = 0
        for request_id in request_ids:
            index = self.keys.by_node(node_id, incarnation, request_id)
            resp = await self._read("get_index", rpc.RangeRequest(key=index))
            if not resp.kvs:
                continue
            if await self._drop_indexed(resp.kvs[0]):
                removed += 1
                self._count("released", ReleaseReason.FREED_BY_ENGINE.value)
        return removed

    async def _drop_indexed(self, index_kv: Any) -> bool:
        """Deletes an index entry and, if still the same handle, the handle.

        The index is written in the handle's own transaction, so equal
        mod_revisions mean the handle key still holds that very handle.
        """
        handle_key = bytes(index_kv.value)
        compare = [_cmp_mod(handle_key, index_kv.mod_revision)]
        ops = [
            rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=handle_key)),
            rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=bytes(index_kv.key))),
        ]
        failure = [rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=bytes(index_kv.key)))]
        resp = await self._write("drop_indexed", compare, ops, failure)
        return bool(resp.succeeded)

    async def purge_node(self, node_id: str, incarnation: str | None, reason: ReleaseReason) -> int:
        """Removes every handle a node (or one of its incarnations) holds,
        through the per-node index. No command is queued: a dead holder's
        blocks are gone, and a new incarnation never had them."""
        prefix = self.keys.by_node_prefix(node_id, incarnation)
        resp = await self._read(
            "purge_scan", rpc.RangeRequest(key=prefix, range_end=prefix_range_end(prefix))
        )
        removed = 0
        for kv in resp.kvs:
            if await self._drop_indexed(kv):
                removed += 1
                self._count("released", reason.value)
        # Commands queued for a dead incarnation can never be applied.
        releases = self.keys.releases_prefix(node_id)
        pending = await self._read(
            "purge_releases", rpc.RangeRequest(key=releases, range_end=prefix_range_end(releases))
        )
        for kv in pending.kvs:
            release = convert.pending_from_pb(handle_pb2.PendingRelease.FromString(kv.value))
            if incarnation is None or release.handle.holder_incarnation == incarnation:
                await self._write(
                    "purge_release",
                    [],
                    [rpc.RequestOp(request_delete_range=rpc.DeleteRangeRequest(key=kv.key))],
                )
        return removed

    async def orphaned_nodes(self) -> set[tuple[str, str]]:
        """(node, incarnation) pairs that hold handles but are not registered."""
        prefix = self.keys.by_node_all_prefix()
        resp = await self._read(
            "orphan_scan", rpc.RangeRequest(key=prefix, range_end=prefix_range_end(prefix), keys_only=True)
        )
        _, nodes = await self.list_nodes()
        live = {(r.node.node_id, r.node.incarnation) for r, _ in nodes}
        found = {self.keys.by_node_parts(kv.key)[:2] for kv in resp.kvs}
        return found - live

    async def list_handles(
        self, *, tenant: str = "", node_id: str = "", page_size: int = 100, page_token: bytes = b""
    ) -> tuple[list[CacheHandle], bytes]:
        """One page of retained handles in key order, and the next page's start key."""
        prefix = self.keys.tenant_handles_prefix(tenant) if tenant else self.keys.handles_prefix()
        start = page_token if page_token.startswith(prefix) else prefix
        end = prefix_range_end(prefix)
        out: list[CacheHandle] = []
        while True:
            resp = await self._read(
                "list_handles", rpc.RangeRequest(key=start, range_end=end, limit=page_size)
            )
            kvs = list(resp.kvs)
            for i, kv in enumerate(kvs):
                start = bytes(kv.key) + b"\0"
                handle = _handle(kv.value)
                if node_id and handle.holder_node_id != node_id:
                    continue
                out.append(handle)
                if len(out) == page_size:
                    more = bool(resp.more) or i < len(kvs) - 1
                    return out, start if more else b""
            if not resp.more:
                return out, b""

    # -- release commands -----------------------------------------------------

    async def pending_releases(self, node_id: str) -> list[tuple[PendingRelease, int]]:
        """Release commands queued for a node, with their mod_revisions, oldest first."""
        prefix = self.keys.releases_prefix(node_id)
        resp = await self._read(
            "pending_releases",
            rpc.RangeRequest(
                key=prefix,
                range_end=prefix_range_end(prefix),
                sort_target=rpc.RangeRequest.MOD,
                sort_order=rpc.RangeRequest.ASCEND,
            ),
        )
        return [
            (convert.pending_from_pb(handle_pb2.PendingRelease.FromString(kv.value)), int(kv.mod_revision))
            for kv in resp.kvs
        ]

    async def ack_release(self, node_id: str, command_id: str) -> None:
        await self._write(
            "ack_release",
            [],
            [
                rpc.RequestOp(
                    request_delete_range=rpc.DeleteRangeRequest(key=self.keys.release(node_id, command_id))
                )
            ],
        )

    # -- leader election -------------------------------------------------------

    async def campaign(self, name: str, candidate: str, lease: int) -> ElectionRecord:
        """Tries to make `candidate` the leader of `name`.

        One txn puts `candidate` on the election key, bound to `lease`, only
        if the key does not exist; either way it returns the leader after the
        attempt, so the caller won if the record names its own lease. The key
        vanishes with the lease, which is what lets a standby take over.
        """
        key = self.keys.election(name)
        read = rpc.RequestOp(request_range=rpc.RangeRequest(key=key))
        # Re-sending after an unseen success finds our own record: still a win.
        resp = await self._write(
            "campaign", [_cmp_create(key, 0)], [_put(key, candidate.encode(), lease), read], [read]
        )
        kvs = resp.responses[-1].response_range.kvs
        if not kvs:
            raise StoreUnavailable(f"election {name!r}: leader key vanished during the campaign")
        kv = kvs[0]
        return ElectionRecord(
            kv.value.decode(), int(kv.lease), int(kv.mod_revision), int(resp.header.revision)
        )

    async def election_leader(self, name: str) -> ElectionRecord | None:
        """The current leader of `name`, if any."""
        resp = await self._read("election_leader", rpc.RangeRequest(key=self.keys.election(name)))
        if not resp.kvs:
            return None
        kv = resp.kvs[0]
        return ElectionRecord(
            kv.value.decode(), int(kv.lease), int(kv.mod_revision), int(resp.header.revision)
        )

    # -- watches --------------------------------------------------------------

    async def read_prefix(self, prefix: bytes) -> tuple[int, list[WatchEvent]]:
        """Every key under `prefix` as put events, and the revision of the read."""
        return await self.read_range(prefix, prefix_range_end(prefix))

    async def read_range(self, key: bytes, range_end: bytes) -> tuple[int, list[WatchEvent]]:
        """Every key in [key, range_end) as put events, and the revision of the read."""
        resp = await self._read("read_range", rpc.RangeRequest(key=key, range_end=range_end))
        revision = int(resp.header.revision)
        return revision, [
            WatchEvent(revision, bytes(kv.key), bytes(kv.value), False, int(kv.mod_revision), int(kv.lease))
            for kv in resp.kvs
        ]

    async def watch_prefix(
        self, prefix: bytes, start_revision: int, *, prev_kv: bool = True
    ) -> AsyncIterator[list[WatchEvent]]:
        """`watch_range` over every key under `prefix`."""
        end = prefix_range_end(prefix)
        async for batch in self.watch_range(prefix, end, start_revision, prev_kv=prev_kv):
            yield batch

    async def watch_range(
        self, key: bytes, range_end: bytes, start_revision: int, *, prev_kv: bool = True
    ) -> AsyncIterator[list[WatchEvent]]:
        """Batches of changes in [key, range_end) from `start_revision` on; an empty
        batch means the stream is live with nothing new.

        Ends by raising StoreUnavailable when the stream breaks, or
        `Compacted` when `start_revision` is no longer available; callers
        re-read and resume (see `kvplane.services.common.feed`).
        """
        if self._channel is None:
            await self.connect()
        create = rpc.WatchRequest(
            create_request=rpc.WatchCreateRequest(
                key=key,
                range_end=range_end,
                start_revision=start_revision,
                prev_kv=prev_kv,
                progress_notify=True,
            )
        )
        call = self._watch.Watch()
        try:
            await call.write(create)
            while True:
                resp = await call.read()
                if resp is grpc.aio.EOF:
                    raise StoreUnavailable("etcd watch stream ended")
                if resp.compact_revision:
                    raise Compacted(int(resp.compact_revision))
                if resp.canceled:
                    raise StoreUnavailable(f"etcd canceled the watch: {resp.cancel_reason}")
                # An empty batch (the watch's creation, a progress notice)
                # still tells the caller that the stream is live.
                batch = [
                    WatchEvent(
                        revision=int(ev.kv.mod_revision),
                        key=bytes(ev.kv.key),
                        value=bytes(ev.kv.value),
                        deleted=ev.type == rpc.Event.DELETE,
                        mod_revision=int(ev.kv.mod_revision),
                        lease=int(ev.kv.lease),
                        prev_value=bytes(ev.prev_kv.value) if ev.HasField("prev_kv") else b"",
                    )
                    for ev in resp.events
                ]
                yield batch
        except grpc.aio.AioRpcError as exc:
            raise StoreUnavailable(f"etcd watch failed: {exc.code().name}") from exc
        finally:
            call.cancel()

    # -- internals ------------------------------------------------------------

    async def _write(
        self, op: str, compare: list[Any], success: list[Any], failure: list[Any] | None = None
    ) -> Any:
        """A write whose ops are idempotent: an ambiguous outcome is re-sent."""
        try:
            return await self._txn(op, compare, success, failure)
        except _Ambiguous as exc:
            return await self._resend(exc, lambda: self._txn(op, compare, success, failure))

    async def _resend(self, first: _Ambiguous, send: Any) -> Any:
        """Re-sends a fenced transaction until etcd answers, up to settle_timeout_s.

        The transaction is fenced (or idempotent), so at most one of the
        attempts applies; the caller reads its id back when the answer is
        "did not apply", since an earlier attempt may have.
        """
        deadline = time.monotonic() + self.settings.settle_timeout_s
        delay = 0.05
        last: _Ambiguous = first
        while time.monotonic() < deadline:
            await asyncio.sleep(delay)  # back off before re-sending
            try:
                return await send()
            except _Ambiguous as exc:
                last = exc
                delay = min(delay * 2, 1.0)
        raise StoreUnavailable(f"etcd {last.op} outcome unknown: {last.cause.details()}") from last

    async def _exists(self, key: bytes) -> bool:
        deadline = time.monotonic() + self.settings.settle_timeout_s
        while True:
            try:
                resp = await self._rpc(
                    "read_back", self._kv.Range, rpc.RangeRequest(key=key, count_only=True)
                )
                return int(resp.count) > 0
            except _Ambiguous as exc:
                if time.monotonic() > deadline:
                    raise StoreUnavailable(f"etcd read-back failed: {exc.cause.details()}") from exc
                await asyncio.sleep(0.1)

    def _count(self, transition: str, reason: str) -> None:
        self.telemetry.store.handle_transitions.labels(transition, reason).inc()


class _Ambiguous(Exception):
    """An etcd request whose outcome is unknown (timeout, connection lost)."""

    def __init__(self, op: str, cause: grpc.aio.AioRpcError) -> None:
        super().__init__(f"{op}: {cause.code().name}")
        self.op = op
        self.cause = cause


class LeaseNotFound(NotFound):
    """The lease named has expired or was revoked."""


class Compacted(StoreUnavailable):
    """A watch's start revision has been compacted away."""

    def __init__(self, compact_revision: int) -> None:
        super().__init__(f"revision compacted up to {compact_revision}")
        self.compact_revision = compact_revision


def _handle(value: bytes) -> CacheHandle:
    return convert.handle_from_pb(handle_pb2.CacheHandle.FromString(value))


def _put(key: bytes, value: bytes, lease: int = 0) -> Any:
    return rpc.RequestOp(request_put=rpc.PutRequest(key=key, value=value, lease=lease))


def _cmp_mod(key: bytes, revision: int) -> Any:
    return rpc.Compare(key=key, target=rpc.Compare.MOD, result=rpc.Compare.EQUAL, mod_revision=revision)


def _cmp_create(key: bytes, revision: int) -> Any:
    return rpc.Compare(key=key, target=rpc.Compare.CREATE, result=rpc.Compare.EQUAL, create_revision=revision)
