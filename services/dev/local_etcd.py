"""etcd for development stacks and tests: one member, or a cluster of several
on loopback ports.

Its data lives in a temporary directory, on tmpfs when /dev/shm exists:
etcd fsyncs every write, and a shared disk can stall that for seconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any

from kvplane.services.common.runtime.ports import free_port


class EtcdNotFound(RuntimeError):
    """No etcd binary on PATH."""


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


def _post_json(url: str, body: dict[str, object]) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    with urllib.request.urlopen(request, timeout=1) as resp:
        out: dict[str, Any] = json.loads(resp.read())
        return out


class LocalEtcd:
    """Starts, stops and restarts one etcd process on free loopback ports.

    Alone by default; `LocalEtcdCluster` sets `name` and `initial_cluster`
    to make it one member of several.
    """

    def __init__(self, host: str = "127.0.0.1", binary: str | None = None, name: str = "kvplane-dev") -> None:
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
        self.name = name
        # name=peer-url of every member; empty: a cluster of this member alone.
        self.initial_cluster = ""
        # Members of one cluster share it; it keeps them apart from other test clusters.
        self.cluster_token = self.data_dir.name

    @property
    def endpoint(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.client_port}"

    @property
    def client_url(self) -> str:
        return f"http://{self.endpoint}"

    @property
    def peer_url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.peer_port}"

    def start(self, timeout_s: float = 30.0) -> None:
        self.launch()
        self.wait_healthy(timeout_s)

    def launch(self) -> None:
        """Starts the process without waiting: a cluster's members become
        healthy only once a quorum of them runs."""
        client = self.client_url
        peer = self.peer_url
        args = [
            self.binary,
            "--name",
            self.name,
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
            self.initial_cluster or f"{self.name}={peer}",
            "--initial-cluster-token",
            self.cluster_token,
            "--logger",
            "zap",
            "--log-outputs",
            "stderr",
            "--unsafe-no-fsync" if self._supports_no_fsync() else "--snapshot-count=100000",
        ]
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=log, start_new_session=True)
        log.close()

    def wait_healthy(self, timeout_s: float = 30.0) -> None:
        if self.proc is None:
            raise RuntimeError(f"etcd member {self.name} is not running")
        _wait_healthy(self.client_url, time.monotonic() + timeout_s, self.proc, self.log_path)

    def pause(self) -> None:
        """Freezes the process (SIGSTOP): it holds its connections but answers nothing."""
        if self.proc is not None:
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGCONT)

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


class LocalEtcdCluster:
    """Several etcd members on loopback ports, forming one cluster."""

    def __init__(self, size: int = 3, host: str = "127.0.0.1", binary: str | None = None) -> None:
        self.members = [LocalEtcd(host, binary, name=f"kvplane-m{i}") for i in range(size)]
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for m in self.members:
            m.initial_cluster = initial
            m.cluster_token = self.members[0].data_dir.name

    @property
    def endpoints(self) -> list[str]:
        return [m.endpoint for m in self.members]

    def leader(self) -> int:
        """The index of the member that leads now (asked of the first member that answers)."""
        for m in self.members:
            if m.proc is None:
                continue
            with contextlib.suppress(OSError, ValueError, KeyError):
                status = _post_json(m.client_url + "/v3/maintenance/status", {})
                leader = int(status["leader"])
                for i, other in enumerate(self.members):
                    other_status = _post_json(other.client_url + "/v3/maintenance/status", {})
                    if int(other_status["header"]["member_id"]) == leader:
                        return i
        raise RuntimeError("no etcd member reports a leader")

    def start(self, timeout_s: float = 60.0) -> None:
        for m in self.members:
            m.launch()
        for m in self.members:
            m.wait_healthy(timeout_s)

    def cleanup(self) -> None:
        for m in self.members:
            m.resume()
            m.cleanup()

    def __enter__(self) -> LocalEtcdCluster:
        try:
            self.start()
        except BaseException:
            self.cleanup()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.cleanup()
