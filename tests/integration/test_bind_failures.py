"""A port already taken is one line naming the address and what wanted it, and exit status 1."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from kvplane.services.dev.local_etcd import LocalEtcd
from tests.conftest import AUTH_ENV


@pytest.fixture
def taken() -> Iterator[int]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _kvplane(argv: list[str], etcd: LocalEtcd) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **AUTH_ENV, "KVPLANE_ETCD__ENDPOINTS": f'["{etcd.endpoint}"]'}
    return subprocess.run(
        [sys.executable, "-m", "kvplane.services.cli", *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def _own_lines(stderr: str) -> list[str]:
    """What kvplane itself printed (not its JSON logs, nor gRPC's own C-core log line)."""
    return [line for line in stderr.splitlines() if line.startswith("kvplane ") or "Traceback" in line]


def test_serve_names_the_grpc_port_it_could_not_take(taken: int, etcd: LocalEtcd) -> None:
    done = _kvplane(["serve", "routing", "--listen", f"127.0.0.1:{taken}", "--metrics-port", "0"], etcd)
    assert done.returncode == 1
    assert _own_lines(done.stderr) == [
        f"kvplane serve: cannot listen on 127.0.0.1:{taken} for gRPC of RoutingService: "
        "the address is in use or not available on this host"
    ]


def test_serve_names_the_metrics_port_it_could_not_take(taken: int, etcd: LocalEtcd) -> None:
    done = _kvplane(["serve", "routing", "--listen", "127.0.0.1:0", "--metrics-port", str(taken)], etcd)
    assert done.returncode == 1
    (line,) = _own_lines(done.stderr)
    assert line.startswith(f"kvplane serve: cannot listen on 127.0.0.1:{taken} for Prometheus metrics: ")


def test_the_gateway_names_the_http_port_it_could_not_take(taken: int, etcd: LocalEtcd) -> None:
    done = _kvplane(["gateway", "--listen", f"127.0.0.1:{taken}", "--routing", "127.0.0.1:1"], etcd)
    assert done.returncode == 1
    (line,) = _own_lines(done.stderr)
    assert line.startswith(f"kvplane gateway: cannot listen on 127.0.0.1:{taken} for the gateway's HTTP: ")
