"""Trace and span ids from a generator of the process's own.

OpenTelemetry's default (`RandomIdGenerator`) draws from the `random` module: any code that seeds
that module (a library, a test framework) would make the process's trace ids repeat, and those
of every replica seeded alike collide. kvplane's tracer providers draw from an OS-seeded
`random.Random` of their own instead, as `ports.free_port` does.
"""

from __future__ import annotations

import random

from opentelemetry import trace
from opentelemetry.sdk.trace.id_generator import IdGenerator


class OwnRandomIdGenerator(IdGenerator):
    def __init__(self) -> None:
        self._rng = random.Random()

    def generate_span_id(self) -> int:
        span_id = self._rng.getrandbits(64)
        while span_id == trace.INVALID_SPAN_ID:
            span_id = self._rng.getrandbits(64)
        return span_id

    def generate_trace_id(self) -> int:
        trace_id = self._rng.getrandbits(128)
        while trace_id == trace.INVALID_TRACE_ID:
            trace_id = self._rng.getrandbits(128)
        return trace_id

    def is_trace_id_random(self) -> bool:
        return True
