"""etcd leases: grants, keep-alives, revocations, and the shared leases that
bind handles to their wall-clock expiry."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import grpc
from aetcd import rpc

from kvplane.services.common.model.errors import NotFound, StoreUnavailable
from kvplane.services.common.store.etcd import (
    REQUIRE_LEADER,
    Ambiguous,
    Connection,
    EtcdClient,
    LeaseNotFound,
)


class Leases:
    def __init__(self, etcd: EtcdClient) -> None:
        self.etcd = etcd
        # Leases for keys that end with a wall-clock expiry (handles, tombstones) are shared by
        # expiry bucket: one grant serves every key whose expiry falls in the bucket, so grants
        # come at most once per bucket, not once per publish. Keyed by the bucket's end second.
        self._by_second: dict[int, int] = {}
        self._lock = asyncio.Lock()

    async def grant(self, ttl_s: int) -> int:
        request = rpc.LeaseGrantRequest(TTL=ttl_s)
        try:
            resp = await self.etcd.call("lease_grant", _grant, request)
        except Ambiguous as exc:
            # Safe to re-send: an orphan lease from a lost reply expires on its own.
            resp = await self.etcd.resend(exc, lambda: self.etcd.call("lease_grant", _grant, request))
        return int(resp.ID)

    async def refresh(self, lease_id: int, op: str = "lease_keepalive") -> int:
        """Keeps a lease alive once; returns the remaining TTL. NotFound if it is gone.

        `op` names the request in metrics and traces (a node's keep-alive, an election's)."""
        conn = await self.etcd.current()
        timeout = self.etcd.settings.request_timeout_s

        async def one() -> Any:
            call = conn.lease.LeaseKeepAlive(timeout=timeout, metadata=REQUIRE_LEADER)
            await call.write(rpc.LeaseKeepAliveRequest(ID=lease_id))
            reply = await call.read()
            await call.done_writing()
            call.cancel()
            return reply

        with self.etcd.telemetry.etcd_span(op):
            try:
                async with asyncio.timeout(timeout):
                    reply = await one()
            except (TimeoutError, grpc.aio.AioRpcError) as exc:
                code = (
                    exc.code() if isinstance(exc, grpc.aio.AioRpcError) else grpc.StatusCode.DEADLINE_EXCEEDED
                )
                await self.etcd.failed(conn, code)
                raise StoreUnavailable(f"etcd lease keepalive failed: {exc!r}") from exc
        if reply is grpc.aio.EOF or reply.TTL <= 0:
            raise NotFound(f"lease {lease_id:x} has expired")
        return int(reply.TTL)

    async def revoke(self, lease_id: int) -> None:
        try:
            await self.etcd.call("lease_revoke", _revoke, rpc.LeaseRevokeRequest(ID=lease_id))
        except LeaseNotFound:
            pass
        except Ambiguous as exc:
            raise StoreUnavailable(f"etcd lease revoke: {exc.cause.details()}") from exc

    async def for_expiry(self, expiry_unix_ms: int, granularity_s: int | None = None) -> int:
        """A shared lease that ends at or after `expiry_unix_ms`, within `granularity_s`.

        The lease never ends before the expiry, so it covers its keys for their whole life;
        it may outlive it by up to one bucket. By default the bucket is an eighth of the life
        left (1 to 60 s): a handle kept 480 s outlives its expiry by at most 60 s, and nothing
        reads a handle past its expiry (routing hands out only handles with life left). At one
        turn every few seconds, that is one grant a minute per expiry, not one every few turns.
        """
        if granularity_s is None:
            granularity_s = bucket_s(expiry_unix_ms - int(time.time() * 1000))
        second = -(-expiry_unix_ms // (1000 * granularity_s)) * granularity_s
        async with self._lock:
            now_s = time.time()
            for stale in [s for s in self._by_second if s < now_s]:
                del self._by_second[stale]
            lease = self._by_second.get(second)
            if lease is None:
                lease = await self.grant(max(1, int(second - now_s) + 1))
                self._by_second[second] = lease
            return lease

    def forget(self, lease: int) -> None:
        """Stops handing out `lease` (it was found gone)."""
        for second, held in list(self._by_second.items()):
            if held == lease:
                del self._by_second[second]

    def forget_all(self) -> None:
        """Stops handing out every shared lease (they were revoked behind our back)."""
        self._by_second.clear()


# The largest expiry bucket, seconds (`Leases.for_expiry`).
MAX_BUCKET_S = 60


def bucket_s(life_ms: int) -> int:
    """The expiry bucket for a key with `life_ms` left: an eighth of it, 1 to 60 s."""
    return max(1, min(MAX_BUCKET_S, life_ms // 8_000))


def _grant(conn: Connection) -> Callable[..., Any]:
    return conn.lease.LeaseGrant  # type: ignore[no-any-return]


def _revoke(conn: Connection) -> Callable[..., Any]:
    return conn.lease.LeaseRevoke  # type: ignore[no-any-return]
