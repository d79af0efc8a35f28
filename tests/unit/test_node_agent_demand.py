"""The engine's KV demand on the command stream: sent when the engine says it changed, on connect,
and again while it lasts; an ended demand is sent once as zero."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable

import pytest

from kvplane.connector.node_agent.demand import DemandReporter
from kvplane.v1 import eviction_pb2
from tests.unit.node_agent_fakes import plane, until

Stream = asyncio.Queue[eviction_pb2.CommandsRequest | None]


class Demand:
    """What the engine's waiting requests need; `fail` makes the engine's hook raise."""

    def __init__(self) -> None:
        self.blocks = 0
        self.fail = False
        # How often the reporter looked.
        self.looks = 0

    def __call__(self) -> int:
        self.looks += 1
        if self.fail:
            raise RuntimeError("engine busy")
        return self.blocks


def sent(stream: Stream) -> list[int]:
    out: list[int] = []
    while not stream.empty():
        msg = stream.get_nowait()
        assert msg is not None and msg.HasField("demand") and msg.demand.measured_unix_ms > 0
        out.append(msg.demand.blocks)
    return out


@pytest.fixture
async def reporting() -> AsyncIterator[Callable[..., tuple[DemandReporter, Demand, Stream]]]:
    tasks: list[asyncio.Task[None]] = []

    def start(**settings: float) -> tuple[DemandReporter, Demand, Stream]:
        cp, _, _ = plane(**settings)
        demand = Demand()
        reporter = DemandReporter(cp, demand)
        reporter.attach(asyncio.get_running_loop())
        stream: Stream = asyncio.Queue()
        tasks.append(asyncio.create_task(reporter.send(stream)))
        return reporter, demand, stream

    yield start
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def test_no_demand_sends_nothing_and_a_new_one_is_sent_when_the_engine_says_so(
    reporting: Callable[..., tuple[DemandReporter, Demand, Stream]],
) -> None:
    reporter, demand, stream = reporting(demand_refresh_s=3600)
    await until(lambda: demand.looks >= 1, "the first look")
    assert sent(stream) == [] and reporter.reports == 0
    demand.blocks = 12
    # The engine's hook runs on its own thread, not the agent's.
    threading.Thread(target=reporter.notify).start()
    await until(lambda: not stream.empty(), "the demand to be sent on notify, long before the refresh")
    assert sent(stream) == [12] and reporter.reports == 1


async def test_a_demand_at_connect_is_sent_at_once_and_repeated_while_it_lasts(
    reporting: Callable[..., tuple[DemandReporter, Demand, Stream]],
) -> None:
    seen: list[int] = []
    _, demand, stream = reporting(demand_refresh_s=0.01)
    demand.blocks = 7
    await until(lambda: seen.extend(sent(stream)) or len(seen) >= 3, "the lasting demand to be repeated")
    assert set(seen) == {7}


async def test_an_ended_demand_is_sent_once_as_zero(
    reporting: Callable[..., tuple[DemandReporter, Demand, Stream]],
) -> None:
    reporter, demand, stream = reporting(demand_refresh_s=0.01)
    demand.blocks = 5
    await until(lambda: reporter.reports >= 1, "the demand")
    demand.blocks = 0
    reporter.notify()
    seen: list[int] = []
    await until(lambda: seen.extend(sent(stream)) or 0 in seen, "the end of the demand")
    reports, looks = reporter.reports, demand.looks
    await until(lambda: demand.looks >= looks + 3, "three more looks at the demand")
    assert reporter.reports == reports and sent(stream) == []
    assert seen[-1] == 0 and seen.count(0) == 1


async def test_a_failing_or_negative_demand_reads_as_none(
    reporting: Callable[..., tuple[DemandReporter, Demand, Stream]],
) -> None:
    reporter, demand, stream = reporting(demand_refresh_s=0.01)
    demand.blocks = 4
    await until(lambda: reporter.reports >= 1, "the demand")
    demand.fail = True
    seen: list[int] = []
    await until(lambda: seen.extend(sent(stream)) or 0 in seen, "a failing hook to end the demand")
    demand.fail, demand.blocks = False, -3
    reports, looks = reporter.reports, demand.looks
    await until(lambda: demand.looks >= looks + 2, "two more looks at the demand")
    assert reporter.reports == reports, "a negative demand is no demand"


def test_notify_before_the_agents_loop_runs_or_after_it_stopped_is_harmless() -> None:
    reporter = DemandReporter.__new__(DemandReporter)
    DemandReporter.__init__(reporter, None, lambda: 1)  # type: ignore[arg-type]
    reporter.notify()
    loop = asyncio.new_event_loop()
    reporter.attach(loop)
    loop.close()
    reporter.notify()
    reporter.attach(None)
    reporter.notify()
    assert reporter.reports == 0
