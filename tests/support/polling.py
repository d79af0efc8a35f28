"""Waiting on conditions with deadlines, never fixed sleeps."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def eventually(
    probe: Callable[[], Awaitable[T]],
    *,
    timeout_s: float = 10.0,
    interval_s: float = 0.05,
    what: str = "condition",
) -> T:
    """Awaits `probe()` until it returns a truthy value; fails after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last: T | None = None
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            last = await probe()
            if last:
                return last
        except Exception as exc:  # the probe may fail until the condition holds
            last_error = exc
        await asyncio.sleep(interval_s)  # poll interval
    raise AssertionError(
        f"timed out after {timeout_s}s waiting for {what}; last={last!r} error={last_error!r}"
    )


async def until(predicate: Callable[[], bool], what: str, *, timeout_s: float = 10.0) -> None:
    """`eventually` for a plain condition: polls `predicate()` until it holds, or fails."""

    async def probe() -> bool:
        return predicate()

    await eventually(probe, timeout_s=timeout_s, interval_s=0.01, what=what)
