"""Leader election in etcd: exactly one coordinator replica acts.

A candidate grants itself a lease and puts its id on `election/{name}` in a
transaction that succeeds only if the key does not exist. The winner keeps
the lease alive; the key vanishes with the lease, and a standby watching the
key campaigns at once.

Losing leadership must stop the leader before a successor can start. The
successor can only win after the lease has expired in etcd, and the leader
judges expiry on its own clock, conservatively: from the moment it *sent*
its last successful keep-alive, plus the TTL etcd granted, minus a safety
margin. When that local deadline passes without a fresh keep-alive (etcd
unreachable) or etcd says the lease is gone, the term ends.

Nothing unsafe follows even if two replicas briefly act at once: every
release is a transaction fenced on the handle's mod_revision (one wins), and
nodes apply each command id at most once. Election only keeps the work from
being done twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field

from kvplane.services.common.model.errors import NotFound, StoreUnavailable
from kvplane.services.common.store import ElectionRecord, Store

log = logging.getLogger(__name__)


@dataclass
class Term:
    """One period of leadership. `lost` is set the moment it ends."""

    replica_id: str
    lease: int
    ttl_s: int
    # time.monotonic() after which the lease may have expired in etcd.
    valid_until: float
    lost: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def active(self) -> bool:
        return not self.lost.is_set() and time.monotonic() < self.valid_until


class LeaderElection:
    """Campaigns for `name` under `replica_id`; see the module docstring."""

    def __init__(
        self, store: Store, name: str, replica_id: str, ttl_s: int, *, safety_margin_s: float | None = None
    ) -> None:
        if ttl_s < 2:
            raise ValueError("the election lease TTL must be at least 2 s")
        self.store = store
        self.name = name
        self.replica_id = replica_id
        self.ttl_s = ttl_s
        # Time allowed between our clock and etcd's judging the lease expired.
        self.safety_margin_s = safety_margin_s if safety_margin_s is not None else max(0.5, ttl_s * 0.1)
        self.leader_id = ""
        self._keepalive: asyncio.Task[None] | None = None

    async def campaign(self) -> Term:
        """Returns once this replica leads; retries through etcd outages."""
        delay = 0.1
        while True:
            try:
                term = await self._try_once()
                if term is not None:
                    return term
                delay = 0.1
            except StoreUnavailable as exc:
                log.warning("election %s: %s", self.name, exc)
                await asyncio.sleep(delay)  # back off while etcd is unreachable
                delay = min(delay * 2, 2.0)

    async def _try_once(self) -> Term | None:
        current = await self.store.election_leader(self.name)
        if current is not None:
            self.leader_id = current.candidate
            await self._wait_vacant(current)
            return None
        sent = time.monotonic()
        lease = await self.store.grant_lease(self.ttl_s)
        try:
            record = await self.store.campaign(self.name, self.replica_id, lease)
        except (NotFound, StoreUnavailable):
            await self._revoke(lease)
            raise StoreUnavailable(f"election {self.name!r}: campaign failed") from None
        self.leader_id = record.candidate
        if record.lease != lease:
            await self._revoke(lease)
            return None
        term = Term(self.replica_id, lease, self.ttl_s, sent + self.ttl_s - self.safety_margin_s)
        self._keepalive = asyncio.create_task(self._keep_alive(term), name=f"election-{self.name}")
        log.info("elected leader of %s", self.name, extra={"replica": self.replica_id, "lease": f"{lease:x}"})
        return term

    async def _wait_vacant(self, current: ElectionRecord) -> None:
        """Waits for the leader key to go (watched), or half a TTL at most."""

        async def deleted() -> None:
            key = self.store.keys.election(self.name)
            async for batch in self.store.watch_prefix(key, current.revision + 1):
                if any(ev.key == key and ev.deleted for ev in batch):
                    return

        with contextlib.suppress(TimeoutError, StoreUnavailable):
            async with asyncio.timeout(self.ttl_s / 2):
                await deleted()

    async def _keep_alive(self, term: Term) -> None:
        interval = max(0.2, term.ttl_s / 3)
        pause = interval
        try:
            while not term.lost.is_set():
                wake = min(time.monotonic() + pause, term.valid_until)
                await asyncio.sleep(max(0.0, wake - time.monotonic()))  # next keep-alive or the deadline
                if time.monotonic() >= term.valid_until:
                    log.error("election %s: lease could not be renewed in time; standing down", self.name)
                    break
                sent = time.monotonic()
                try:
                    ttl = await self.store.refresh_lease(term.lease)
                except NotFound:
                    log.error("election %s: lease expired; standing down", self.name)
                    break
                except StoreUnavailable as exc:
                    log.warning("election %s: keep-alive failed: %s", self.name, exc)
                    pause = min(interval, 0.25)  # retry soon: the deadline is running
                    continue
                except Exception:
                    # Whatever broke (a closed channel at shutdown), not
                    # knowing the lease is alive means standing down.
                    log.exception("election %s: keep-alive broke; standing down", self.name)
                    break
                term.valid_until = sent + ttl - self.safety_margin_s
                pause = interval
        finally:
            term.lost.set()

    async def stop(self, term: Term | None) -> None:
        """Stops campaigning; resigns `term` if there is one, else frees the keep-alive."""
        if term is not None:
            await self.resign(term)
        elif self._keepalive is not None:
            self._keepalive.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keepalive
            self._keepalive = None

    async def resign(self, term: Term) -> None:
        """Ends the term now and frees the key so a standby takes over at once."""
        term.lost.set()
        if self._keepalive is not None:
            self._keepalive.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keepalive
            self._keepalive = None
        await self._revoke(term.lease)

    async def _revoke(self, lease: int) -> None:
        try:
            await self.store.revoke_lease(lease)
        except StoreUnavailable as exc:
            log.warning("election %s: could not revoke lease %x: %s", self.name, lease, exc)
