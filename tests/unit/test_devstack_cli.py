"""`kvplane dev-stack`'s command line: start-up failures, where the logs go, and the stack stopped
on every way out. The stack itself is replaced here; test_system.py runs the real one."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from kvplane.services.devstack import cli
from kvplane.services.devstack.processes import StartupError


class FakeStack:
    gateway_url = "http://127.0.0.1:1"

    def __init__(self) -> None:
        self.stopped = False

    def urls(self) -> dict[str, str]:
        return {"gateway (OpenAI API)": self.gateway_url}

    def stop(self) -> None:
        self.stopped = True


def _starting(monkeypatch: pytest.MonkeyPatch, outcome: FakeStack | BaseException) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []

    async def start_stack(run_dir: Path, **kwargs: Any) -> FakeStack:
        calls.append({"run_dir": run_dir, **kwargs})
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome

    monkeypatch.setattr(cli, "start_stack", start_stack)
    return calls


def test_a_start_up_failure_exits_1_and_says_why(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    _starting(monkeypatch, StartupError("gateway exited during start-up (exit status 1)"))
    assert cli.main(["--run-dir", str(tmp_path)]) == 1
    out = capsys.readouterr()
    assert "start-up failed: gateway exited during start-up (exit status 1)" in out.err
    assert f"logs kept in {tmp_path}" in out.out and tmp_path.exists()


def test_a_temporary_run_directory_is_removed_unless_kept(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    calls = _starting(monkeypatch, StartupError("boom"))
    cli.main([])
    removed = calls[0]["run_dir"]
    assert f"logs removed with {removed}" in capsys.readouterr().out and not removed.exists()

    cli.main(["--keep-logs"])
    kept = calls[1]["run_dir"]
    try:
        assert f"logs kept in {kept}" in capsys.readouterr().out and kept.exists()
    finally:
        kept.rmdir()


def test_flags_reach_the_stack_and_it_is_stopped_after_the_demo(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    stack = FakeStack()
    calls = _starting(monkeypatch, stack)
    argv = ["--run-dir", str(tmp_path), "--gateway-port", "8000", "--speedup", "4", "--no-demo"]
    assert cli.main([*argv, "--exit-after-demo"]) == 0
    (call,) = calls
    assert call["ports"].gateway == 8000 and call["ports"].grpc == 0 and call["speedup"] == 4.0
    assert stack.stopped
    out = capsys.readouterr().out
    assert re.search(r"gateway \(OpenAI API\)\s+http://127\.0\.0\.1:1", out)
    assert "Authorization: Bearer dev-key" in out
