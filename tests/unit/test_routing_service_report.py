"""ReportTurn's request read as a TurnReport: a field the caller left unset stays unknown."""

from __future__ import annotations

from kvplane.services.routing.service import _turn_report
from kvplane.v1 import routing_pb2


def test_ps_measured_wait_is_read_as_said_and_unset_as_unknown() -> None:
    said = routing_pb2.ReportTurnRequest(route_id="r", success=True, prefill_ms=900.0, prefill_queued_ms=12.5)
    assert _turn_report(said).prefill_queued_ms == 12.5
    # P said it did not wait at all: a measurement, not a missing one.
    idle = routing_pb2.ReportTurnRequest(route_id="r", success=True, prefill_ms=900.0, prefill_queued_ms=0.0)
    assert _turn_report(idle).prefill_queued_ms == 0.0
    unsaid = routing_pb2.ReportTurnRequest(route_id="r", success=True, prefill_ms=900.0)
    assert _turn_report(unsaid).prefill_queued_ms is None
