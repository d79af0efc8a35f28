"""What the engines hold against what etcd references: orphaned blocks, handles whose
blocks are gone, and claims stranded past their deadline."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass

import aiohttp

from kvplane.services.common.model import convert
from kvplane.services.common.model.errors import KvplaneError
from kvplane.services.common.store import Store, now_ms
from kvplane.v1 import handle_pb2
from tests.chaos.cluster import CLAIM_DEADLINE_S, ChaosCluster, engine_state

# Retained handles this close to the engine's TTL are not counted, seconds.
EXPIRY_GRACE_S = 5.0


@dataclass(frozen=True)
class Ledger:
    # Decode handles an engine retains that no handle, claim or queued release names.
    orphaned: int
    # Retained handles in etcd whose holder no longer holds the blocks.
    dangling: int
    # Claims older than the claim deadline (and the sweep after it).
    stranded_claims: int

    @property
    def clean(self) -> bool:
        return self.orphaned == self.dangling == self.stranded_claims == 0


async def take_ledger(cluster: ChaosCluster, store: Store, session: aiohttp.ClientSession) -> Ledger:
    orphaned = dangling = 0
    keys = store.keys
    for node_id, url in cluster.engine_urls.items():
        if not node_id.startswith("d"):
            continue
        try:
            state = await engine_state(session, url)
        except (aiohttp.ClientError, TimeoutError):
            continue  # a dead engine holds nothing
        retained = {
            str(r["request_id"])
            for r in state["retained"]
            # One about to reach its TTL has lost its etcd record a moment early (by design).
            if r["kind"] == "decode_handle" and float(r["expires_in_s"]) > EXPIRY_GRACE_S  # type: ignore[index, union-attr]
        }
        record = await store.get_node(node_id)
        if record is None:
            orphaned += len(retained)
            continue
        incarnation = record.node.incarnation
        _, indexed = await store.read_prefix(keys.by_node_prefix(node_id, incarnation))
        handles = {keys.by_node_parts(ev.key)[2] for ev in indexed}
        _, claimed = await store.read_prefix(keys.claimed_prefix(node_id, incarnation))
        claims = {keys.claimed_parts(ev.key)[2] for ev in claimed}
        releasing = {p.handle.vllm.remote_request_id for p, _ in await store.pending_releases(node_id)}
        orphaned += len(retained - handles - claims - releasing)
        dangling += len(handles - retained)
    _, claim_events = await store.read_prefix(keys.all_claims_prefix())
    deadline_ms = now_ms() - int((CLAIM_DEADLINE_S + 5) * 1000)
    stranded = 0
    for ev in claim_events:
        claim = convert.claim_from_pb(handle_pb2.Claim.FromString(ev.value))
        stranded += claim.claimed_unix_ms < deadline_ms
    return Ledger(orphaned, dangling, stranded)


async def settled_ledger(
    cluster: ChaosCluster, store: Store, session: aiohttp.ClientSession, timeout_s: float
) -> Ledger:
    """The ledger once clean, or as it stands after `timeout_s` (agents and sweeps catch up)."""
    deadline = time.monotonic() + timeout_s
    last = Ledger(-1, -1, -1)
    while time.monotonic() < deadline:
        with contextlib.suppress(KvplaneError):  # etcd still coming back
            last = await take_ledger(cluster, store, session)
        if last.clean:
            return last
        await asyncio.sleep(1.0)  # polling until the deadline
    return last
