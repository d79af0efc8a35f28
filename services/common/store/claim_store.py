"""Claims: the single-use check-out of a retained handle, its consumption,
and the release of a claim nobody used.

A claim lives at `claimed/{node}/{incarnation}/{request}`, keyed by the
blocks it hands out, so that the holder's report that it freed them (P read
them, or D dropped them) consumes it in the report's one transaction, with
no read first (`ReleaseStore.release_freed`). One still there past the claim
deadline means the turn never reached P (the client left, the gateway died):
the holder still pins the blocks, so a release command is queued, fenced on
the claim being unchanged, exactly as for a retained handle.
"""

from __future__ import annotations

import functools
import uuid

from aetcd import rpc

from kvplane.services.common.model import convert
from kvplane.services.common.model.errors import HandleNotRetained, NotFound
from kvplane.services.common.model.handles import Claim, PendingRelease, ReleaseReason
from kvplane.services.common.model.keys import KeyLayout, prefix_range_end
from kvplane.services.common.runtime.telemetry import Telemetry
from kvplane.services.common.store import fencing
from kvplane.services.common.store.etcd import Ambiguous, EtcdClient, LeaseNotFound
from kvplane.services.common.store.records import (
    CheckOut,
    HandleRecord,
    HandleReplaced,
    decode_handle,
    now_ms,
)
from kvplane.services.common.store.release_store import ReleaseStore
from kvplane.v1 import handle_pb2


def _current_handle(resp: rpc.TxnResponse) -> HandleRecord | None:
    """The handle a failed check-out's read found (None: the conversation retains none)."""
    kvs = resp.responses[0].response_range.kvs if resp.responses else []
    if not kvs:
        return None
    kv = kvs[0]
    return HandleRecord(decode_handle(kv.value), int(kv.mod_revision), int(kv.lease))


class ClaimStore:
    def __init__(
        self, etcd: EtcdClient, keys: KeyLayout, telemetry: Telemetry, releases: ReleaseStore
    ) -> None:
        self.etcd = etcd
        self.keys = keys
        self.telemetry = telemetry
        self.releases = releases

    async def check_out(
        self, tenant: str, conversation: str, record: HandleRecord, *, route_id: str = "", claim_id: str = ""
    ) -> CheckOut:
        """Hands the handle read as `record` to one caller, at most once.

        One transaction: the handle key's mod_revision still equals the one
        read; then delete the handle and its index, write the claim on its
        blocks, point the conversation's check-out at it and retire the blocks
        (`ReleaseStore.retire_op`), all under the handle's own lease.
        HandleNotRetained if another caller won, or HandleReplaced (with the
        handle etcd holds, read in the same transaction) if the conversation's
        handle is another one now; NotFound for a handle past its wall-clock
        expiry.
        """
        handle = record.handle
        if handle.wall_expiry_unix_ms <= now_ms():
            # Its lease may outlive it by an expiry bucket; its blocks may be gone already.
            raise NotFound(f"the handle of conversation {conversation!r} has expired")
        claim_id = claim_id or uuid.uuid4().hex
        # The handle is converted to protobuf once: the claim stores it, the caller answers with it.
        handle_pb = convert.handle_to_pb(handle)
        claim = handle_pb2.Claim(
            claim_id=claim_id, handle=handle_pb, route_id=route_id, claimed_unix_ms=now_ms()
        )
        claim_key = self.keys.claimed(
            handle.holder_node_id, handle.holder_incarnation, handle.vllm.remote_request_id
        )
        # The claim shares the handle's lease: it lives no longer than the
        # blocks could, and the check-out needs no lease grant of its own.
        claim_lease = record.lease
        key = self.keys.handle(tenant, conversation)
        compare = [fencing.same_revision(key, record.mod_revision)]
        # On a lost compare, what the key holds now comes back in the same round trip.
        failure = [fencing.get(key)]
        ops = [
            fencing.delete(key),
            fencing.delete(
                self.keys.by_node(
                    handle.holder_node_id, handle.holder_incarnation, handle.vllm.remote_request_id
                )
            ),
            fencing.put(claim_key, claim.SerializeToString(), claim_lease),
            fencing.put(self.keys.checkout(tenant, conversation), claim_key, claim_lease),
            # Handed out once: a re-sent publish of this handle must not bring it back.
            self.releases.retire_op(handle, claim_lease),
        ]
        try:
            resp = await self.etcd.txn(
                "check_out", compare, ops, failure, conversation=conversation, claim_id=claim_id
            )
            won = bool(resp.succeeded)
        except Ambiguous as exc:
            resp = await self.etcd.resend(exc, lambda: self.etcd.txn("check_out", compare, ops, failure))
            won = bool(resp.succeeded) or await self._is_ours(claim_key, claim_id)
        if not won:
            current = _current_handle(resp) if not resp.succeeded else None
            if current is not None and current.handle.handle_id != handle.handle_id:
                raise HandleReplaced(f"conversation {conversation!r} retains another handle now", current)
            raise HandleNotRetained(f"handle of conversation {conversation!r} was taken or replaced")
        self.telemetry.store.handle_transitions.labels("checked_out", "").inc()
        return CheckOut(handle, claim_id, int(resp.header.revision), handle_pb.SerializeToString())

    async def _is_ours(self, claim_key: bytes, claim_id: str) -> bool:
        """Whether the claim on these blocks is `claim_id` (settling an ambiguous check-out:
        blocks are claimed once, so an attempt of ours applied if the claim is ours). A claim
        consumed meanwhile reads as not ours: the caller recomputes, and no P is sent to blocks
        that are gone."""
        resp = await self.etcd.read("read_back", rpc.RangeRequest(key=claim_key))
        claim = _claim(resp.kvs[0].value) if resp.kvs else None
        return claim is not None and claim.claim_id == claim_id

    async def latest(self, tenant: str, conversation: str) -> Claim | None:
        """The conversation's latest check-out, while its claim lives."""
        resp = await self.etcd.read(
            "get_checkout", rpc.RangeRequest(key=self.keys.checkout(tenant, conversation))
        )
        if not resp.kvs:
            return None
        claimed = await self.etcd.read("get_claim", rpc.RangeRequest(key=bytes(resp.kvs[0].value)))
        if not claimed.kvs:
            return None
        return _claim(claimed.kvs[0].value)

    async def release_unused(self, deadline_ms: int, now_ms: int) -> list[PendingRelease]:
        """Queues a release for every claim older than `deadline_ms` that nobody consumed.

        Each is one transaction fenced on the claim key's mod_revision: it
        deletes the claim and queues the command, so a claim consumed
        meanwhile, or released by another replica, is left alone.
        """
        prefix = self.keys.all_claims_prefix()
        resp = await self.etcd.read(
            "claims_scan", rpc.RangeRequest(key=prefix, range_end=prefix_range_end(prefix))
        )
        released: list[PendingRelease] = []
        for kv in resp.kvs:
            claim = _claim(kv.value)
            if claim is None or now_ms - claim.claimed_unix_ms < deadline_ms:
                continue
            h = claim.handle
            pending = PendingRelease(uuid.uuid4().hex, h, ReleaseReason.CLAIM_UNUSED, now_ms)
            ops = [
                fencing.delete(bytes(kv.key)),
                fencing.put(
                    self.keys.release(h.holder_node_id, pending.command_id),
                    convert.pending_to_pb(pending).SerializeToString(),
                    int(kv.lease),
                ),
            ]
            compare = [fencing.same_revision(bytes(kv.key), int(kv.mod_revision))]
            try:
                won = bool((await self.etcd.txn("release_unused_claim", compare, ops)).succeeded)
            except Ambiguous as exc:
                resp_again = await self.etcd.resend(
                    exc, functools.partial(self.etcd.txn, "release_unused_claim", compare, ops)
                )
                won = bool(resp_again.succeeded) or await self.etcd.exists(
                    self.keys.release(h.holder_node_id, pending.command_id)
                )
            except LeaseNotFound:
                continue  # the handle's lease ended: D's own TTL has freed the blocks
            if won:
                self.telemetry.store.handle_transitions.labels(
                    "released", ReleaseReason.CLAIM_UNUSED.value
                ).inc()
                released.append(pending)
        return released


def _claim(value: bytes) -> Claim | None:
    """The claim stored in `value`; None for a value that is not one."""
    try:
        return convert.claim_from_pb(handle_pb2.Claim.FromString(value))
    except Exception:
        return None
