"""Services run on the event loop their settings name."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from kvplane.services.common.runtime import event_loop


async def _loop_type() -> type:
    return type(asyncio.get_running_loop())


@pytest.mark.parametrize(("name", "expected"), [("uvloop", uvloop.Loop), ("asyncio", asyncio.BaseEventLoop)])
def test_the_named_loop_runs_the_coroutine(name: event_loop.EventLoop, expected: type) -> None:
    ran = event_loop.run(_loop_type(), name)
    assert issubclass(ran, expected)
    assert (name == "uvloop") == issubclass(ran, uvloop.Loop)
