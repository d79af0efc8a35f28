"""`kvplane dev-stack` (what `make run` starts), run as a user runs it: pinned ports, a kept run
directory, and a demo whose columns add up."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kvplane.services.common.runtime.ports import free_port

pytestmark = pytest.mark.e2e


def test_dev_stack_pins_its_ports_keeps_its_logs_and_its_demo_columns_add_up(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    gateway_port, grpc_port = free_port(), free_port()
    done = subprocess.run(
        [
            *(sys.executable, "-m", "kvplane.services.cli", "dev-stack"),
            *("--run-dir", str(run_dir), "--gateway-port", str(gateway_port), "--grpc-port", str(grpc_port)),
            *("--turns", "2", "--speedup", "20", "--exit-after-demo"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr[-3000:]

    assert f"http://127.0.0.1:{gateway_port}" in out
    assert f"127.0.0.1:{grpc_port}" in out
    assert f"logs kept in {run_dir}" in out
    assert {"services.log", "gateway.log", "engine-p0.log", "engine-d0.log"} <= {
        p.name for p in run_dir.iterdir()
    }

    # conversation, turn (* after P's cache was reset), prompt, TTFT ms, decision, pulled, P cache, computed
    rows = re.findall(
        r"^(demo-\d+)\s+(\d+)\*?\s+(\d+)\s+(\d+)\s+(\S+)\s+(\d+)\s+(\d+)\s+(\d+)$", out, re.MULTILINE
    )
    assert len(rows) == 2 * 2, out
    for _conversation, _turn, prompt, _ttft, _decision, pulled, cached, computed in rows:
        assert int(pulled) + int(cached) + int(computed) == int(prompt), out
    # A later turn finds its history in P's own prefix cache (or pulls it): that is now shown.
    assert any(int(pulled) + int(cached) > 0 for *_, pulled, cached, _computed in rows), out


def _as_from_a_terminal() -> None:
    # A command started with `&` by a shell without job control (a CI script, nohup) inherits
    # SIGINT ignored, and Python then leaves it ignored; a user's Ctrl-C reaches a foreground one.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_during_start_up_says_what_became_of_the_logs() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvplane.services.cli", "dev-stack", "--no-demo"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=_as_from_a_terminal,
    )
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("==> starting kvplane serve all"):
            proc.send_signal(signal.SIGINT)
            break
    try:
        rest, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        # Ctrl-C was lost: stop the stack it went on to start (SIGTERM once it serves), then fail.
        proc.terminate()
        rest, _ = proc.communicate(timeout=60)
        pytest.fail("Ctrl-C during start-up did not stop the stack:\n" + "".join(seen) + rest)
    out = "".join(seen) + rest
    removed = re.search(r"==> logs removed with (\S+) ", out)
    assert removed is not None, out
    assert not Path(removed.group(1)).exists()
