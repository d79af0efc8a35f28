"""Claims: the single-use check-out of a retained handle."""

from __future__ import annotations

import uuid

from kvplane.services.common import convert
from kvplane.services.common.errors import HandleNotRetained
from kvplane.services.common.handles import Claim
from kvplane.services.common.keys import KeyLayout
from kvplane.services.common.store import fencing
from kvplane.services.common.store.etcd import Ambiguous, EtcdClient
from kvplane.services.common.store.records import CheckOut, HandleRecord, now_ms
from kvplane.services.common.telemetry import Telemetry


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
        claim = Claim(claim_id, handle, route_id, now_ms())
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
            fencing.put(claim_key, convert.claim_to_pb(claim).SerializeToString(), claim_lease),
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
        return CheckOut(handle, claim_id, int(resp.header.revision))
