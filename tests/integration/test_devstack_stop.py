"""The dev stack leaves nothing behind: `kvplane dev-stack` stops everything it started and removes
etcd's data when its terminal closes (SIGHUP) as on Ctrl-C, whether the stack is up or still
starting; a stack started without a run directory removes the one it made (it holds tokens)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def _children(pid: int) -> dict[int, str]:
    """Every descendant of `pid`, with its command line."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    found: dict[int, str] = {}
    frontier = [pid]
    while frontier:
        parent = frontier.pop()
        for child, ppid in parents.items():
            if ppid == parent and child not in found:
                try:
                    found[child] = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                except OSError:
                    continue
                frontier.append(child)
    return found


def _flag(args: list[str], name: str) -> str | None:
    """The value of `--name value` or `--name=value` in a command line."""
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_for(proc: subprocess.Popen[str], marker: str, deadline: float) -> list[str]:
    lines: list[str] = []
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if marker in line:
            return lines
    raise AssertionError(f"{marker!r} not printed; got:\n{''.join(lines)}")


@pytest.mark.parametrize("when", ["running", "starting"])
def test_sighup_stops_every_process_and_removes_etcds_data(tmp_path: Path, when: str) -> None:
    argv = [sys.executable, "-m", "kvplane.services.cli", "dev-stack", "--no-demo", "--speedup", "50"]
    proc = subprocess.Popen(
        [*argv, "--run-dir", str(tmp_path / "run")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        _wait_for(proc, "kvplane is running" if when == "running" else "starting etcd", deadline)
        if when == "starting":
            # Until the first engine is spawned: then etcd and `serve all` are up at least.
            while not any("sim-engine" in c for c in _children(proc.pid).values()):
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.05)
        children = _children(proc.pid)
        etcd_dirs = [Path(d) for c in children.values() if (d := _flag(c.split(), "--data-dir"))]
        assert children and etcd_dirs
        proc.send_signal(signal.SIGHUP)
        assert proc.wait(timeout=120) == 0
        end = time.monotonic() + 60
        while any(_alive(p) for p in children) and time.monotonic() < end:
            time.sleep(0.1)
        assert [c for p, c in children.items() if _alive(p)] == []
        assert [d for d in etcd_dirs if d.exists()] == []
    finally:
        if proc.poll() is None:
            proc.kill()


async def test_a_stack_removes_the_run_directory_it_made_and_keeps_one_it_was_given(tmp_path: Path) -> None:
    from kvplane.services.devstack.stack import start_stack

    made = await start_stack(speedup=50)
    made_dir = made.run_dir
    assert (made_dir / "credentials").exists()  # the stack's tokens live there
    made.stop()
    assert not made_dir.exists()
    given = await start_stack(tmp_path / "run", speedup=50)
    given.stop()
    assert (tmp_path / "run" / "credentials").exists()
