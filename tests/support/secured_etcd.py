"""A real etcd as kvplane deploys it: TLS only, client certificates required (`--client-cert-auth`),
its certificates from `kvplane dev-certs`, and `kvplane etcd-setup` run as root (users, their
role on kvplane's prefix, auth on). Each holder's folder is laid out as a Kubernetes TLS Secret."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

from kvplane.services.common.runtime.ports import free_port
from kvplane.services.common.store.etcd_credentials import EtcdCredentials
from kvplane.services.dev.local_etcd import LocalEtcd
from kvplane.services.etcd_access.certificates import CA_CERT, CERT, KEY, SERVER_FOLDER
from kvplane.services.etcd_access.cli import dev_certs_main, etcd_setup_main
from kvplane.services.etcd_access.principals import ROOT_USER

PREFIX = "/kvplane/v1/"


@dataclass
class SecuredEtcd:
    endpoint: str
    # dev-certs' output: ca/, etcd-server/, and a folder per etcd user.
    certs: Path
    # Settings naming root's certificate (what `kvplane etcd-setup --config` reads).
    root_config: Path

    def credentials(self, user: str) -> EtcdCredentials:
        folder = self.certs / user
        return EtcdCredentials(
            ca_file=str(folder / CA_CERT), cert_file=str(folder / CERT), key_file=str(folder / KEY)
        )

    def config(self, path: Path, user: str) -> Path:
        """A settings file reaching this etcd as `user`."""
        folder = self.certs / user
        etcd = {
            "endpoints": [self.endpoint],
            "prefix": PREFIX,
            "tls_ca_file": str(folder / CA_CERT),
            "tls_cert_file": str(folder / CERT),
            "tls_key_file": str(folder / KEY),
        }
        path.write_text(yaml.safe_dump({"etcd": etcd}))
        return path


@contextlib.contextmanager
def secured_etcd(tmp: Path) -> Iterator[SecuredEtcd]:
    """Starts it under `tmp`, prepares it for kvplane, and stops it afterwards, even on failure."""
    binary = shutil.which("etcd") or LocalEtcd().binary
    certs = tmp / "certs"
    assert dev_certs_main(["--out", str(certs)]) == 0
    port, peer = free_port(), free_port()
    data = Path(
        tempfile.mkdtemp(
            prefix="kvplane-etcd-secured-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None
        )
    )
    server = certs / SERVER_FOLDER
    log = (tmp / "etcd.log").open("wb")
    proc = subprocess.Popen(
        [
            binary,
            "--name=secured",
            f"--data-dir={data}",
            f"--listen-client-urls=https://127.0.0.1:{port}",
            f"--advertise-client-urls=https://127.0.0.1:{port}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=secured=http://127.0.0.1:{peer}",
            f"--cert-file={server / CERT}",
            f"--key-file={server / KEY}",
            f"--trusted-ca-file={server / CA_CERT}",
            "--client-cert-auth",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        etcd = SecuredEtcd(f"127.0.0.1:{port}", certs, tmp / "root.yaml")
        etcd.config(etcd.root_config, ROOT_USER)
        # The first run waits for etcd to answer (--wait-s), as a deploy's setup Job does.
        assert etcd_setup_main(["--config", str(etcd.root_config), "--wait-s", "60"]) == 0
        yield etcd
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()
        shutil.rmtree(data, ignore_errors=True)
