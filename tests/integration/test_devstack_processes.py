"""The process supervisor the dev stack, the chaos cluster and the test stacks share: a child starts
in its own process group, is probed until ready, restarts, is reported when it crashes, and stopping
it stops everything in its group."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from kvplane.services.devstack.processes import ManagedProcess, StartupError, wait_ready
from tests.support.polling import eventually


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _running(pid: int) -> bool:
    """Whether `pid` runs (a zombie nobody reaped yet does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]


async def _until(predicate: Callable[[], bool], what: str) -> None:
    async def holds() -> bool:
        return predicate()

    await eventually(holds, timeout_s=30, what=what)


def _read(path: Path) -> str:
    return path.read_text().strip() if path.exists() else ""


async def _file_written(path: Path) -> str:
    await _until(lambda: bool(_read(path)), f"{path.name} written")
    return _read(path)


# A child that starts a grandchild (in its process group), says its pid, and waits.
SPAWNER = """
import subprocess, sys, time
grandchild = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
open(sys.argv[1], "w").write(str(grandchild.pid))
time.sleep(300)
"""


async def test_a_child_runs_in_its_own_process_group_so_a_ctrl_c_reaches_only_the_supervisor(
    tmp_path: Path,
) -> None:
    proc = ManagedProcess("sleeper", _python("import time; time.sleep(300)"), tmp_path / "sleeper.log")
    proc.start()
    try:
        assert os.getpgid(proc.pid) == proc.pid != os.getpgid(0)
    finally:
        proc.stop()
    assert not proc.alive()
    assert proc.exit_status() == "killed by SIGTERM"


async def test_stop_reaps_the_whole_process_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    proc = ManagedProcess("spawner", [*_python(SPAWNER), str(pid_file)], tmp_path / "spawner.log")
    proc.start()
    grandchild = int(await _file_written(pid_file))
    assert _running(grandchild)

    proc.stop(timeout_s=10)

    assert not proc.alive()
    await _until(lambda: not _running(grandchild), "the grandchild stopped")


async def test_a_child_that_ignores_sigterm_is_killed_after_the_timeout(tmp_path: Path) -> None:
    ready = tmp_path / "ready"
    code = (
        "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "open(sys.argv[1], 'w').write('1'); time.sleep(300)"
    )
    proc = ManagedProcess("stubborn", [*_python(code), str(ready)], tmp_path / "stubborn.log")
    proc.start()
    await _file_written(ready)

    proc.stop(timeout_s=0.5)

    assert proc.exit_status() == "killed by SIGKILL"


async def test_wait_ready_returns_once_the_probe_answers(tmp_path: Path) -> None:
    marker = tmp_path / "up"
    code = "import sys, time; time.sleep(0.3); open(sys.argv[1], 'w').write('up'); time.sleep(300)"
    proc = ManagedProcess("slow starter", [*_python(code), str(marker)], tmp_path / "slow.log")
    proc.start()
    try:

        async def probe() -> bool:
            return marker.exists()

        await wait_ready(proc, probe, timeout_s=60)
        assert proc.alive() and marker.read_text() == "up"
    finally:
        proc.stop()


async def test_a_child_that_crashes_during_start_up_is_reported_with_its_status_and_log(
    tmp_path: Path,
) -> None:
    code = "import sys; print('cannot bind the port', flush=True); sys.exit(3)"
    proc = ManagedProcess("crasher", _python(code), tmp_path / "crasher.log")
    proc.start()

    async def never() -> bool:
        return False

    with pytest.raises(StartupError) as raised:
        await wait_ready(proc, never, timeout_s=60)
    message = str(raised.value)
    assert "crasher exited during start-up (exit status 3)" in message
    assert "cannot bind the port" in message


async def test_a_probe_that_never_answers_fails_at_the_deadline(tmp_path: Path) -> None:
    proc = ManagedProcess("mute", _python("import time; time.sleep(300)"), tmp_path / "mute.log")
    proc.start()
    try:

        async def never() -> bool:
            return False

        with pytest.raises(StartupError, match="mute was not ready after"):
            await wait_ready(proc, never, timeout_s=0.5)
    finally:
        proc.stop()


async def test_restart_starts_a_new_child_and_keeps_the_log(tmp_path: Path) -> None:
    code = "import os, time; print('started', os.getpid(), flush=True); time.sleep(300)"
    proc = ManagedProcess("restarted", _python(code), tmp_path / "restarted.log")
    proc.start()
    first = proc.pid
    await _until(lambda: f"started {first}" in proc.log_tail(), "first start logged")

    proc.restart()
    try:
        second = proc.pid
        assert second != first and proc.alive() and not _running(first)
        await _until(lambda: f"started {second}" in proc.log_tail(), "second start logged")
        assert f"started {first}" in proc.log_tail()
    finally:
        proc.stop()


async def test_kill_freeze_and_thaw_act_on_the_child(tmp_path: Path) -> None:
    proc = ManagedProcess("frozen", _python("import time; time.sleep(300)"), tmp_path / "frozen.log")
    proc.start()
    try:
        proc.freeze()
        await _until(lambda: _state(proc.pid) == "T", "the child stopped")
        proc.thaw()
        await _until(lambda: _state(proc.pid) != "T", "the child running again")
        proc.kill()
        assert proc.exit_status() == "killed by SIGKILL"
    finally:
        proc.stop()
