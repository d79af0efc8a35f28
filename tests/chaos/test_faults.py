"""The chaos suite: every process of a small fleet killed in turn under a steady multi-turn
load, etcd's leader killed and all of etcd stopped, an engine cut off from the control plane,
a service frozen, clients that hang up at moments spread over a turn. It prints the fault table
and fails on any breach of the targets:

- no failed turn, other than streams in flight on the killed gateway or engine;
- while one of the two routing replicas is dead, the other routes, and turns still pull;
- a turn served within 1 s of every fault (the first turn that arrives after it takes at most
  1 s longer than a median turn without faults);
- while etcd is faulted, no turn more than 2 s slower than the slowest turn without faults;
- after every fault, once settled: no block an engine retains that nothing references, no
  handle whose blocks are gone, no claim past its deadline.

Run: .venv/bin/pytest -q -m chaos tests/chaos -s   (about 6 minutes on 2 cores)
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from kvplane.services.common.store import Store
from tests.chaos.cluster import CLAIM_DEADLINE_S, ChaosCluster, start_cluster
from tests.chaos.ledger import Ledger, settled_ledger
from tests.chaos.load import Load, TurnRecord

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(1200)]

SETTLE_S = 8.0
LEDGER_TIMEOUT_S = 30.0
# A turn must be answered within this long of a fault.
FIRST_TURN_WITHIN_S = 1.0
# While etcd is faulted no turn may take longer than this beyond the slowest baseline turn, s.
# It is also the first-turn bound when etcd's leader is killed: a turn that pulls needs one write
# (its check-out), and the remaining members elect a leader only after their election timeout,
# which etcd draws between 1 s and 2 s (the default 1,000 ms, randomised up to twice that).
ETCD_EXTRA_S = 2.0
# How long one routing replica stays dead: long enough for whole turns to run meanwhile. Turns
# take about 3 s, so 6 s held only 4-5 whole turns, and whether one of so few pulled was chance.
ROUTING_DOWN_S = 12.0
ROUTING_DOWN = f"SIGKILL routing (1 of 2) {ROUTING_DOWN_S:.0f} s"


@dataclass
class Row:
    fault: str
    sent: int
    failed: int
    excused: int
    slowest_s: float
    first_turn_s: float
    first_pull_s: float
    ledger: Ledger
    errors: list[str]

    def line(self) -> str:
        return (
            f"| {self.fault:<28} | {self.sent:>5} | {self.failed:>6} | {self.excused:>7} "
            f"| {self.slowest_s:>7.2f} | {self.first_turn_s:>10.2f} | {self.first_pull_s:>10.2f} "
            f"| {self.ledger.orphaned:>8} | {self.ledger.dangling:>8} | {self.ledger.stranded_claims:>8} |"
        )


HEADER = (
    "| fault                        | turns | failed | excused | slowest | first turn+ | first pull "
    "| orphaned | dangling | stranded |\n"
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


@pytest.fixture(scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[ChaosCluster]:
    c = await start_cluster(Path(tmp_path_factory.mktemp("chaos")))
    try:
        yield c
    finally:
        await c.stop()


async def _restart(cluster: ChaosCluster, name: str, after_s: float) -> None:
    await asyncio.sleep(after_s)  # how long the process stays dead
    await cluster.procs[name].start(120)


def _kill_and_restart(name: str, dead_s: float = 1.0) -> Callable[[ChaosCluster], Awaitable[set[int] | None]]:
    async def fault(cluster: ChaosCluster) -> set[int] | None:
        cluster.procs[name].kill()
        await _restart(cluster, name, dead_s)
        kind = cluster.procs[name].kind
        if kind == "gateway":
            return {int(name == "gateway-b")}  # streams on this gateway may fail
        return set(range(2)) if kind == "engine" else set()

    return fault


async def _etcd_leader(cluster: ChaosCluster) -> set[int] | None:
    leader = cluster.etcd.leader()
    cluster.etcd.members[leader].kill()
    await asyncio.sleep(2.0)  # the leader stays dead
    await asyncio.to_thread(cluster.etcd.members[leader].start)
    return set()


async def _etcd_stopped(cluster: ChaosCluster) -> set[int] | None:
    for member in cluster.etcd.members:
        member.kill()
    await asyncio.sleep(10.0)  # all of etcd is gone this long
    for member in cluster.etcd.members:
        member.launch()
    await asyncio.to_thread(lambda: [m.wait_healthy(60) for m in cluster.etcd.members])
    return set()


async def _partition_engine(cluster: ChaosCluster) -> set[int] | None:
    assert cluster.proxy is not None and cluster.eviction_proxy is not None
    cluster.proxy.partition()
    cluster.eviction_proxy.partition()
    await asyncio.sleep(10.0)  # d1 cut off from the control plane this long
    cluster.proxy.mend()
    cluster.eviction_proxy.mend()
    return set()


async def _freeze_routing(cluster: ChaosCluster) -> set[int] | None:
    cluster.procs["routing"].freeze()
    await asyncio.sleep(5.0)  # frozen this long
    cluster.procs["routing"].thaw()
    return set()


# When, after its turn is sent, each client goes away: before Route, during P's leg (a pull's claim
# is held while P reads D's blocks), as D starts streaming, and mid-stream.
HANG_UP_AFTER_S = (0.0, 0.05, 0.15, 0.3, 0.6, 1.0, 1.5, 2.0)


async def _clients_hang_up(cluster: ChaosCluster) -> set[int] | None:
    """Second turns (pulls of a 3,000-token history) whose clients go away at `HANG_UP_AFTER_S`;
    then the claim deadline passes, so that the ledger counts whatever they left held."""
    callers = Load(cluster.gateway_urls)
    rng = random.Random(99)
    timeout = aiohttp.ClientTimeout(total=60, sock_read=20)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one(i: int, after_s: float) -> bool:
            conversation = f"hang-up-{i}-{uuid.uuid4().hex[:8]}"
            prompt = [rng.randrange(1000, 30000) for _ in range(3000)]
            output = await callers.turn(session, conversation, prompt, i)
            assert output, f"the first turn of {conversation} failed: {callers.records[-1].error}"
            later = prompt + output + [rng.randrange(1000, 30000) for _ in range(40)]
            second = asyncio.create_task(callers.turn(session, conversation, later, i))
            await asyncio.sleep(after_s)  # the moment this client goes away
            hung_up = not second.done()
            second.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await second
            return hung_up

        hung_up = await asyncio.gather(*(one(i, s) for i, s in enumerate(HANG_UP_AFTER_S)))
    assert sum(hung_up) >= len(HANG_UP_AFTER_S) - 1, f"turns ended before their clients left: {hung_up}"
    store = cluster.store()
    await store.connect()
    try:
        _, claims = await store.read_prefix(store.keys.all_claims_prefix())
    finally:
        await store.close()
    print(f"clients hung up: {sum(hung_up)} turns; claims held just after: {len(claims)}", flush=True)
    # Nothing the abandoned turns held may outlive the claim deadline: it passes, and the sweep after
    # it, before the ledger is taken (a claim older than the deadline + 5 s counts as stranded).
    await asyncio.sleep(CLAIM_DEADLINE_S + 6.0)
    return set()


FAULTS: list[tuple[str, Callable[[ChaosCluster], Awaitable[set[int] | None]]]] = [
    ("SIGKILL metadata", _kill_and_restart("metadata")),
    (ROUTING_DOWN, _kill_and_restart("routing", ROUTING_DOWN_S)),
    ("SIGKILL eviction", _kill_and_restart("eviction")),
    ("SIGKILL gateway-a", _kill_and_restart("gateway-a")),
    ("SIGKILL prefill p0", _kill_and_restart("p0")),
    ("SIGKILL decode d0", _kill_and_restart("d0")),
    ("SIGKILL etcd leader", _etcd_leader),
    ("etcd stopped 10 s", _etcd_stopped),
    ("d1 cut from control plane", _partition_engine),
    ("SIGSTOP routing (1 of 2) 5 s", _freeze_routing),
    ("clients hang up mid-turn", _clients_hang_up),
]


def _pulls_while_down(records: list[TurnRecord], start: float) -> tuple[int, int]:
    """Turns that ran wholly while the routing replica was dead, and how many of them pulled."""
    inside = [r for r in records if r.ok and r.start >= start and r.end <= start + ROUTING_DOWN_S]
    return len(inside), sum(r.decision.startswith("pull") for r in inside)


def _row(
    fault: str,
    records: list[TurnRecord],
    start: float,
    end: float,
    excusable: set[int],
    ledger: Ledger,
    turn_s: float,
) -> Row:
    turns = [r for r in records if r.end >= start and r.start < end]
    failed = [r for r in turns if not r.ok]
    # Streams already running on the killed process at the fault may end with an error.
    excused = [r for r in failed if r.start < start + 1.0 and r.gateway in excusable]
    after = [r for r in turns if r.ok and r.end >= start]
    # The extra wait of the first turn that arrived after the fault: how much longer it took than a
    # turn takes without faults. Measured from its own arrival: the closed-loop users may all be
    # mid-turn when the fault lands, and the gap until one of them sends its next turn is no wait.
    arrived = sorted((r for r in after if r.start >= start), key=lambda r: r.start)
    first_turn = max(0.0, arrived[0].seconds - turn_s) if arrived else end - start
    pulls = [r for r in after if r.decision.startswith("pull")]
    first_pull = min((r.end for r in pulls), default=float("nan")) - start
    return Row(
        fault,
        len(turns),
        len(failed) - len(excused),
        len(excused),
        max((r.seconds for r in turns), default=0.0),
        first_turn,
        first_pull,
        ledger,
        [r.error for r in failed if r not in excused][:3],
    )


async def test_faults_under_load_fail_no_turn_and_strand_nothing(cluster: ChaosCluster) -> None:
    load = Load(cluster.gateway_urls)
    stop = asyncio.Event()
    runner = asyncio.create_task(load.run(stop))
    store: Store = cluster.store()
    await store.connect()
    rows: list[Row] = []
    down_turns = down_pulls = 0
    try:
        async with aiohttp.ClientSession() as session:
            start = time.monotonic()
            await asyncio.sleep(SETTLE_S)  # the load warms up: conversations start pulling
            ledger = await settled_ledger(cluster, store, session, LEDGER_TIMEOUT_S)
            durations = sorted(r.seconds for r in load.records if r.ok)
            assert durations, "no turn succeeded before any fault"
            turn_s = durations[len(durations) // 2]
            baseline = _row("none (baseline)", load.records, start, time.monotonic(), set(), ledger, turn_s)
            baseline.first_turn_s = 0.0  # no fault: the load itself was starting
            rows.append(baseline)
            for name, fault in FAULTS:
                start = time.monotonic()
                excusable = await fault(cluster) or set()
                await asyncio.sleep(SETTLE_S)  # the load carries on after recovery
                end = time.monotonic()
                ledger = await settled_ledger(cluster, store, session, LEDGER_TIMEOUT_S)
                rows.append(_row(name, load.records, start, end, excusable, ledger, turn_s))
                print(rows[-1].line(), flush=True)
                if name == ROUTING_DOWN:
                    down_turns, down_pulls = _pulls_while_down(load.records, start)
                    print(f"one routing replica dead: {down_turns} turns, {down_pulls} pulled", flush=True)
    finally:
        stop.set()
        await asyncio.wait_for(runner, 90)
        await store.close()
    table = "\n".join([HEADER, *(row.line() for row in rows)])
    print("\nFault table (seconds; turns counted by when they ran):\n" + table, flush=True)
    breaches = []
    if down_pulls == 0:
        breaches.append(
            f"{ROUTING_DOWN}: no turn pulled while the other replica routed ({down_turns} turns ran)"
        )
    baseline = rows[0]
    if baseline.first_pull_s != baseline.first_pull_s:  # NaN: no turn pulled
        breaches.append("the baseline load never pulled: the checks below would prove nothing")
    for row in rows:
        if (
            row.fault.startswith(("SIGKILL etcd", "etcd"))
            and row.slowest_s > ETCD_EXTRA_S + baseline.slowest_s
        ):
            # Recompute instead of waiting on etcd: at most 2 s over a turn's own time.
            breaches.append(f"{row.fault}: slowest turn {row.slowest_s:.2f} s")
        if row.failed:
            breaches.append(f"{row.fault}: {row.failed} failed turns: {row.errors}")
        first_within = ETCD_EXTRA_S if row.fault.startswith("SIGKILL etcd") else FIRST_TURN_WITHIN_S
        if row.first_turn_s > first_within:
            breaches.append(f"{row.fault}: the first turn after it took {row.first_turn_s:.2f} s extra")
        if not row.ledger.clean:
            breaches.append(f"{row.fault}: {row.ledger}")
    assert not breaches, "\n".join(breaches) + "\n" + table
