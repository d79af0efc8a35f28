"""The process supervisor of the dev stack, the chaos cluster and the test stacks.

Each child runs in its own session, so its own process group: a Ctrl-C at the terminal reaches
the supervisor only, which then stops the children in its own order, and stopping a child stops
whatever it started too. `wait_ready` polls a child's readiness probe until a deadline and reports
a child that exited meanwhile, with its exit status and the end of its log. Since no signal reaches
the children, `stop_signals_cancel` turns Ctrl-C, SIGTERM and SIGHUP into a cancellation of the
supervising task, whose `finally` blocks stop them; `run_until_stopped` runs a command (a
benchmark, the comparison) that way.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import aiohttp
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

# What stops a supervisor: Ctrl-C, `kill`, and the terminal closing.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

T = TypeVar("T")


@contextlib.contextmanager
def stop_signals_cancel() -> Iterator[None]:
    """Inside: a stop signal cancels the running task, from the first moment (a signal during
    start-up stops what has started too); the task's `finally` blocks stop its children."""
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, task.cancel)
    try:
        yield
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)


async def until_stopped(main: Awaitable[T]) -> T | None:
    """`main`'s result; None if Ctrl-C, SIGTERM or SIGHUP came first (`main` is then cancelled,
    and its `finally` blocks stop whatever it started)."""
    try:
        with stop_signals_cancel():
            return await main
    except asyncio.CancelledError:
        return None


def run_until_stopped(main: Coroutine[Any, Any, T]) -> T | None:
    """`asyncio.run(main)`, stopped as a supervisor is (`until_stopped`)."""
    return asyncio.run(until_stopped(main))


def stopped() -> int:
    """Says on stderr that a command was stopped before its end, and gives its exit status."""
    print("stopped: every process it started is stopped; no results", file=sys.stderr)
    return 1


class StartupError(RuntimeError):
    """A process of the stack did not come up."""


@dataclass
class ManagedProcess:
    """One child process in its own process group, with its log file (appended to across restarts)."""

    name: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    # The working directory, when not the supervisor's.
    cwd: Path | None = None
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        log = self.log_path.open("ab")
        try:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self.env},
                cwd=self.cwd,
                start_new_session=True,
            )
        finally:
            log.close()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError(f"{self.name} was never started")
        return self.proc.pid

    def exit_status(self) -> str:
        """How the child ended ("exit status 3", "killed by SIGKILL"), or "running"."""
        code = None if self.proc is None else self.proc.poll()
        if code is None:
            return "running" if self.proc is not None else "not started"
        if code < 0:
            return f"killed by {signal.Signals(-code).name}"
        return f"exit status {code}"

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except FileNotFoundError:
            return ""

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout_s`; whatever else of its group is left, SIGKILL."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.proc.wait()
        # Children it started (a shell's, a server's workers) outlive it unless stopped too.
        self._signal_group(signal.SIGKILL)

    def restart(self, timeout_s: float = 10.0) -> None:
        self.stop(timeout_s)
        self.start()

    def kill(self) -> None:
        """SIGKILL to the whole group at once: no graceful shutdown."""
        if self.alive():
            self._signal_group(signal.SIGKILL)
            assert self.proc is not None
            self.proc.wait()

    def freeze(self) -> None:
        self._signal_group(signal.SIGSTOP)

    def thaw(self) -> None:
        self._signal_group(signal.SIGCONT)

    def _signal_group(self, sig: signal.Signals) -> None:
        if self.proc is not None:
            # The group is gone once its last member is: nothing to signal.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)


class Watched(Protocol):
    """What `wait_ready` needs of a process: whether it lives, how it ended, and what it said."""

    @property
    def name(self) -> str: ...

    def alive(self) -> bool: ...

    def exit_status(self) -> str: ...

    def log_tail(self, chars: int = ...) -> str: ...


async def wait_ready(proc: Watched, probe: Callable[[], Awaitable[bool]], timeout_s: float) -> None:
    """Until `probe()` is true; StartupError if `proc` exits first or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not proc.alive():
            raise StartupError(
                f"{proc.name} exited during start-up ({proc.exit_status()}):\n{proc.log_tail()}"
            )
        try:
            if await probe():
                return
        except Exception:
            # Not ready yet. But a cancelled task's cancellation is handed to the future it awaits,
            # and grpc.aio's call task swallows it when its call has just ended, raising the call's
            # status instead: a Ctrl-C during start-up would be lost here, and start-up go on.
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise asyncio.CancelledError from None
        await asyncio.sleep(0.1)  # polling readiness until the deadline
    raise StartupError(f"{proc.name} was not ready after {timeout_s:.0f}s:\n{proc.log_tail()}")


def grpc_health_probe(target: str) -> Callable[[], Awaitable[bool]]:
    async def probe() -> bool:
        async with grpc.aio.insecure_channel(target) as channel:
            resp = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
            return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)

    return probe


def http_health_probe(url: str) -> Callable[[], Awaitable[bool]]:
    async def probe() -> bool:
        async with (
            aiohttp.ClientSession() as session,
            session.get(url, timeout=aiohttp.ClientTimeout(total=1)) as r,
        ):
            return r.status == 200

    return probe
