"""`kvplane sim` draws its progress bar on a terminal only: never into a pipe or a file."""

from __future__ import annotations

import io
import json
import os
import pty
from pathlib import Path

import pytest

from kvplane.bench.sim.command import main


def _trace(tmp_path: Path) -> Path:
    lines, ids = [], list(range(1, 9))
    for k in range(4):
        request = {"timestamp": 30_000 * k, "input_length": 512 * len(ids), "output_length": 64}
        lines.append(json.dumps(request | {"hash_ids": ids}))
        ids = ids + [100 * (k + 1) + j for j in range(3)]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _stderr_of_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, write_fd: int, read_fd: int) -> str:
    """Runs one policy over a 4-turn trace with stderr on `write_fd`; what came out of `read_fd`."""
    stream = io.TextIOWrapper(os.fdopen(write_fd, "wb", buffering=0), encoding="utf-8", write_through=True)
    monkeypatch.setattr("sys.stderr", stream)
    assert main(["--trace", str(_trace(tmp_path)), "--policies", "no-reuse"]) == 0
    stream.close()
    chunks = []
    while True:
        try:
            chunk = os.read(read_fd, 65536)
        except OSError:  # a pseudo-terminal reports its closed other end as EIO
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(read_fd)
    return b"".join(chunks).decode("utf-8", "replace")


def test_the_progress_bar_is_drawn_on_a_terminal(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    terminal, other_end = pty.openpty()
    assert os.isatty(other_end)
    out = _stderr_of_run(monkeypatch, tmp_path, other_end, terminal)
    assert "[" + "#" * 30 + "] 100% 4/4 turns" in out


def test_no_progress_bar_goes_into_a_pipe(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    read_end, write_end = os.pipe()
    out = _stderr_of_run(monkeypatch, tmp_path, write_end, read_end)
    assert "turns" not in out and "#" not in out
