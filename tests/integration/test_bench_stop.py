"""A benchmark stopped by SIGTERM stops every process it started: its etcd and its servers run
apart from it (etcd in a session of its own), so nothing else would."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path

from tests.support.polling import eventually
from tests.support.processes import processes_naming


async def test_sigterm_stops_the_route_benchmarks_etcd_and_servers(tmp_path: Path) -> None:
    etcd_before = set(processes_naming("kvplane-etcd-"))
    # Enough calls that it is still in its first phase when stopped.
    args = ["--calls-c1", "1000000", "--calls-c64", "10", "--tracing", "off"]
    stderr = tmp_path / "stderr"
    with stderr.open("wb") as sink:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "kvplane.bench.route_bench",
            *args,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=sink,
        )
    try:

        async def echo_up() -> bool:
            # Its etcd, then its echo server, whose phase (a million calls) is under way when stopped.
            return bool(processes_naming("route_bench serve-echo"))

        await eventually(echo_up, timeout_s=120, what="the benchmark's echo server to start")
        assert set(processes_naming("kvplane-etcd-")) - etcd_before, "the benchmark's etcd is not running"
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), timeout=120) == 1
        assert "stopped" in stderr.read_text()
        assert processes_naming("route_bench serve-") == []
        assert set(processes_naming("kvplane-etcd-")) - etcd_before == set()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
