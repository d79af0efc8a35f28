"""Handles: the conversation → handle map, its publishes and its reads."""

from __future__ import annotations

import functools
import uuid
from dataclasses import dataclass, replace
from typing import Any

from aetcd import rpc

from kvplane.services.common.model import convert
from kvplane.services.common.model.errors import NodeNotRegistered, StoreUnavailable
from kvplane.services.common.model.handles import CacheHandle, PendingRelease, ReleaseReason
from kvplane.services.common.model.keys import KeyLayout, prefix_range_end
from kvplane.services.common.runtime.telemetry import Telemetry
from kvplane.services.common.store import fencing
from kvplane.services.common.store.etcd import Ambiguous, EtcdClient, LeaseNotFound
from kvplane.services.common.store.leases import Leases
from kvplane.services.common.store.records import (
    FreedBlocks,
    HandleRecord,
    PublishHint,
    PublishOutcome,
    decode_handle,
    now_ms,
)
from kvplane.services.common.store.release_store import ReleaseStore
from kvplane.v1 import node_pb2

# Freed requests recorded in a publish's own transaction at most: two operations each, beside the
# publish's few (etcd takes at most 128 per transaction, --max-txn-ops); more are recorded first,
# in transactions of their own.
MAX_FREED_IN_PUBLISH = 32


class HandleStore:
    def __init__(
        self, etcd: EtcdClient, keys: KeyLayout, leases: Leases, releases: ReleaseStore, telemetry: Telemetry
    ) -> None:
        self.etcd = etcd
        self.keys = keys
        self.leases = leases
        self.releases = releases
        self.telemetry = telemetry

    async def get_record(self, tenant: str, conversation: str) -> HandleRecord | None:
        resp = await self.etcd.read(
            "get_handle", rpc.RangeRequest(key=self.keys.handle(tenant, conversation))
        )
        if not resp.kvs:
            return None
        kv = resp.kvs[0]
        return HandleRecord(decode_handle(kv.value), kv.mod_revision, kv.lease)

    async def publish(
        self, handle: CacheHandle, hint: PublishHint | None = None, freed: FreedBlocks | None = None
    ) -> PublishOutcome:
        """Records `freed` (as `ReleaseStore.release_freed` would), then stores `handle` as its
        conversation's handle (`_publish`).

        The freed requests ride in the publish's own transaction, one request for both, when
        they fit (`MAX_FREED_IN_PUBLISH`) and do not name the handle's own blocks; a transaction
        that fails on them, or a publish that ends without one, records them in transactions of
        their own (idempotent: tombstones written again, claims deleted again). They are always
        recorded before or with the handle, never after it is stored: a handle can never name
        blocks its holder reported freed earlier.
        """
        riding = freed
        if freed is not None and (
            len(freed.request_ids) > MAX_FREED_IN_PUBLISH
            or handle.vllm.remote_request_id in freed.request_ids
        ):
            await self.releases.release_freed(freed.node_id, freed.incarnation, freed.request_ids)
            riding = None
        unrecorded = [riding]
        try:
            return await self._publish(handle, hint, unrecorded)
        finally:
            if (left := unrecorded[0]) is not None:
                await self.releases.release_freed(left.node_id, left.incarnation, left.request_ids)

    async def _publish(
        self, handle: CacheHandle, hint: PublishHint | None, unrecorded: list[FreedBlocks | None]
    ) -> PublishOutcome:
        """Stores `handle` as its conversation's handle; `unrecorded[0]`, while set, rides in
        the transaction, and is cleared once a transaction recorded it.

        A handle it replaces is released in the same transaction (reason
        SUPERSEDED): its blocks hold an older, shorter prefix. The holder must
        be registered with the handle's incarnation, and the blocks must have no
        tombstone: neither reported freed nor retired (a handle of theirs left
        retention already, and this publish is a late or re-sent one).

        One transaction, fenced on the holder's node key, the conversation's
        handle key and the blocks' tombstone as last seen. They are read first,
        unless `hint` (a watch-fed view's) says what they hold; a transaction
        that finds them changed reads them back in its failure branch, so a
        stale hint costs one more transaction, not a read besides.

        A relocation (`relocates_handle_id`: the holder moved the blocks of
        that handle, keeping their request id) replaces that handle only while
        it is the conversation's retained one, and releases nothing; else it is
        refused and stores nothing (`relocation_refused`).
        """
        if not handle.handle_id:
            handle = handle.with_id(uuid.uuid4().hex)
        if not handle.published_unix_ms:
            handle = replace(handle, published_unix_ms=now_ms())
        key = self.keys.handle(handle.tenant, handle.conversation)
        index = self.keys.by_node(
            handle.holder_node_id, handle.holder_incarnation, handle.vllm.remote_request_id
        )
        # What a relocation replaces is the publish's precondition, not part of the stored handle.
        value = convert.handle_to_pb(replace(handle, relocates_handle_id="")).SerializeToString()
        freed = self.keys.freed(
            handle.holder_node_id, handle.holder_incarnation, handle.vllm.remote_request_id
        )
        node_key = self.keys.node(handle.holder_node_id)
        reads = [fencing.get(key), fencing.get(node_key), fencing.get(freed)]
        seen = _Seen.of_hint(hint) if hint is not None and hint.node is not None else None
        for _ in range(16):
            if seen is None:
                seen = _Seen.of_reads((await self.etcd.read_txn("publish_read", reads)).responses)
            if seen.freed:
                # Freed by the holder, or retired as the handle left retention: a late or re-sent
                # publish, which must not bring the handle back (a relocation is refused).
                if handle.relocates_handle_id:
                    return PublishOutcome(handle, 0, None, relocation_refused=True)
                return PublishOutcome(handle, 0, None, freed=True)
            if seen.node_incarnation != handle.holder_incarnation:
                if seen.hinted:
                    seen = None  # the view may lag a registration: ask etcd
                    continue
                raise NodeNotRegistered(
                    f"holder {handle.holder_node_id!r} incarnation {handle.holder_incarnation!r} "
                    "is not registered"
                )
            old = seen.handle
            if old is not None and old.handle.handle_id == handle.handle_id:
                return PublishOutcome(old.handle, old.mod_revision, None)  # a re-sent publish
            if handle.relocates_handle_id and not _relocatable(old, handle):
                if seen.hinted:
                    seen = None  # the view may lag the publish of the handle it moves: ask etcd
                    continue
                return PublishOutcome(handle, 0, None, relocation_refused=True)
            lease = await self.leases.for_expiry(handle.wall_expiry_unix_ms)
            compare = [fencing.same_revision(node_key, seen.node_revision), fencing.absent(freed)]
            ops = [fencing.put(key, value, lease), fencing.put(index, key, lease)]
            superseded: PendingRelease | None = None
            if old is None:
                compare.append(fencing.absent(key))
            else:
                compare.append(fencing.same_revision(key, old.mod_revision))
                if not handle.relocates_handle_id:
                    # (A relocation is the same blocks under the same index key: replaced, not released.)
                    superseded = PendingRelease(
                        uuid.uuid4().hex, old.handle, ReleaseReason.SUPERSEDED, now_ms()
                    )
                    ops += self._supersede_ops(superseded, old.lease, index, freed)
            riding = unrecorded[0]
            tombstones = 0
            if riding is not None:
                tombstones = await self.releases.tombstone_lease()
                fence, freed_ops = self.releases.freed_fence(
                    riding.node_id, riding.incarnation, list(riding.request_ids), tombstones
                )
                # The superseded handle's blocks may be among them (their TTL freed them): their
                # tombstone is the report's (etcd refuses a key put twice in one transaction).
                written = {op.request_put.key for op in freed_ops if op.HasField("request_put")}
                ops = [op for op in ops if not (op.HasField("request_put") and op.request_put.key in written)]
                compare, ops = [*compare, *fence], [*ops, *freed_ops]
            try:
                resp, resent = await self._publish_txn(compare, ops, reads, handle.conversation)
            except LeaseNotFound:
                # The lease is gone (the re-sent attempt's too): new ones on the next round.
                self.leases.forget(lease)
                if tombstones:
                    self.leases.forget(tombstones)
                seen = None
                continue
            if riding is not None:
                unrecorded[0] = None
                if not resp.succeeded:
                    # Which fence failed is not known: the freed requests go on their own (a
                    # handle still retained under one of them is dropped there), then the
                    # publish goes on from what the failure branch read.
                    await self.releases.release_freed(riding.node_id, riding.incarnation, riding.request_ids)
            if resp.succeeded:
                self.telemetry.store.handle_transitions.labels("published", "").inc()
                if superseded is not None:
                    self.releases.count(superseded.reason.value)
                return PublishOutcome(handle, int(resp.header.revision), superseded)
            # Something changed since it was seen: the failure branch read it all back.
            seen = _Seen.of_reads(resp.responses)
            if resent and seen.handle is not None and seen.handle.handle.handle_id == handle.handle_id:
                # Re-sent after an unseen success: the handle is ours.
                return PublishOutcome(seen.handle.handle, seen.handle.mod_revision, superseded)
        raise StoreUnavailable(f"conversation {handle.conversation!r} kept changing while publishing")

    def _supersede_ops(
        self, superseded: PendingRelease, lease: int, index: bytes, tombstone: bytes
    ) -> list[Any]:
        """The release of the handle a publish replaces; its index entry goes and its blocks are
        retired, unless the new handle names the same blocks (its `index` and `tombstone`)."""
        return [
            op
            for op in self.releases.release_ops(superseded, lease)
            if not (op.HasField("request_delete_range") and op.request_delete_range.key == index)
            and not (op.HasField("request_put") and op.request_put.key == tombstone)
        ]

    async def _publish_txn(
        self, compare: list[Any], ops: list[Any], reads: list[Any], conversation: str
    ) -> tuple[Any, bool]:
        """The publish transaction's answer, and whether it had to be re-sent (an ambiguous first
        attempt may have succeeded unseen)."""
        try:
            return await self.etcd.txn(
                "publish", compare, ops, failure=reads, conversation=conversation
            ), False
        except Ambiguous as exc:
            send = functools.partial(self.etcd.txn, "publish", compare, ops, failure=reads)
            return await self.etcd.resend(exc, send), True

    async def list(
        self, *, tenant: str = "", node_id: str = "", page_size: int = 100, page_token: bytes = b""
    ) -> tuple[list[CacheHandle], bytes]:
        """One page of retained handles in key order, and the next page's start key."""
        prefix = self.keys.tenant_handles_prefix(tenant) if tenant else self.keys.handles_prefix()
        start = page_token if page_token.startswith(prefix) else prefix
        end = prefix_range_end(prefix)
        out: list[CacheHandle] = []
        while True:
            resp = await self.etcd.read(
                "list_handles", rpc.RangeRequest(key=start, range_end=end, limit=page_size)
            )
            kvs = list(resp.kvs)
            for i, kv in enumerate(kvs):
                start = bytes(kv.key) + b"\0"
                handle = decode_handle(kv.value)
                if node_id and handle.holder_node_id != node_id:
                    continue
                out.append(handle)
                if len(out) == page_size:
                    more = bool(resp.more) or i < len(kvs) - 1
                    return out, start if more else b""
            if not resp.more:
                return out, b""


def _relocatable(old: HandleRecord | None, moved: CacheHandle) -> bool:
    """Whether `moved` may replace the retained handle `old` as its relocation: `old` is the
    handle it names, on the same holder incarnation and request (the blocks moved, not new ones)."""
    if old is None or old.handle.handle_id != moved.relocates_handle_id:
        return False
    was = old.handle
    return (
        was.holder_node_id == moved.holder_node_id
        and was.holder_incarnation == moved.holder_incarnation
        and was.vllm.remote_request_id == moved.vllm.remote_request_id
    )


@dataclass(frozen=True, slots=True)
class _Seen:
    """What a publish is fenced on: the conversation's handle, the holder's registration
    (incarnation and the node key's mod_revision; empty: not registered) and whether the
    blocks were reported freed. `hinted`: from a view, not read from etcd."""

    handle: HandleRecord | None
    node_incarnation: str
    node_revision: int
    freed: bool
    hinted: bool = False

    @classmethod
    def of_reads(cls, responses: Any) -> _Seen:
        """From the ranges of the handle key, the node key and the tombstone, in that order."""
        handle_kvs = responses[0].response_range.kvs
        node_kvs = responses[1].response_range.kvs
        handle = None
        if handle_kvs:
            kv = handle_kvs[0]
            handle = HandleRecord(decode_handle(kv.value), int(kv.mod_revision), int(kv.lease))
        incarnation, revision = "", 0
        if node_kvs:
            incarnation = node_pb2.Node.FromString(node_kvs[0].value).incarnation
            revision = int(node_kvs[0].mod_revision)
        return cls(handle, incarnation, revision, bool(responses[2].response_range.kvs))

    @classmethod
    def of_hint(cls, hint: PublishHint) -> _Seen:
        assert hint.node is not None
        return cls(hint.handle, hint.node.node.incarnation, hint.node.mod_revision, False, hinted=True)
