"""How fast this machine runs Python now: a gauge recorded beside every live comparison.

The live comparison's ratios are paired within one run, but its absolute figures (TTFT, CPU per
turn) move with the machine: on a shared or throttled host the same run can cost every process
twice the CPU it cost on another day. Each record carries the time of one step of a fixed pure-
Python loop, so that two records can be told apart by the machine they ran on before their
figures are compared.
"""

from __future__ import annotations

import functools
import statistics
import time

_STEPS = 2_000_000
_TRIES = 3


@functools.cache
def python_loop_ns() -> float:
    """Nanoseconds per step of a fixed Python loop (the median of three tries, measured once per
    process)."""
    times = []
    for _ in range(_TRIES):
        start = time.perf_counter()
        total = 0
        for i in range(_STEPS):
            total += i
        times.append(time.perf_counter() - start)
    return statistics.median(times) / _STEPS * 1e9
