"""Workloads for the simulator and benchmarks: each yields `Turn`s in arrival order.

- `agentic`: a seeded synthetic generator of agentic sessions;
- `mooncake`: conversations recovered from a Mooncake-format trace.
"""

from kvplane.bench.workloads.agentic import AgenticWorkload, agentic_turns
from kvplane.bench.workloads.mooncake import (
    DEFAULT_TRACE,
    TraceError,
    TraceFormat,
    TraceStatistics,
    conversation_turns,
    mooncake_turns,
    read_requests,
    trace_statistics,
)
from kvplane.bench.workloads.turns import Turn

__all__ = [
    "DEFAULT_TRACE",
    "AgenticWorkload",
    "TraceError",
    "TraceFormat",
    "TraceStatistics",
    "Turn",
    "agentic_turns",
    "conversation_turns",
    "mooncake_turns",
    "read_requests",
    "trace_statistics",
]
