"""The sim-engine's command line: `python -m kvplane.connector.simengine` and `kvplane sim-engine` run
one engine until SIGINT or SIGTERM, then exit 0; bad flags exit 2 before anything starts."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import pytest

from kvplane.connector.simengine import __main__ as module_entry
from kvplane.connector.simengine.command import main
from kvplane.services.cli import EXTRA_COMMANDS
from kvplane.services.common.runtime.ports import free_port
from tests.support.simengine import sim

ENGINE = [sys.executable, "-m", module_entry.__name__]
CLI = [sys.executable, "-m", "kvplane.services.cli", "sim-engine"]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def _run_until_healthy(command: Sequence[str], log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    argv = sim(http_port=port, side_channel_port=free_port()).argv()
    with log.open("wb") as out:
        process = subprocess.Popen([*command, *argv], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while not _healthy(url):
        if process.poll() is not None:
            raise AssertionError(f"the engine exited ({process.returncode}):\n{log.read_text()}")
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"the engine did not become healthy:\n{log.read_text()}")
        time.sleep(0.1)  # poll interval
    return process, url


def test_the_cli_runs_this_commands_main() -> None:
    module, func = EXTRA_COMMANDS["sim-engine"].split(":")
    assert (module, func) == (main.__module__, main.__name__)
    assert module_entry.main is main, "python -m runs the same main"


@pytest.mark.parametrize(
    ("command", "stop"),
    [(ENGINE, signal.SIGTERM), (ENGINE, signal.SIGINT), (CLI, signal.SIGTERM)],
    ids=["python -m, SIGTERM", "python -m, SIGINT", "kvplane sim-engine, SIGTERM"],
)
def test_the_engine_serves_until_signalled_then_exits_cleanly(
    tmp_path: Path, command: list[str], stop: signal.Signals
) -> None:
    process, url = _run_until_healthy(command, tmp_path / "engine.log")
    try:
        process.send_signal(stop)
        assert process.wait(timeout=60) == 0, (tmp_path / "engine.log").read_text()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    log = (tmp_path / "engine.log").read_text()
    assert "kvplane sim-engine ready: role=both" in log and "Traceback" not in log
    assert not _healthy(url)


def test_a_bad_flag_exits_2_with_the_usage() -> None:
    done = subprocess.run([*ENGINE, "--role", "neither"], capture_output=True, timeout=60)
    assert done.returncode == 2 and b"usage:" in done.stderr and b"--role" in done.stderr
