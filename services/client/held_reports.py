"""Turn reports held back to ride on the next Route to their replica, or in one ReportTurns.

A ReportTurn of its own costs each side a gRPC call per turn. A held report instead goes with
the next Route sent to the replica that routed its turn (a conversation's next turn goes to the
same home replica, so its report is applied before that turn is decided), or, if no Route
goes there within `within_s`, in one ReportTurns call with the others held for that replica.

Only reports that are safe to apply twice may be held: a Route may be hedged, and the carried
reports of a call that failed are held again. A success report whose D announced its own handle
is such a report: a replica learns from a route once (a second copy finds the route reported),
and its handle work only reads the view. The caller chooses (`RoutingClient.hold_report`).

A ReportTurns carries many turns' reports, so it is no one turn's child: its timer runs in a
context of its own, and its span starts a trace of its own. Runs on the caller's event loop
only; no locks.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable

from kvplane.v1 import routing_pb2

# Most reports one Route or one ReportTurns carries (routing.proto).
MAX_BATCH = 64

Report = routing_pb2.ReportTurnRequest


class HeldReports:
    """Reports held per replica index, and the timer that sends what no Route took."""

    def __init__(self, replicas: int, within_s: float, send: Callable[[], Awaitable[object]]) -> None:
        """`send`: sends every replica's held reports (ReportTurns); called when `within_s`
        has passed since the oldest report still held."""
        if within_s <= 0:
            raise ValueError("within_s must be positive")
        self.within_s = within_s
        self._send = send
        self._held: list[list[Report]] = [[] for _ in range(replicas)]
        self._timer: asyncio.TimerHandle | None = None
        self._sending: set[asyncio.Future[object]] = set()

    def __len__(self) -> int:
        return sum(len(queue) for queue in self._held)

    def hold(self, replica: int, report: Report) -> None:
        """Holds `report` for `replica`; sends at once when a batch is full, else arms the timer."""
        self._held[replica].append(report)
        if len(self._held[replica]) >= MAX_BATCH:
            self._fire()
        elif self._timer is None:
            self._arm()

    def take(self, replica: int) -> list[Report]:
        """Up to MAX_BATCH of the reports held for `replica`, oldest first, no longer held."""
        queue = self._held[replica]
        taken, self._held[replica] = queue[:MAX_BATCH], queue[MAX_BATCH:]
        return taken

    def put_back(self, replica: int, reports: list[Report]) -> None:
        """Holds again reports whose call failed, ahead of the ones held since."""
        if reports:
            self._held[replica][:0] = reports
            if self._timer is None:
                self._arm()

    def replicas_holding(self) -> list[int]:
        return [i for i, queue in enumerate(self._held) if queue]

    def _arm(self) -> None:
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self.within_s, self._fire, context=contextvars.Context())

    def _fire(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        task = asyncio.ensure_future(self._send())
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def close(self) -> None:
        """Stops the timer; sends still under way are awaited (what is still held is dropped)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._sending:
            await asyncio.gather(*self._sending, return_exceptions=True)
