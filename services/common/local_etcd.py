"""A single-member etcd for development stacks and tests.

Its data lives in a temporary directory, on tmpfs when /dev/shm exists:
etcd fsyncs every write, and a shared disk can stall that for seconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from types import TracebackType


class EtcdNotFound(RuntimeError):
    """No etcd binary on PATH."""


def free_port(host: str = "127.0.0.1") -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _wait_healthy(url: str, deadline: float, proc: subprocess.Popen[bytes], log: Path) -> None:
    """Until etcd's /health says it has a leader and serves requests."""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"etcd exited with {proc.returncode}: {log.read_text()[-2000:]}")
        with (
            contextlib.suppress(OSError, ValueError),
            urllib.request.urlopen(url + "/health", timeout=1) as resp,
        ):
            if json.loads(resp.read()).get("health") == "true":
                return
        time.sleep(0.05)  # polling until the deadline
    raise TimeoutError(f"etcd at {url} did not become healthy: {log.read_text()[-2000:]}")


class LocalEtcd:
    """Starts, stops and restarts one etcd process on free loopback ports."""

    def __init__(self, host: str = "127.0.0.1", binary: str | None = None) -> None:
        found = (
            binary or shutil.which("etcd") or ("/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else None)
        )
        if not found:
            raise EtcdNotFound("etcd is not installed (Debian: apt-get install etcd-server)")
        self.binary = found
        self.host = host
        self.client_port = free_port(host)
        self.peer_port = free_port(host)
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        self.data_dir = Path(tempfile.mkdtemp(prefix="kvplane-etcd-", dir=base))
        self.log_path = self.data_dir.parent / (self.data_dir.name + ".log")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.client_port}"

    def start(self, timeout_s: float = 30.0) -> None:
        host = f"[{self.host}]" if ":" in self.host else self.host
        client = f"http://{host}:{self.client_port}"
        peer = f"http://{host}:{self.peer_port}"
        args = [
            self.binary,
            "--name",
            "kvplane-dev",
            "--data-dir",
            str(self.data_dir / "data"),
            "--listen-client-urls",
            client,
            "--advertise-client-urls",
            client,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            f"kvplane-dev={peer}",
            "--logger",
            "zap",
            "--log-outputs",
            "stderr",
            "--unsafe-no-fsync" if self._supports_no_fsync() else "--snapshot-count=100000",
        ]
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=log, start_new_session=True)
        log.close()
        _wait_healthy(client, time.monotonic() + timeout_s, self.proc, self.log_path)

    def _supports_no_fsync(self) -> bool:
        out = subprocess.run([self.binary, "--help"], capture_output=True, text=True, check=False)
        return "--unsafe-no-fsync" in out.stdout + out.stderr

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            self.log_path.unlink()

    def __enter__(self) -> LocalEtcd:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.cleanup()
