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
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from aetcd import rpc

from kvplane.services.common.model.errors import NotFound, StoreUnavailable
from kvplane.services.common.runtime.telemetry import Telemetry
from kvplane.services.common.store.etcd_credentials import EtcdCredentials
from kvplane.services.common.store.members import Member, parse_members
from kvplane.services.common.store.settings import StoreSettings

log = logging.getLogger(__name__)

# gRPC codes after which a write may or may not have been applied.
_AMBIGUOUS = frozenset(
    {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED}
)
# Codes that say the member did not answer, so another one should be asked.
_FAILOVER_CODES = frozenset({grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE})


class Ambiguous(Exception):
    """An etcd request whose outcome is unknown (timeout, connection lost)."""

    def __init__(self, op: str, cause: grpc.aio.AioRpcError) -> None:
        super().__init__(f"{op}: {cause.code().name}")
        self.op = op
        self.cause = cause


class LeaseNotFound(NotFound):
    """The lease named has expired or was revoked."""


# etcd cancels a stream carrying this when its member loses the leader, so
# a watch or keep-alive on a member cut off from quorum fails instead of
# going silent.
REQUIRE_LEADER = (("hasleader", "true"),)

# How long a health probe of one member may take, in seconds.
_PROBE_TIMEOUT_S = 1.0
# Failovers closer together than this are skipped: during a whole-cluster
# outage every call fails, and one probe round per interval is enough.
_FAILOVER_INTERVAL_S = 0.5
# A member that left a call unanswered this recently comes last when the client must move without
# a probe to go by (`_open_next`): a frozen member refuses nothing, so only its silence tells.
_UNANSWERED_MEMORY_S = 10.0


@dataclass(frozen=True, slots=True)
class Connection:
    """A channel to one member and the stubs on it. `generation` tells a
    failure on the current connection from one on a connection already
    replaced."""

    generation: int
    member: Member
    channel: grpc.aio.Channel
    kv: Any
    lease: Any
    watch: Any


def open_channel(
    target: str, credentials: EtcdCredentials | None = None, authority: str = ""
) -> grpc.aio.Channel:
    """The one place an etcd channel is made (TLS and etcd's user: `credentials`).

    `authority`: the member's name when `target` lists the addresses it resolved to, so that
    TLS checks the certificate against the name, not an address.
    """
    return (credentials or EtcdCredentials()).channel(
        target,
        options=[
            *((("grpc.default_authority", authority),) if authority else ()),
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


class EtcdClient:
    """The connection to one etcd member at a time, failing over to another.

    With several endpoints, a call that fails for want of an answer
    (UNAVAILABLE, DEADLINE_EXCEEDED: the member is down, or cut off from
    quorum) moves the client to the next member that answers a quorum read;
    reads are retried there at once, writes are settled by their callers'
    re-sends. Each member's name is resolved again whenever it is connected.
    """

    def __init__(self, settings: StoreSettings, telemetry: Telemetry) -> None:
        self.settings = settings
        self.telemetry = telemetry
        self.members = parse_members(settings.endpoints)
        self._conn: Connection | None = None
        self._generation = 0
        self._switch = asyncio.Lock()
        self._last_failover = -_FAILOVER_INTERVAL_S
        # When each member last left a call unanswered (monotonic s).
        self._unanswered: dict[Member, float] = {}
        self._retired: set[asyncio.Task[None]] = set()
        # Since when calls have gone unanswered (monotonic s; None: the last call was answered),
        # and why: what a process's health reports (`ServiceProcess`).
        self.unreachable_since: float | None = None
        self.last_error = ""

    @property
    def kv(self) -> Any:
        """The current member's KV stub (for benchmarks that bypass the store)."""
        if self._conn is None:
            raise StoreUnavailable("etcd client is not connected")
        return self._conn.kv

    @property
    def member(self) -> Member | None:
        """The member calls go to now."""
        return self._conn.member if self._conn is not None else None

    async def connect(self) -> None:
        if self._conn is not None:
            return
        async with self._switch:
            if self._conn is None:
                self._conn = await self._open_healthy(exclude=None) or await self._open_any()

    async def current(self) -> Connection:
        await self.connect()
        assert self._conn is not None
        return self._conn

    async def close(self) -> None:
        async with self._switch:
            conn, self._conn = self._conn, None
        for task in list(self._retired):
            task.cancel()
        if conn is not None:
            await conn.channel.close()

    async def _open(self, member: Member) -> Connection:
        if len(self.members) == 1:
            # gRPC's own resolver, re-resolving as it reconnects.
            target = member.endpoint.removeprefix("http://").removeprefix("https://")
        else:
            target = await member.target()
        authority = "" if member.is_literal or len(self.members) == 1 else member.host
        channel = open_channel(target, self.settings.credentials, authority)
        self._generation += 1
        return Connection(
            self._generation,
            member,
            channel,
            rpc.KVStub(channel),
            rpc.LeaseStub(channel),
            rpc.WatchStub(channel),
        )

    async def _open_any(self) -> Connection:
        """The first member whose name resolves: nothing answers now, and the
        channel's reconnects find etcd when it is back."""
        for member in self.members:
            try:
                return await self._open(member)
            except OSError:
                continue
        raise StoreUnavailable(f"no etcd endpoint resolves: {list(self.settings.endpoints)}")

    async def _open_next(self, after: Member) -> Connection | None:
        """The next member after `after` whose name resolves, unprobed; members that left a call
        unanswered in the last `_UNANSWERED_MEMORY_S` come after the others."""
        start, now = self.members.index(after), time.monotonic()
        order = [self.members[(start + i) % len(self.members)] for i in range(1, len(self.members))]
        order.sort(key=lambda m: now - self._unanswered.get(m, -math.inf) < _UNANSWERED_MEMORY_S)
        for member in order:
            try:
                return await self._open(member)
            except OSError:
                continue
        return None

    async def _probe(self, member: Member) -> Connection | None:
        """A connection to `member` if it answers a quorum read in time."""
        try:
            conn = await self._open(member)
        except OSError:
            return None
        probe = rpc.RangeRequest(key=self.settings.prefix.encode(), limit=1, keys_only=True)
        try:
            await conn.kv.Range(probe, timeout=min(_PROBE_TIMEOUT_S, self.settings.request_timeout_s))
        except grpc.aio.AioRpcError:
            await conn.channel.close()
            return None
        return conn

    async def _open_healthy(self, exclude: Member | None) -> Connection | None:
        """The first healthy member, in configured order after `exclude`."""
        if len(self.members) == 1:
            return None if exclude is not None else await self._open(self.members[0])
        start = self.members.index(exclude) + 1 if exclude is not None else 0
        order = [self.members[(start + i) % len(self.members)] for i in range(len(self.members))]
        order = [m for m in order if m != exclude]
        probes = await asyncio.gather(*(self._probe(m) for m in order))
        chosen = next((c for c in probes if c is not None), None)
        for other in probes:
            if other is not None and other is not chosen:
                await other.channel.close()
        return chosen

    def note_unanswered(self, exc: grpc.aio.AioRpcError) -> None:
        """Records a call no member answered (a refusal by etcd itself is an answer)."""
        if exc.code() in _FAILOVER_CODES:
            if self.unreachable_since is None:
                self.unreachable_since = time.monotonic()
            self.last_error = f"{exc.code().name}: {' '.join((exc.details() or '').split())}"
        else:
            self.unreachable_since = None

    async def failed(self, conn: Connection, code: grpc.StatusCode) -> None:
        """Reports that a call on `conn` went unanswered; moves to another member."""
        if len(self.members) == 1 or code not in _FAILOVER_CODES:
            return
        self._unanswered[conn.member] = time.monotonic()
        async with self._switch:
            now = time.monotonic()
            if self._conn is not conn or now - self._last_failover < _FAILOVER_INTERVAL_S:
                return
            self._last_failover = now
            replacement = await self._open_healthy(exclude=conn.member)
            if replacement is None and code is grpc.StatusCode.UNAVAILABLE:
                # Nothing answers a quorum read (the others may be electing a
                # leader); a member that refuses connections is the worst of
                # them, so move to the next one that resolves.
                replacement = await self._open_next(conn.member)
            if replacement is None:
                return  # nothing better: stay, and let gRPC reconnect
            log.warning(
                "etcd member %s unanswered (%s); now using %s",
                conn.member.endpoint,
                code.name,
                replacement.member.endpoint,
            )
            self._conn = replacement
        # Calls still in flight on the old channel end with it, a little later.
        task = asyncio.create_task(self._retire(conn))
        self._retired.add(task)
        task.add_done_callback(self._retired.discard)

    async def _retire(self, conn: Connection) -> None:
        await asyncio.sleep(self.settings.request_timeout_s)
        await conn.channel.close()

    async def call(
        self,
        op: str,
        method: Callable[[Connection], Callable[..., Any]],
        request: Any,
        *,
        idempotent: bool = False,
        **attrs: Any,
    ) -> Any:
        """One unary etcd call under the request deadline, to the current member.

        An idempotent call that goes unanswered is tried once more on the
        member failed over to. Raises Ambiguous when the outcome is unknown,
        LeaseNotFound when a lease it names is gone, StoreUnavailable otherwise.
        """
        attempts = len(self.members) if idempotent else 1
        for attempt in range(attempts):
            conn = await self.current()
            with self.telemetry.etcd_span(op, **attrs):
                try:
                    reply = await method(conn)(request, timeout=self.settings.request_timeout_s)
                    self.unreachable_since = None
                    return reply
                except grpc.aio.AioRpcError as exc:
                    self.note_unanswered(exc)
                    await self.failed(conn, exc.code())
                    if exc.code() in _AMBIGUOUS:
                        if attempt + 1 < attempts and self._conn is not conn:
                            continue
                        raise Ambiguous(op, exc) from exc
                    if "lease not found" in (exc.details() or ""):
                        raise LeaseNotFound(f"etcd {op}: {exc.details()}") from exc
                    raise StoreUnavailable(f"etcd {op} failed: {exc.code().name}: {exc.details()}") from exc
        raise AssertionError("unreachable")

    async def txn(
        self,
        op: str,
        compare: list[Any],
        success: list[Any],
        failure: list[Any] | None = None,
        *,
        idempotent: bool = False,
        **attrs: Any,
    ) -> Any:
        request = rpc.TxnRequest(compare=compare, success=success, failure=failure or [])
        return await self.call(op, _txn, request, idempotent=idempotent, **attrs)

    async def read(self, op: str, request: Any) -> Any:
        """A range read; reads are idempotent, so a failure is just unavailability."""
        try:
            return await self.call(op, _range, request, idempotent=True)
        except Ambiguous as exc:
            raise StoreUnavailable(f"etcd {op}: {exc.cause.details()}") from exc

    async def read_txn(self, op: str, ops: list[Any]) -> Any:
        """Several range reads at one revision."""
        try:
            return await self.txn(op, [], ops, idempotent=True)
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
                resp = await self.call(
                    "read_back", _range, rpc.RangeRequest(key=key, count_only=True), idempotent=True
                )
                return int(resp.count) > 0
            except Ambiguous as exc:
                if time.monotonic() > deadline:
                    raise StoreUnavailable(f"etcd read-back failed: {exc.cause.details()}") from exc
                await asyncio.sleep(0.1)


def _txn(conn: Connection) -> Callable[..., Any]:
    return conn.kv.Txn  # type: ignore[no-any-return]


def _range(conn: Connection) -> Callable[..., Any]:
    return conn.kv.Range  # type: ignore[no-any-return]
