"""Stopping is never held up by trace export: an unreachable collector costs at most the bound."""

from __future__ import annotations

import time

from kvplane.services.common.runtime.ports import free_port
from kvplane.services.common.runtime.telemetry import Telemetry


def test_shutdown_with_an_unreachable_collector_returns_within_its_bound() -> None:
    # Nothing listens there: the exporter would retry for its whole ten-second timeout.
    telemetry = Telemetry.create("kvplane-test", otlp_endpoint=f"127.0.0.1:{free_port()}")
    for i in range(20):
        with telemetry.tracer.start_as_current_span(f"turn-{i}"):
            pass

    start = time.monotonic()
    telemetry.shutdown(timeout_s=1.0)
    took = time.monotonic() - start

    assert took < 4.0, f"shutdown took {took:.1f} s"
    telemetry.shutdown(timeout_s=1.0)  # a second stop (atexit's) returns at once too
    assert time.monotonic() - start < 5.0
