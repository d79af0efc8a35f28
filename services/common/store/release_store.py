"""Releases: retained → released, the per-node command queue, and the purge
of handles whose holder is gone or freed the blocks itself."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

from aetcd import rpc

from kvplane.services.common.model import convert
from kvplane.services.common.model.errors import HandleNotRetained
from kvplane.services.common.model.handles import CacheHandle, PendingRelease, ReleaseReason
from kvplane.services.common.model.keys import KeyLayout, prefix_range_end
from kvplane.services.common.runtime.telemetry import Telemetry
from kvplane.services.common.store import fencing
from kvplane.services.common.store.etcd import Ambiguous, EtcdClient, LeaseNotFound
from kvplane.services.common.store.leases import Leases
from kvplane.services.common.store.records import HandleRecord, now_ms
from kvplane.v1 import handle_pb2

# How long the record that an engine freed some blocks is kept, ms: past any engine's TTL
# (vLLM's default is 480 s), after which no handle of those blocks can be live anyway.
FREED_TOMBSTONE_MS = 600_000
# Request ids per freed-report transaction: a put and a delete each (etcd takes at most 128
# operations per transaction, --max-txn-ops).
_FREED_BATCH = 64

T = TypeVar("T")


class ReleaseStore:
    def __init__(self, etcd: EtcdClient, keys: KeyLayout, telemetry: Telemetry, leases: Leases) -> None:
        self.etcd = etcd
        self.keys = keys
        self.telemetry = telemetry
        self.leases = leases

    def release_ops(self, pending: PendingRelease, lease: int) -> list[Any]:
        """Ops that remove a retained handle's index, retire its blocks (`retire_op`) and queue
        its release command."""
        h = pending.handle
        return [
            fencing.delete(
                self.keys.by_node(h.holder_node_id, h.holder_incarnation, h.vllm.remote_request_id)
            ),
            self.retire_op(h, lease),
            fencing.put(
                self.keys.release(h.holder_node_id, pending.command_id),
                convert.pending_to_pb(pending).SerializeToString(),
                lease,
            ),
        ]

    def retire_op(self, handle: CacheHandle, lease: int) -> Any:
        """The op that writes the tombstone of a handle's blocks as the handle leaves retention
        (released, superseded, checked out), under `lease`, the handle's own: no publish may
        name those blocks again. A publish re-sent after a success its sender never saw (the
        answer lost on the way) would otherwise bring the handle back after it was handed out or
        released: handed out twice, or indexed on blocks its holder is told to free."""
        return fencing.put(
            self.keys.freed(handle.holder_node_id, handle.holder_incarnation, handle.vllm.remote_request_id),
            b"",
            lease,
        )

    async def release(
        self, tenant: str, conversation: str, record: HandleRecord, reason: ReleaseReason
    ) -> PendingRelease:
        """Releases the handle read as `record`, only if it is still retained.

        One transaction fenced on the handle's mod_revision deletes the handle
        and its index and queues a release command for the holder, so the
        metadata entry is gone before any command is sent. A checked-out
        handle has no entry left, so it can never be released here.
        """
        handle = record.handle
        pending = PendingRelease(uuid.uuid4().hex, handle, reason, now_ms())
        key = self.keys.handle(tenant, conversation)
        compare = [fencing.same_revision(key, record.mod_revision)]
        ops = [fencing.delete(key), *self.release_ops(pending, record.lease)]
        try:
            resp = await self.etcd.txn(
                "release", compare, ops, conversation=conversation, reason=reason.value
            )
            won = bool(resp.succeeded)
        except Ambiguous as exc:
            resp = await self.etcd.resend(exc, lambda: self.etcd.txn("release", compare, ops))
            won = bool(resp.succeeded) or await self.etcd.exists(
                self.keys.release(handle.holder_node_id, pending.command_id)
            )
        if not won:
            raise HandleNotRetained(f"handle of conversation {conversation!r} is no longer retained")
        self.count(reason.value)
        return pending

    async def release_freed(self, node_id: str, incarnation: str, request_ids: Iterable[str]) -> int:
        """Records that the engine itself freed these blocks (a read, its TTL, an abort), and
        drops whatever named them: the claim a read consumed, a handle still retained.

        No command is queued: the blocks are already gone. Returns how many retained handles
        this removed. One transaction per 64 ids in the common case (`_freed_batch`).
        """
        ids = list(dict.fromkeys(request_ids))
        removed = 0
        for start in range(0, len(ids), _FREED_BATCH):
            removed += await self._freed_batch(node_id, incarnation, ids[start : start + _FREED_BATCH])
        return removed

    def freed_fence(
        self, node_id: str, incarnation: str, ids: list[str], lease: int
    ) -> tuple[list[Any], list[Any]]:
        """The compares and ops that record blocks as freed: fenced on no retained handle naming
        them (their per-node index entries are absent: the index is written and deleted with its
        handle), the tombstones, from which on no publish can name the blocks (under `lease`,
        `tombstone_lease`'s), and the deletion of the claims on them."""
        compare = [fencing.absent(self.keys.by_node(node_id, incarnation, r)) for r in ids]
        tombstones = [fencing.put(self.keys.freed(node_id, incarnation, r), b"", lease) for r in ids]
        claims = [fencing.delete(self.keys.claimed(node_id, incarnation, r)) for r in ids]
        return compare, [*tombstones, *claims]

    async def tombstone_lease(self) -> int:
        """The shared lease of the tombstones written now."""
        return await self.leases.for_expiry(now_ms() + FREED_TOMBSTONE_MS)

    async def _freed_batch(self, node_id: str, incarnation: str, ids: list[str]) -> int:
        """One transaction (`freed_fence`). A handle still retained (the engine freed blocks
        before anyone took them) fails the fence; the tombstones are written anyway, that handle
        is dropped through its index, and the claims deleted after."""
        indexes = [self.keys.by_node(node_id, incarnation, r) for r in ids]
        claims = [fencing.delete(self.keys.claimed(node_id, incarnation, r)) for r in ids]

        async def write(lease: int) -> Any:
            compare, ops = self.freed_fence(node_id, incarnation, ids, lease)
            tombstones = ops[: len(ids)]
            return await self.etcd.write(
                "release_freed", compare, ops, [*tombstones, *(fencing.get(index) for index in indexes)]
            )

        resp = await self._under_tombstone_lease(write)
        if resp.succeeded:
            return 0
        removed = 0
        for reply in resp.responses[len(ids) :]:
            for kv in reply.response_range.kvs:
                if await self.drop_indexed(kv):
                    removed += 1
                    self.count(ReleaseReason.FREED_BY_ENGINE.value)
        await self.etcd.write("release_freed_claims", [], claims)
        return removed

    async def drop_indexed(self, index_kv: Any) -> bool:
        """Deletes an index entry and, if still the same handle, the handle.

        The index is written in the handle's own transaction, so equal
        mod_revisions mean the handle key still holds that very handle.
        """
        handle_key = bytes(index_kv.value)
        compare = [fencing.same_revision(handle_key, index_kv.mod_revision)]
        ops = [fencing.delete(handle_key), fencing.delete(bytes(index_kv.key))]
        failure = [fencing.delete(bytes(index_kv.key))]
        resp = await self.etcd.write("drop_indexed", compare, ops, failure)
        return bool(resp.succeeded)

    async def purge_node(self, node_id: str, incarnation: str | None, reason: ReleaseReason) -> int:
        """Removes every handle a node (or one of its incarnations) holds,
        through the per-node index. No command is queued: a dead holder's
        blocks are gone, and a new incarnation never had them."""
        prefix = self.keys.by_node_prefix(node_id, incarnation)
        resp = await self.etcd.read(
            "purge_scan", rpc.RangeRequest(key=prefix, range_end=prefix_range_end(prefix))
        )
        removed = 0
        for kv in resp.kvs:
            if await self.drop_indexed(kv):
                removed += 1
                self.count(reason.value)
        # Commands queued for a dead incarnation can never be applied.
        releases = self.keys.releases_prefix(node_id)
        pending = await self.etcd.read(
            "purge_releases", rpc.RangeRequest(key=releases, range_end=prefix_range_end(releases))
        )
        for kv in pending.kvs:
            release = convert.pending_from_pb(handle_pb2.PendingRelease.FromString(kv.value))
            if incarnation is None or release.handle.holder_incarnation == incarnation:
                await self.etcd.write("purge_release", [], [fencing.delete(bytes(kv.key))])
        return removed

    async def unreferenced(self, node_id: str, incarnation: str, request_ids: Iterable[str]) -> list[str]:
        """Of `request_ids` (blocks a node's engine retains), those that neither a
        retained handle nor a claim references: nothing will ever read or
        release them, so the engine should free them now."""
        index = self.keys.by_node_prefix(node_id, incarnation)
        claimed = self.keys.claimed_prefix(node_id, incarnation)
        resp = await self.etcd.read_txn(
            "reconcile_read",
            [
                rpc.RequestOp(
                    request_range=rpc.RangeRequest(
                        key=prefix, range_end=prefix_range_end(prefix), keys_only=True
                    )
                )
                for prefix in (index, claimed)
            ],
        )
        referenced = {self.keys.by_node_parts(kv.key)[2] for kv in resp.responses[0].response_range.kvs}
        referenced |= {self.keys.claimed_parts(kv.key)[2] for kv in resp.responses[1].response_range.kvs}
        return [r for r in request_ids if r not in referenced]

    async def pending_releases(self, node_id: str) -> list[tuple[PendingRelease, int]]:
        """Release commands queued for a node, with their mod_revisions, oldest first."""
        prefix = self.keys.releases_prefix(node_id)
        resp = await self.etcd.read(
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

    async def ack_release(self, node_id: str, command_id: str, freed: tuple[str, str] | None = None) -> None:
        """Deletes an acknowledged release command. With `freed` (the holder's incarnation and
        request id), the same transaction records the blocks as freed, as `release_freed` would
        when the engine reported them: one request for both, and the node leaves the blocks out
        of its report (`ReleaseCommand.ack_records_freed`). The released handle had no index left
        and no claim (the release removed the one; a handle checked out is never released)."""
        command = fencing.delete(self.keys.release(node_id, command_id))
        if freed is None:
            await self.etcd.write("ack_release", [], [command])
            return
        tombstone = self.keys.freed(node_id, *freed)
        await self._under_tombstone_lease(
            lambda lease: self.etcd.write("ack_release", [], [fencing.put(tombstone, b"", lease), command])
        )

    async def _under_tombstone_lease(self, write: Callable[[int], Awaitable[T]]) -> T:
        """`write(lease)` with the shared lease of tombstones written now; once more with a new
        lease if that one was revoked behind our back."""
        lease = await self.tombstone_lease()
        try:
            return await write(lease)
        except LeaseNotFound:
            self.leases.forget(lease)
        return await write(await self.tombstone_lease())

    def count(self, reason: str) -> None:
        self.telemetry.store.handle_transitions.labels("released", reason).inc()
