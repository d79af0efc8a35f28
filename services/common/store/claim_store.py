"""Claims: the single-use check-out of a retained handle, its consumption,
and the release of a claim nobody used.

A claim is consumed when its holder reports the blocks freed (P read them,
or D dropped them). One still there past the claim deadline means the turn
never reached P (the client left, the gateway died): the holder still pins
the blocks, so a release command is queued, fenced on the claim being
unchanged, exactly as for a retained handle.
"""

from __future__ import annotations

import functools
import uuid
from collections.abc import Iterable

from aetcd import rpc

from kvplane.services.common import convert
from kvplane.services.common.errors import HandleNotRetained
from kvplane.services.common.handles import PendingRelease, ReleaseReason
from kvplane.services.common.keys import KeyLayout, prefix_range_end
from kvplane.services.common.store import fencing
from kvplane.services.common.store.etcd import Ambiguous, EtcdClient, LeaseNotFound
from kvplane.services.common.store.records import CheckOut, HandleRecord, now_ms
from kvplane.services.common.telemetry import Telemetry
from kvplane.v1 import handle_pb2


class ClaimStore:
    def __init__(self, etcd: EtcdClient, keys: KeyLayout, telemetry: Telemetry) -> None:
        self.etcd = etcd
        self.keys = keys
        self.telemetry = telemetry

    async def check_out(
        self, tenant: str, conversation: str, record: HandleRecord, *, route_id: str = "", claim_id: str = ""
    ) -> CheckOut:
        """Hands the handle read as `record` to one caller, at most once.

        One transaction: the handle key's mod_revision still equals the one
        read; then delete the handle and its index, and write a claim under
        the handle's own lease. HandleNotRetained if another caller won.
        """
        handle = record.handle
        claim_id = claim_id or uuid.uuid4().hex
        # The handle is converted to protobuf once: the claim stores it, the caller answers with it.
        handle_pb = convert.handle_to_pb(handle)
        claim = handle_pb2.Claim(
            claim_id=claim_id, handle=handle_pb, route_id=route_id, claimed_unix_ms=now_ms()
        )
        claim_key = self.keys.claim(tenant, conversation, claim_id)
        # The claim shares the handle's lease: it lives no longer than the
        # blocks could, and the check-out needs no lease grant of its own.
        claim_lease = record.lease
        key = self.keys.handle(tenant, conversation)
        compare = [fencing.same_revision(key, record.mod_revision)]
        ops = [
            fencing.delete(key),
            fencing.delete(
                self.keys.by_node(
                    handle.holder_node_id, handle.holder_incarnation, handle.vllm.remote_request_id
                )
            ),
            fencing.put(claim_key, claim.SerializeToString(), claim_lease),
            fencing.put(
                self.keys.claimed(
                    handle.holder_node_id, handle.holder_incarnation, handle.vllm.remote_request_id
                ),
                claim_key,
                claim_lease,
            ),
        ]
        try:
            resp = await self.etcd.txn(
                "check_out", compare, ops, conversation=conversation, claim_id=claim_id
            )
            won = bool(resp.succeeded)
        except Ambiguous as exc:
            resp = await self.etcd.resend(exc, lambda: self.etcd.txn("check_out", compare, ops))
            won = bool(resp.succeeded) or await self.etcd.exists(claim_key)
        if not won:
            raise HandleNotRetained(f"handle of conversation {conversation!r} was taken or replaced")
        self.telemetry.store.handle_transitions.labels("checked_out", "").inc()
        return CheckOut(handle, claim_id, int(resp.header.revision), handle_pb.SerializeToString())

    async def consumed(self, node_id: str, incarnation: str, request_ids: Iterable[str]) -> int:
        """Drops the claims on blocks their holder reports freed; returns how many."""
        prefix = self.keys.claimed_prefix(node_id, incarnation)
        wanted = set(request_ids)
        resp = await self.etcd.read(
            "claimed_scan", rpc.RangeRequest(key=prefix, range_end=prefix_range_end(prefix))
        )
        dropped = 0
        for kv in resp.kvs:
            if self.keys.claimed_parts(bytes(kv.key))[2] in wanted:
                await self.etcd.write(
                    "claim_consumed", [], [fencing.delete(bytes(kv.value)), fencing.delete(bytes(kv.key))]
                )
                dropped += 1
        return dropped

    async def release_unused(self, deadline_ms: int, now_ms: int) -> list[PendingRelease]:
        """Queues a release for every claim older than `deadline_ms` that nobody consumed.

        Each is one transaction fenced on the claim key's mod_revision: it
        deletes the claim and its index and queues the command, so a claim
        consumed meanwhile, or released by another replica, is left alone.
        """
        prefix = self.keys.all_claims_prefix()
        resp = await self.etcd.read(
            "claims_scan", rpc.RangeRequest(key=prefix, range_end=prefix_range_end(prefix))
        )
        released: list[PendingRelease] = []
        for kv in resp.kvs:
            claim = convert.claim_from_pb(handle_pb2.Claim.FromString(kv.value))
            if now_ms - claim.claimed_unix_ms < deadline_ms:
                continue
            h = claim.handle
            pending = PendingRelease(uuid.uuid4().hex, h, ReleaseReason.CLAIM_UNUSED, now_ms)
            ops = [
                fencing.delete(bytes(kv.key)),
                fencing.delete(
                    self.keys.claimed(h.holder_node_id, h.holder_incarnation, h.vllm.remote_request_id)
                ),
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
