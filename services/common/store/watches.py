"""Reading a key range at a revision and watching it from there on."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from aetcd import rpc

from kvplane.services.common.model.errors import StoreUnavailable
from kvplane.services.common.model.keys import prefix_range_end
from kvplane.services.common.store.etcd import REQUIRE_LEADER, EtcdClient


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


class Compacted(StoreUnavailable):
    """A watch's start revision has been compacted away."""

    def __init__(self, compact_revision: int) -> None:
        super().__init__(f"revision compacted up to {compact_revision}")
        self.compact_revision = compact_revision


class Watches:
    def __init__(self, etcd: EtcdClient) -> None:
        self.etcd = etcd

    async def read_prefix(self, prefix: bytes) -> tuple[int, list[WatchEvent]]:
        """Every key under `prefix` as put events, and the revision of the read."""
        return await self.read_range(prefix, prefix_range_end(prefix))

    async def read_range(self, key: bytes, range_end: bytes) -> tuple[int, list[WatchEvent]]:
        """Every key in [key, range_end) as put events, and the revision of the read."""
        resp = await self.etcd.read("read_range", rpc.RangeRequest(key=key, range_end=range_end))
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
        re-read and resume.
        """
        conn = await self.etcd.current()
        create = rpc.WatchRequest(
            create_request=rpc.WatchCreateRequest(
                key=key,
                range_end=range_end,
                start_revision=start_revision,
                prev_kv=prev_kv,
                progress_notify=True,
            )
        )
        call = conn.watch.Watch(metadata=REQUIRE_LEADER)
        try:
            await call.write(create)
            while True:
                resp = await call.read()
                if resp is grpc.aio.EOF:
                    raise StoreUnavailable("etcd watch stream ended")
                if resp.compact_revision:
                    raise Compacted(int(resp.compact_revision))
                if resp.canceled:
                    await self.etcd.failed(conn, grpc.StatusCode.UNAVAILABLE)
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
            await self.etcd.failed(conn, exc.code())
            raise StoreUnavailable(f"etcd watch failed: {exc.code().name}") from exc
        finally:
            call.cancel()
