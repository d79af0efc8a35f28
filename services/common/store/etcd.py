"""The etcd connection and its calls: deadlines, error mapping, and settling
a write whose outcome is unknown.

aetcd supplies the etcd v3 API bindings for grpc.aio; they are driven
directly so that each request carries its own deadline and every
transaction's outcome is known. A transaction that times out may still
apply: writes that matter carry an id (the claim id, the command id), and an
ambiguous outcome is settled by re-sending the same fenced transaction and
reading that id back (`resend`, `exists`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc
from aetcd import rpc

from kvplane.services.common.errors import NotFound, StoreUnavailable
from kvplane.services.common.store.settings import StoreSettings
from kvplane.services.common.telemetry import Telemetry

# gRPC codes after which a write may or may not have been applied.
_AMBIGUOUS = frozenset(
    {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}
)


class Ambiguous(Exception):
    """An etcd request whose outcome is unknown (timeout, connection lost)."""

    def __init__(self, op: str, cause: grpc.aio.AioRpcError) -> None:
        super().__init__(f"{op}: {cause.code().name}")
        self.op = op
        self.cause = cause


class LeaseNotFound(NotFound):
    """The lease named has expired or was revoked."""


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


class EtcdClient:
    """One channel to etcd and the KV, lease and watch stubs on it."""

    def __init__(self, settings: StoreSettings, telemetry: Telemetry) -> None:
        self.settings = settings
        self.telemetry = telemetry
        self._channel: grpc.aio.Channel | None = None
        self.kv: Any = None
        self.lease: Any = None
        self.watch: Any = None

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
        self.kv = rpc.KVStub(self._channel)
        self.lease = rpc.LeaseStub(self._channel)
        self.watch = rpc.WatchStub(self._channel)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def call(self, op: str, method: Callable[..., Any], request: Any, **attrs: Any) -> Any:
        """One unary etcd call under the request deadline.

        Raises Ambiguous when the outcome is unknown, LeaseNotFound when a
        lease it names is gone, StoreUnavailable otherwise.
        """
        if self._channel is None:
            await self.connect()
        with self.telemetry.etcd_span(op, **attrs):
            try:
                return await method(request, timeout=self.settings.request_timeout_s)
            except grpc.aio.AioRpcError as exc:
                if exc.code() in _AMBIGUOUS:
                    raise Ambiguous(op, exc) from exc
                if "lease not found" in (exc.details() or ""):
                    raise LeaseNotFound(f"etcd {op}: {exc.details()}") from exc
                raise StoreUnavailable(f"etcd {op} failed: {exc.code().name}: {exc.details()}") from exc

    async def txn(
        self, op: str, compare: list[Any], success: list[Any], failure: list[Any] | None = None, **attrs: Any
    ) -> Any:
        if self._channel is None:
            await self.connect()
        request = rpc.TxnRequest(compare=compare, success=success, failure=failure or [])
        return await self.call(op, self.kv.Txn, request, **attrs)

    async def read(self, op: str, request: Any) -> Any:
        """A range read; reads are idempotent, so a failure is just unavailability."""
        if self._channel is None:
            await self.connect()
        try:
            return await self.call(op, self.kv.Range, request)
        except Ambiguous as exc:
            raise StoreUnavailable(f"etcd {op}: {exc.cause.details()}") from exc

    async def read_txn(self, op: str, ops: list[Any]) -> Any:
        """Several range reads at one revision."""
        try:
            return await self.txn(op, [], ops)
        except Ambiguous as exc:
            raise StoreUnavailable(f"etcd {op}: {exc.cause.details()}") from exc

    async def write(
        self, op: str, compare: list[Any], success: list[Any], failure: list[Any] | None = None
    ) -> Any:
        """A write whose ops are idempotent: an ambiguous outcome is re-sent."""
        try:
            return await self.txn(op, compare, success, failure)
        except Ambiguous as exc:
            return await self.resend(exc, lambda: self.txn(op, compare, success, failure))

    async def resend(self, first: Ambiguous, send: Callable[[], Awaitable[Any]]) -> Any:
        """Re-sends a fenced transaction until etcd answers, up to settle_timeout_s.

        The transaction is fenced (or idempotent), so at most one of the
        attempts applies; the caller reads its id back when the answer is
        "did not apply", since an earlier attempt may have.
        """
        deadline = time.monotonic() + self.settings.settle_timeout_s
        delay = 0.05
        last: Ambiguous = first
        while time.monotonic() < deadline:
            await asyncio.sleep(delay)  # back off before re-sending
            try:
                return await send()
            except Ambiguous as exc:
                last = exc
                delay = min(delay * 2, 1.0)
        raise StoreUnavailable(f"etcd {last.op} outcome unknown: {last.cause.details()}") from last

    async def exists(self, key: bytes) -> bool:
        """Whether `key` exists, retried until etcd answers (settling a write)."""
        deadline = time.monotonic() + self.settings.settle_timeout_s
        while True:
            try:
                resp = await self.call("read_back", self.kv.Range, rpc.RangeRequest(key=key, count_only=True))
                return int(resp.count) > 0
            except Ambiguous as exc:
                if time.monotonic() > deadline:
                    raise StoreUnavailable(f"etcd read-back failed: {exc.cause.details()}") from exc
                await asyncio.sleep(0.1)
