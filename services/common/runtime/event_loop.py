"""Runs a service's main coroutine on the event loop its settings name: uvloop (the default, whose
transports write and read in C: a stream relay spends most of its CPU there) or asyncio's own."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, Literal, TypeVar

import uvloop

T = TypeVar("T")
EventLoop = Literal["uvloop", "asyncio"]


def run(main: Coroutine[Any, Any, T], event_loop: EventLoop) -> T:
    if event_loop == "uvloop":
        return uvloop.run(main)
    return asyncio.run(main)
