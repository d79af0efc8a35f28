"""The race: check-outs and releases of the same handles, 1,000 times over.

Each round publishes a handle, then lets a router's check-out (sometimes two)
and the coordinator's release go at it concurrently, each working from the
record it read, with random jitter so the interleavings differ. A history of
every attempt is recorded and checked afterwards:

- per handle, at most one attempt succeeded (and, since every contender
  started from the same retained record, exactly one);
- the release commands the node received are exactly the releases that won,
  and none is for a handle that was checked out.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
from collections import defaultdict
from dataclasses import dataclass

from kvplane.services.common.model.errors import HandleNotRetained, NotFound
from kvplane.services.common.model.handles import ReleaseReason
from kvplane.services.common.store import Store
from kvplane.services.common.store.records import HandleRecord
from kvplane.services.dev.local_etcd import LocalEtcd
from tests.conftest import make_node
from tests.support.eviction_nodes import CommandNode, start_replica, target_of
from tests.support.factories import make_handle
from tests.support.polling import eventually

ROUNDS = 1000
CONVERSATIONS = 50


@dataclass(frozen=True)
class Attempt:
    handle_id: str
    op: str  # "check_out" | "release"
    ok: bool
    started: float
    ended: float


def check_history(history: list[Attempt], handles: set[str]) -> dict[str, Attempt]:
    """Fails on any handle that two attempts won; returns each handle's winner."""
    by_handle: dict[str, list[Attempt]] = defaultdict(list)
    for a in history:
        by_handle[a.handle_id].append(a)
    winners: dict[str, Attempt] = {}
    for handle_id in handles:
        won = [a for a in by_handle[handle_id] if a.ok]
        assert len(won) <= 1, f"handle {handle_id} was won twice: {won}"
        assert len(won) == 1, f"handle {handle_id}: every contender lost: {by_handle[handle_id]}"
        winners[handle_id] = won[0]
    return winners


async def test_check_out_and_release_never_both_succeed(etcd: LocalEtcd, prefix: str, store: Store) -> None:
    node = make_node("d0")
    await store.register_node(node, 60)
    replica = await start_replica(etcd, prefix, policy={"policies": []})
    agent = CommandNode(node.node_id, node.incarnation, [target_of(replica)])
    agent.start()
    history: list[Attempt] = []
    handles: set[str] = set()
    rng = random.Random(20261129)

    async def attempt(op: str, record: HandleRecord, jitter_s: float) -> None:
        await asyncio.sleep(jitter_s)  # jitter: vary which transaction reaches etcd first
        h = record.handle
        started = time.monotonic()
        try:
            if op == "release":
                await store.release(
                    h.tenant, h.conversation, ReleaseReason.LOW_VALUE, handle_id=h.handle_id, expected=record
                )
            else:
                await store.check_out(h.tenant, h.conversation, handle_id=h.handle_id, expected=record)
            ok = True
        except (HandleNotRetained, NotFound):
            ok = False
        history.append(Attempt(h.handle_id, op, ok, started, time.monotonic()))

    async def conversation(c: int, rounds: int) -> None:
        for r in range(rounds):
            outcome = await store.publish_handle(
                make_handle(node, "acme", f"race-{c}", request_id=f"req-{c}-{r}")
            )
            record = await store.get_handle_record("acme", f"race-{c}")
            assert record is not None and record.handle.handle_id == outcome.handle.handle_id
            handles.add(record.handle.handle_id)
            ops = ["release", "check_out"] + (["check_out"] if rng.random() < 0.3 else [])
            await asyncio.gather(*(attempt(op, record, rng.random() * 0.002) for op in ops))

    try:
        await eventually(lambda: _true(agent.connected), what="the node's stream")
        await asyncio.gather(*(conversation(c, ROUNDS // CONVERSATIONS) for c in range(CONVERSATIONS)))
        assert len(handles) == ROUNDS
        winners = check_history(history, handles)
        released = {h for h, a in winners.items() if a.op == "release"}
        checked_out = {h for h, a in winners.items() if a.op == "check_out"}
        # Both sides won sometimes, or the race was not exercised.
        assert released and checked_out
        await eventually(
            lambda: _true(set(agent.released_handles) == released), what="every won release delivered"
        )
        assert not set(agent.released_handles) & checked_out
        assert set(agent.released_handles.values()) == {1}
        await eventually(lambda: _empty(store.pending_releases(node.node_id)), what="the outbox to empty")
    finally:
        await agent.stop()
        await replica.stop()


def test_the_history_checker_catches_a_double_win() -> None:
    history = [Attempt("h1", "release", True, 0, 1), Attempt("h1", "check_out", True, 0.5, 1.5)]
    try:
        check_history(history, {"h1"})
    except AssertionError:
        return
    raise AssertionError("a handle won twice went unnoticed")


async def _true(value: bool) -> bool:
    return value


async def _empty(awaitable) -> bool:  # type: ignore[no-untyped-def]
    return not await awaitable


async def test_routes_racing_the_coordinators_own_releases_never_both_win(
    etcd: LocalEtcd, prefix: str, store: Store
) -> None:
    """End to end: the leader's policy loop releases handles (past max age)
    while routes check the same handles out. Every handle ends with exactly one
    winner: a successful check-out, or a release command at the node."""
    node = make_node("d0")
    await store.register_node(node, 60)
    replica = await start_replica(
        etcd, prefix, policy={"policies": [{"name": "max_age", "engine_ttl_s": 480, "margin_s": 30}]}
    )
    agent = CommandNode(node.node_id, node.incarnation, [target_of(replica)])
    agent.start()
    rng = random.Random(7)
    history: list[Attempt] = []
    handles: set[str] = set()
    sem = asyncio.Semaphore(CONVERSATIONS)

    async def one(i: int) -> None:
        async with sem:
            aged = make_handle(node, "acme", f"aged-{i}", life_ms=600_000)
            aged = dataclasses.replace(aged, published_unix_ms=int(time.time() * 1000) - 460_000)
            outcome = await store.publish_handle(aged)
            handle_id = outcome.handle.handle_id
            handles.add(handle_id)
            await asyncio.sleep(rng.random() * 0.15)  # jitter against the leader's next round
            started = time.monotonic()
            try:
                await store.check_out("acme", f"aged-{i}", handle_id=handle_id)
                ok = True
            except (HandleNotRetained, NotFound):
                ok = False
            history.append(Attempt(handle_id, "check_out", ok, started, time.monotonic()))

    try:
        await eventually(lambda: _true(agent.connected), what="the node's stream")
        await asyncio.gather(*(one(i) for i in range(ROUNDS)))
        checked_out = {a.handle_id for a in history if a.ok}
        lost = handles - checked_out
        # Every check-out that lost, lost to a release, which reaches the node.
        await eventually(
            lambda: _true(set(agent.released_handles) >= lost), timeout_s=30, what="the releases that won"
        )
        released = set(agent.released_handles)
        assert not released & checked_out, f"released and checked out: {sorted(released & checked_out)[:5]}"
        assert released | checked_out == handles
        assert set(agent.released_handles.values()) == {1}
        assert released and checked_out, "one side never won: the race was not exercised"
        print(f"{len(checked_out)} check-outs won, {len(released)} releases won")
    finally:
        await agent.stop()
        await replica.stop()
