"""The Helm chart's etcd backup Job, its steps run as rendered against a real etcd.

The CronJob (templates/etcd-backup.yaml) is rendered by Helm's own engine; its three steps, the
etcdctl snapshot, the check of the snapshot and the shell that names and prunes, run here with the
backup claim's mount point mapped to a temporary directory. etcd's tools come from Debian's
etcd-client (deploy/scripts/setup.sh installs it): where only etcd 3.4's etcdctl is present, the
check step's `etcdutl snapshot status` runs as `etcdctl snapshot status`, its 3.4 name.

Against an etcd as the chart runs it (TLS, client certificates, auth on after `kvplane
etcd-setup`), the snapshot step presents root's certificate, the one user etcd lets take a
snapshot; a service's certificate is refused.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import urllib.request
from base64 import b64encode
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kvplane.services.dev.local_etcd import LocalEtcd
from kvplane.services.etcd_access.principals import PROCESS_USERS, ROOT_USER
from tests.support.deploy_validators import load_deploy_checks
from tests.support.secured_etcd import SecuredEtcd, secured_etcd

MOUNT = "/backup"
CLIENT_TLS = "/etc/etcd-client-tls"

pytestmark = [
    pytest.mark.skipif(
        importlib.util.find_spec("helm_python") is None,
        reason="deploy validators not installed: pip install -e '.[dev]'",
    ),
    pytest.mark.skipif(shutil.which("etcdctl") is None, reason="needs etcdctl (apt-get install etcd-client)"),
]


@pytest.fixture(scope="module")
def checks() -> ModuleType:
    return load_deploy_checks()


def backup_pod(checks: ModuleType, endpoint: str, retention: int, tls: bool = False) -> dict[str, Any]:
    etcd: dict[str, Any] = {
        "enabled": False,
        "external": {"endpoints": [endpoint]},
        "backup": {"enabled": True, "retention": retention},
    }
    if tls:
        users = ("metadata", "routing", "eviction", "root")
        etcd["tls"] = {"clientSecrets": {user: f"etcd-{user}" for user in users}}
    else:  # a plaintext etcd on loopback, as the session's
        etcd.update(allowInsecure=True, tls={"enabled": False}, setup={"enabled": False})
    docs = checks.render_chart({"etcd": etcd}, "kvp", "kvplane")
    (job,) = [d for d in docs if d["kind"] == "CronJob"]
    pod: dict[str, Any] = job["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    return pod


def run_step(
    container: dict[str, Any], backup_dir: Path, certificate: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """One container's command, with the claim's mount point at `backup_dir` and the client
    certificate's at `certificate` (a folder laid out as the Secret: ca.crt, tls.crt, tls.key)."""
    command = [arg.replace(MOUNT, str(backup_dir)) for arg in container["command"]]
    if certificate is not None:
        command = [arg.replace(CLIENT_TLS, str(certificate)) for arg in command]
    if command[0] == "etcdutl" and shutil.which("etcdutl") is None:
        command[0] = "etcdctl"
    env = {**os.environ, **{e["name"]: e["value"] for e in container.get("env", [])}}
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120, check=False)


def put(etcd: LocalEtcd, key: str, value: str) -> None:
    body = json.dumps({"key": b64encode(key.encode()).decode(), "value": b64encode(value.encode()).decode()})
    request = urllib.request.Request(
        f"{etcd.client_url}/v3/kv/put", data=body.encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200


def test_a_backup_run_snapshots_etcd_and_keeps_the_newest_snapshots(
    checks: ModuleType, etcd: LocalEtcd, tmp_path: Path
) -> None:
    put(etcd, "/kvplane-backup-test/handle", "retained")
    # Three earlier runs' snapshots; with a retention of 2, the oldest two must go.
    older = ["etcd-snapshot-20250101T000000Z.db", "etcd-snapshot-20250102T000000Z.db"]
    oldest = "etcd-snapshot-20241231T000000Z.db"
    for name in [oldest, *older]:
        (tmp_path / name).write_bytes(b"an earlier snapshot")

    pod = backup_pod(checks, etcd.endpoint, retention=2)
    steps = [*pod["initContainers"], *pod["containers"]]
    assert [c["name"] for c in steps] == ["snapshot", "verify", "keep"]
    for container in steps:
        result = run_step(container, tmp_path)
        assert result.returncode == 0, f"{container['name']}: {result.stdout}{result.stderr}"

    kept = sorted(p.name for p in tmp_path.iterdir())
    assert len(kept) == 2, kept
    assert older[1] in kept and oldest not in kept and older[0] not in kept
    (new,) = [name for name in kept if name not in older]
    assert new.startswith("etcd-snapshot-") and new > older[1]
    status = subprocess.run(
        ["etcdctl", "snapshot", "status", str(tmp_path / new), "--write-out=json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(status.stdout)["totalKey"] >= 1


@pytest.fixture(scope="module")
def etcd_with_auth(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredEtcd]:
    with secured_etcd(tmp_path_factory.mktemp("etcd-backup-tls")) as etcd:
        yield etcd


def test_over_tls_with_auth_on_the_snapshot_presents_roots_certificate(
    checks: ModuleType, etcd_with_auth: SecuredEtcd, tmp_path: Path
) -> None:
    pod = backup_pod(checks, etcd_with_auth.endpoint, retention=2, tls=True)
    (snapshot,) = [c for c in pod["initContainers"] if c["name"] == "snapshot"]
    secret = next(v["secret"]["secretName"] for v in pod["volumes"] if v["name"] == "etcd-client-tls")
    assert secret == "etcd-root"
    # A service's certificate (its user holds kvplane's prefix alone) may not take a snapshot.
    refused = run_step(snapshot, tmp_path, etcd_with_auth.certs / PROCESS_USERS["metadata"])
    assert refused.returncode != 0 and "permission denied" in (refused.stdout + refused.stderr).lower()
    taken = run_step(snapshot, tmp_path, etcd_with_auth.certs / ROOT_USER)
    assert taken.returncode == 0, taken.stdout + taken.stderr
    assert (tmp_path / "incoming.db").stat().st_size > 0
