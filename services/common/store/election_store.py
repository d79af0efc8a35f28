"""Leader elections: one key per election, bound to the leader's lease."""

from __future__ import annotations

from aetcd import rpc

from kvplane.services.common.model.errors import StoreUnavailable
from kvplane.services.common.model.keys import KeyLayout
from kvplane.services.common.store import fencing
from kvplane.services.common.store.etcd import EtcdClient
from kvplane.services.common.store.records import ElectionRecord


class ElectionStore:
    def __init__(self, etcd: EtcdClient, keys: KeyLayout) -> None:
        self.etcd = etcd
        self.keys = keys

    async def campaign(self, name: str, candidate: str, lease: int) -> ElectionRecord:
        """Tries to make `candidate` the leader of `name`.

        One txn puts `candidate` on the election key, bound to `lease`, only
        if the key does not exist; either way it returns the leader after the
        attempt, so the caller won if the record names its own lease. The key
        vanishes with the lease, which is what lets a standby take over.
        """
        key = self.keys.election(name)
        read = fencing.get(key)
        # Re-sending after an unseen success finds our own record: still a win.
        resp = await self.etcd.write(
            "campaign", [fencing.absent(key)], [fencing.put(key, candidate.encode(), lease), read], [read]
        )
        kvs = resp.responses[-1].response_range.kvs
        if not kvs:
            raise StoreUnavailable(f"election {name!r}: leader key vanished during the campaign")
        kv = kvs[0]
        return ElectionRecord(
            kv.value.decode(), int(kv.lease), int(kv.mod_revision), int(resp.header.revision)
        )

    async def leader(self, name: str) -> ElectionRecord | None:
        """The current leader of `name`, if any."""
        resp = await self.etcd.read("election_leader", rpc.RangeRequest(key=self.keys.election(name)))
        if not resp.kvs:
            return None
        kv = resp.kvs[0]
        return ElectionRecord(
            kv.value.decode(), int(kv.lease), int(kv.mod_revision), int(resp.header.revision)
        )
