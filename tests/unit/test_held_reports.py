"""The routing client's held reports: per replica, at most a batch at a time, a failed call's put
back ahead of newer ones, and sent within the bound when no Route takes them."""

from __future__ import annotations

import asyncio
import time

from kvplane.services.client.held_reports import MAX_BATCH, HeldReports
from kvplane.v1 import routing_pb2


def _report(n: int) -> routing_pb2.ReportTurnRequest:
    return routing_pb2.ReportTurnRequest(route_id=f"r{n}", conversation=f"c{n}", success=True)


class _Sends:
    def __init__(self) -> None:
        self.calls = 0

    async def __call__(self) -> None:
        self.calls += 1


async def test_reports_are_held_per_replica_and_taken_a_batch_at_a_time() -> None:
    sends = _Sends()
    held = HeldReports(2, 3600, sends)
    for n in range(3):
        held.hold(1, _report(n))
    assert held.take(0) == [] and held.replicas_holding() == [1]
    assert [r.route_id for r in held.take(1)] == ["r0", "r1", "r2"] and len(held) == 0
    await held.close()
    assert sends.calls == 0, "nothing sent before the bound"


async def test_a_failed_calls_reports_go_back_ahead_of_newer_ones() -> None:
    held = HeldReports(1, 3600, _Sends())
    held.hold(0, _report(0))
    taken = held.take(0)
    held.hold(0, _report(1))
    held.put_back(0, taken)
    assert [r.route_id for r in held.take(0)] == ["r0", "r1"]
    await held.close()


async def test_a_full_batch_is_sent_at_once_and_the_rest_within_the_bound() -> None:
    sends = _Sends()
    held = HeldReports(1, 3600, sends)
    for n in range(MAX_BATCH):
        held.hold(0, _report(n))
    await asyncio.sleep(0)  # the send runs as a task
    assert sends.calls == 1
    assert len(held.take(0)) == MAX_BATCH, "a batch is no more than one call carries"
    await held.close()

    soon = _Sends()
    held = HeldReports(1, 0.05, soon)
    held.hold(0, _report(0))
    deadline = time.monotonic() + 10
    while not soon.calls:
        assert time.monotonic() < deadline, "held past the bound"
        await asyncio.sleep(0.01)  # polling with a deadline
    await held.close()
