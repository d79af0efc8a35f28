"""The store and a whole service against an etcd that serves TLS only and requires client
certificates (`--client-cert-auth`), and with etcd's own users enabled: the right certificate
(and user) work, a certificate from another CA, none, or a wrong password are refused."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from aetcd import rpc

from kvplane.services.common.model import convert
from kvplane.services.common.model.errors import StoreUnavailable
from kvplane.services.common.runtime.ports import free_port
from kvplane.services.common.store import Store, StoreSettings
from kvplane.services.common.store.etcd_credentials import EtcdCredentials
from kvplane.services.dev.local_etcd import LocalEtcd
from kvplane.v1 import metadata_pb2, metadata_pb2_grpc
from tests.conftest import MESH_SECRET, make_node, node_headers
from tests.support.certificates import Issued, TestCa
from tests.support.polling import eventually
from tests.support.trust import plane_settings, start_plane, target


@dataclass
class TlsEtcd:
    endpoint: str
    ca: TestCa
    client: Issued
    proc: subprocess.Popen[bytes]

    def credentials(self, issued: Issued | None = None, **extra: str) -> EtcdCredentials:
        chosen = issued or self.client
        return EtcdCredentials(
            ca_file=self.ca.ca_file, cert_file=chosen.cert_file, key_file=chosen.key_file, **extra
        )


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsEtcd]:
    binary = shutil.which("etcd") or LocalEtcd().binary
    tmp = tmp_path_factory.mktemp("etcd-tls")
    ca = TestCa(tmp / "ca")
    server = ca.issue("etcd-server", server=True)
    port, peer = free_port(), free_port()
    data = Path(
        tempfile.mkdtemp(prefix="kvplane-etcd-tls-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    )
    log = (tmp / "etcd.log").open("wb")
    proc = subprocess.Popen(
        [
            binary,
            "--name=tls",
            f"--data-dir={data}",
            f"--listen-client-urls=https://127.0.0.1:{port}",
            f"--advertise-client-urls=https://127.0.0.1:{port}",
            f"--listen-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-advertise-peer-urls=http://127.0.0.1:{peer}",
            f"--initial-cluster=tls=http://127.0.0.1:{peer}",
            f"--cert-file={server.cert_file}",
            f"--key-file={server.key_file}",
            f"--trusted-ca-file={ca.ca_file}",
            "--client-cert-auth",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        yield TlsEtcd(f"127.0.0.1:{port}", ca, ca.issue("kvplane-client"), proc)
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()
        shutil.rmtree(data, ignore_errors=True)


@pytest.fixture
async def tls_store(tls_etcd: TlsEtcd, prefix: str) -> AsyncIterator[Store]:
    store = Store(
        StoreSettings(endpoints=(tls_etcd.endpoint,), prefix=prefix, credentials=tls_etcd.credentials())
    )
    await store.connect()

    async def answers() -> bool:
        await store.read_prefix(prefix.encode())
        return True

    await eventually(answers, timeout_s=30, what="etcd over TLS to answer")
    try:
        yield store
    finally:
        await store.close()


async def _refused(settings: StoreSettings) -> bool:
    store = Store(settings)
    try:
        await store.connect()
        await store.read_prefix(settings.prefix.encode())
    except (StoreUnavailable, grpc.aio.AioRpcError):
        return True
    finally:
        await store.close()
    return False


async def test_the_store_works_over_tls_with_its_client_certificate(tls_store: Store) -> None:
    node = make_node("d0")
    await tls_store.register_node(node, 30)
    _, nodes = await tls_store.list_nodes()
    assert [record.node.node_id for record, _ in nodes] == ["d0"]


async def test_another_cas_certificate_or_none_is_refused_by_etcd(
    tls_etcd: TlsEtcd, tls_store: Store, prefix: str, tmp_path: Path
) -> None:
    other = TestCa(tmp_path / "other", name="other-ca")
    forged = other.issue("forged-client")
    fast = {"endpoints": (tls_etcd.endpoint,), "prefix": prefix, "request_timeout_s": 0.5}
    assert await _refused(StoreSettings(**fast, credentials=tls_etcd.credentials(forged)))  # type: ignore[arg-type]
    assert await _refused(StoreSettings(**fast, credentials=EtcdCredentials(ca_file=tls_etcd.ca.ca_file)))  # type: ignore[arg-type]
    assert await _refused(StoreSettings(**fast))  # type: ignore[arg-type]


async def test_a_service_reaches_etcd_over_tls_from_its_settings(tls_etcd: TlsEtcd, prefix: str) -> None:
    settings = plane_settings(
        LocalEtcdAt(tls_etcd.endpoint),  # type: ignore[arg-type]
        prefix,
        {"mode": "mesh", "mesh_experimental": True, "mesh": {"secrets": [MESH_SECRET]}},
        etcd={
            "tls_ca_file": tls_etcd.ca.ca_file,
            "tls_cert_file": tls_etcd.client.cert_file,
            "tls_key_file": tls_etcd.client.key_file,
        },
    )
    process = await start_plane(settings)
    try:
        async with grpc.aio.insecure_channel(target(process)) as channel:
            stub = metadata_pb2_grpc.MetadataServiceStub(channel)
            node = make_node("d0")
            await stub.RegisterNode(
                metadata_pb2.RegisterNodeRequest(node=convert.node_to_pb(node), lease_ttl_s=30),
                metadata=node_headers("d0"),
                timeout=10,
            )
        _, nodes = await process.store.list_nodes()
        assert [record.node.node_id for record, _ in nodes] == ["d0"]
    finally:
        await process.stop()


@dataclass
class LocalEtcdAt:
    """Stands in for LocalEtcd where only its endpoint is read."""

    endpoint: str


async def test_etcd_users_need_the_right_password(tls_etcd: TlsEtcd, tls_store: Store, prefix: str) -> None:
    # etcd takes a client certificate's common name as the user when no token is sent; the
    # certificate below names no user, so only the password's token can authorize its calls.
    anonymous_cert = tls_etcd.ca.issue("no-such-user")
    admin = tls_etcd.credentials().bare_channel(tls_etcd.endpoint)
    auth = rpc.AuthStub(admin)
    await auth.UserAdd(rpc.AuthUserAddRequest(name="root", password="root-pw"))
    await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="root", role="root"))
    await auth.AuthEnable(rpc.AuthEnableRequest())
    try:
        fast = {"endpoints": (tls_etcd.endpoint,), "prefix": prefix, "request_timeout_s": 1.0}
        good = tls_etcd.credentials(anonymous_cert, user="root", password="root-pw")
        store = Store(StoreSettings(**fast, credentials=good))  # type: ignore[arg-type]
        await store.connect()
        try:
            await store.register_node(make_node("d-user"), 30)
            _, nodes = await store.list_nodes()
            assert "d-user" in {record.node.node_id for record, _ in nodes}
        finally:
            await store.close()
        wrong = tls_etcd.credentials(anonymous_cert, user="root", password="not-it")
        assert await _refused(StoreSettings(**fast, credentials=wrong))  # type: ignore[arg-type]
        assert await _refused(StoreSettings(**fast, credentials=tls_etcd.credentials(anonymous_cert)))  # type: ignore[arg-type]
    finally:
        token = (await auth.Authenticate(rpc.AuthenticateRequest(name="root", password="root-pw"))).token
        await auth.AuthDisable(rpc.AuthDisableRequest(), metadata=(("token", token),))
        await admin.close()


async def test_a_running_store_presents_its_renewed_client_certificate(
    tls_etcd: TlsEtcd, prefix: str, tmp_path: Path
) -> None:
    # The store starts with a certificate etcd refuses (as an expired one would be); the files are
    # then renewed in place, as a Secret volume is.
    refused = TestCa(tmp_path / "other", name="other-ca").issue("stale-client")
    cert_file, key_file = tmp_path / "client.pem", tmp_path / "client-key.pem"
    shutil.copyfile(refused.cert_file, cert_file)
    shutil.copyfile(refused.key_file, key_file)
    credentials = EtcdCredentials(
        ca_file=tls_etcd.ca.ca_file, cert_file=str(cert_file), key_file=str(key_file)
    )
    store = Store(
        StoreSettings(
            endpoints=(tls_etcd.endpoint,), prefix=prefix, request_timeout_s=0.5, credentials=credentials
        )
    )
    try:
        await store.connect()

        async def answers() -> bool:
            try:
                await store.read_prefix(prefix.encode())
            except (StoreUnavailable, grpc.aio.AioRpcError):
                return False
            return True

        assert not await answers()
        for source, dest in ((tls_etcd.client.cert_file, cert_file), (tls_etcd.client.key_file, key_file)):
            shutil.copyfile(source, dest)
            later = dest.stat().st_mtime + 5  # whatever the file system's clock resolution
            os.utime(dest, (later, later))
        await eventually(answers, timeout_s=30, what="etcd answering the renewed certificate")
    finally:
        await store.close()


USER = "kvplane-rotating"


async def test_a_running_store_follows_its_rotated_password_file(
    tls_etcd: TlsEtcd, tls_store: Store, prefix: str, tmp_path: Path
) -> None:
    # The password is changed in etcd (which revokes the user's tokens) and in the Secret's file:
    # the running store authenticates again from the file, without a restart.
    # A user of its own with the root role; etcd enables its users only once `root` exists.
    anonymous_cert = tls_etcd.ca.issue("no-such-user-either")
    admin = tls_etcd.credentials().bare_channel(tls_etcd.endpoint)
    auth = rpc.AuthStub(admin)
    if "root" not in (await auth.UserList(rpc.AuthUserListRequest())).users:
        await auth.UserAdd(rpc.AuthUserAddRequest(name="root", password="root-pw"))
        await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user="root", role="root"))
    await auth.UserAdd(rpc.AuthUserAddRequest(name=USER, password="first-pw"))
    await auth.UserGrantRole(rpc.AuthUserGrantRoleRequest(user=USER, role="root"))
    await auth.AuthEnable(rpc.AuthEnableRequest())
    password_file = tmp_path / "etcd-password"
    password_file.write_text("first-pw\n")
    credentials = tls_etcd.credentials(
        anonymous_cert, user=USER, password="first-pw", password_file=str(password_file)
    )
    store = Store(
        StoreSettings(
            endpoints=(tls_etcd.endpoint,), prefix=prefix, request_timeout_s=1.0, credentials=credentials
        )
    )
    password = "first-pw"
    try:
        await store.connect()
        await store.register_node(make_node("d-rotating"), 30)
        token = (await auth.Authenticate(rpc.AuthenticateRequest(name=USER, password=password))).token
        await auth.UserChangePassword(
            rpc.AuthUserChangePasswordRequest(name=USER, password="second-pw"), metadata=(("token", token),)
        )
        password = "second-pw"
        # The old password no longer authenticates: the store can answer only from the new file.
        with pytest.raises(grpc.aio.AioRpcError):
            await auth.Authenticate(rpc.AuthenticateRequest(name=USER, password="first-pw"))
        password_file.write_text("second-pw\n")

        async def answers() -> bool:
            try:
                _, nodes = await store.list_nodes()
            except (StoreUnavailable, grpc.aio.AioRpcError):
                return False
            return "d-rotating" in {record.node.node_id for record, _ in nodes}

        await eventually(answers, timeout_s=30, what="the store answering with the rotated password")
    finally:
        await store.close()
        token = (await auth.Authenticate(rpc.AuthenticateRequest(name=USER, password=password))).token
        await auth.AuthDisable(rpc.AuthDisableRequest(), metadata=(("token", token),))
        await auth.UserDelete(rpc.AuthUserDeleteRequest(name=USER))
        await admin.close()
