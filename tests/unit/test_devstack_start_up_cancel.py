"""A Ctrl-C during the dev stack's start-up stops it, even when a readiness probe swallows the
cancellation into an error, as grpc.aio's call task does when its call has just ended."""

from __future__ import annotations

import asyncio

import pytest

from kvplane.services.devstack.processes import wait_ready


class AliveProcess:
    name = "services"

    def alive(self) -> bool:
        return True

    def exit_status(self) -> str:
        return "running"

    def log_tail(self, chars: int = 3000) -> str:
        return ""


async def test_a_cancelled_wait_stops_though_the_probe_turned_the_cancellation_into_an_error() -> None:
    probing = asyncio.Event()

    async def probe() -> bool:
        async def call() -> str:
            probing.set()
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                return "ended"  # the cancellation handed to this task goes no further
            return "answered"

        status = await asyncio.create_task(call())
        raise RuntimeError(f"UNAVAILABLE ({status})")

    waiting = asyncio.create_task(wait_ready(AliveProcess(), probe, 60))
    await asyncio.wait_for(probing.wait(), 10)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(waiting, 10)
