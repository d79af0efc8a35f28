"""A wake-up the engine's threads give one of the agent's jobs: an `asyncio.Event` on the agent's
loop, set from any thread (the demand and load reporters each keep one)."""

from __future__ import annotations

import asyncio
import contextlib


class ThreadWake:
    """An event on the agent's loop that any thread may set; none while the loop is down."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self.event: asyncio.Event | None = None

    def attach(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """The agent's loop started (or, with None, stopped)."""
        self._loop = loop
        self.event = asyncio.Event() if loop is not None else None

    def set(self) -> None:
        """Wakes the job waiting on the event. Never blocks; any thread."""
        loop, event = self._loop, self.event
        if loop is None or event is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing to wake
            loop.call_soon_threadsafe(event.set)
