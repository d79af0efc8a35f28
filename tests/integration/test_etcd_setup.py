"""`kvplane etcd-setup` against a real etcd serving TLS with `--client-cert-auth`, its certificates
from `kvplane dev-certs`: afterwards each process's certificate (CN = its etcd user) reads and
writes kvplane's prefix and nothing else, a certificate naming no user gets nothing, and running
the setup again changes nothing (etcd 3.4 here: users without a password work there too)."""

from __future__ import annotations

import asyncio
import datetime
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from aetcd import rpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from kvplane.services.common.model.errors import StoreUnavailable
from kvplane.services.common.store import Store, StoreSettings
from kvplane.services.common.store.etcd import open_channel
from kvplane.services.common.store.etcd_credentials import EtcdCredentials
from kvplane.services.etcd_access.auth_plan import Permission
from kvplane.services.etcd_access.auth_setup import EtcdAuth
from kvplane.services.etcd_access.certificates import (
    CA_CERT,
    CA_FOLDER,
    CA_KEY,
    CERT,
    KEY,
    Authority,
)
from kvplane.services.etcd_access.cli import etcd_setup_main
from kvplane.services.etcd_access.principals import (
    PROCESS_USERS,
    ROLE,
    ROOT_USER,
    prefix_range,
    process_users,
)
from tests.conftest import make_node
from tests.support.secured_etcd import PREFIX, SecuredEtcd, secured_etcd


@pytest.fixture(scope="module")
def etcd_prepared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecuredEtcd]:
    with secured_etcd(tmp_path_factory.mktemp("etcd-setup")) as etcd:
        yield etcd


def _store(etcd: SecuredEtcd, credentials: EtcdCredentials) -> Store:
    return Store(
        StoreSettings(
            endpoints=(etcd.endpoint,), prefix=PREFIX, request_timeout_s=2.0, credentials=credentials
        )
    )


@pytest.mark.parametrize("kind", sorted(PROCESS_USERS))
async def test_each_process_certificate_reads_and_writes_under_the_prefix(
    etcd_prepared: SecuredEtcd, kind: str
) -> None:
    store = _store(etcd_prepared, etcd_prepared.credentials(PROCESS_USERS[kind]))
    await store.connect()
    try:
        node = make_node(f"d-{kind}")
        await store.register_node(node, 30)
        _, nodes = await store.list_nodes()
        assert node.node_id in {record.node.node_id for record, _ in nodes}
    finally:
        await store.close()


async def test_a_process_certificate_cannot_read_or_write_outside_the_prefix(
    etcd_prepared: SecuredEtcd,
) -> None:
    root = open_channel(etcd_prepared.endpoint, etcd_prepared.credentials(ROOT_USER))
    channel = open_channel(etcd_prepared.endpoint, etcd_prepared.credentials(PROCESS_USERS["metadata"]))
    try:
        await rpc.KVStub(root).Put(rpc.PutRequest(key=b"/other-app/secret", value=b"x"), timeout=5)
        kv = rpc.KVStub(channel)
        for call in (
            kv.Range(rpc.RangeRequest(key=b"/other-app/secret"), timeout=5),
            kv.Put(rpc.PutRequest(key=b"/other-app/secret", value=b"overwritten"), timeout=5),
            # The whole keyspace from the prefix's first key on reaches beyond it.
            kv.Range(rpc.RangeRequest(key=PREFIX.encode(), range_end=b"\0"), timeout=5),
            # Nor may it change users or roles.
            rpc.AuthStub(channel).UserList(rpc.AuthUserListRequest(), timeout=5),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        kept = await rpc.KVStub(root).Range(rpc.RangeRequest(key=b"/other-app/secret"), timeout=5)
        assert kept.kvs[0].value == b"x"
    finally:
        await channel.close()
        await root.close()


async def test_a_certificate_whose_cn_is_no_user_is_refused(
    etcd_prepared: SecuredEtcd, tmp_path: Path
) -> None:
    # Signed by the same CA (so TLS accepts it), but its Common Name is no etcd user.
    ca = etcd_prepared.certs / CA_FOLDER
    key = serialization.load_pem_private_key((ca / CA_KEY).read_bytes(), None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    authority = Authority(x509.load_pem_x509_certificate((ca / CA_CERT).read_bytes()), key)
    issued = authority.issue_client("kvplane-nobody", datetime.datetime.now(datetime.UTC), 1)
    (tmp_path / CERT).write_bytes(issued.cert)
    (tmp_path / KEY).write_bytes(issued.key)
    credentials = EtcdCredentials(
        ca_file=str(ca / CA_CERT), cert_file=str(tmp_path / CERT), key_file=str(tmp_path / KEY)
    )
    store = _store(etcd_prepared, credentials)
    await store.connect()
    try:
        with pytest.raises(StoreUnavailable, match="PERMISSION_DENIED"):
            await store.read_prefix(PREFIX.encode())
    finally:
        await store.close()


async def test_etcd_holds_the_role_the_users_and_auth_on(etcd_prepared: SecuredEtcd) -> None:
    channel = open_channel(etcd_prepared.endpoint, etcd_prepared.credentials(ROOT_USER))
    try:
        state = await EtcdAuth(channel, 5.0).state(process_users())
    finally:
        await channel.close()
    keys = prefix_range(PREFIX)
    assert state.roles == {ROLE: (Permission("READWRITE", keys.key, keys.range_end),)}
    assert state.users == {
        **{user: frozenset({ROLE}) for user in process_users()},
        ROOT_USER: frozenset({"root"}),
    }
    assert state.auth_enabled


def test_setup_again_changes_nothing(etcd_prepared: SecuredEtcd, capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    assert etcd_setup_main(["--config", str(etcd_prepared.root_config)]) == 0
    assert "nothing to change" in capsys.readouterr().out


async def _as_root(etcd: SecuredEtcd, calls: list[tuple[str, object]]) -> None:
    channel = open_channel(etcd.endpoint, etcd.credentials(ROOT_USER))
    try:
        auth = rpc.AuthStub(channel)
        for method, request in calls:
            await getattr(auth, method)(request, timeout=5)
    finally:
        await channel.close()


def test_setup_takes_back_what_reaches_beyond_the_prefix(
    etcd_prepared: SecuredEtcd, capsys: pytest.CaptureFixture[str]
) -> None:
    wider = rpc.Permission(permType=rpc.Permission.READ, key=b"/", range_end=b"\0")
    asyncio.run(
        _as_root(
            etcd_prepared,
            [
                ("RoleGrantPermission", rpc.AuthRoleGrantPermissionRequest(name=ROLE, perm=wider)),
                ("UserGrantRole", rpc.AuthUserGrantRoleRequest(user=PROCESS_USERS["routing"], role="root")),
            ],
        )
    )
    capsys.readouterr()
    assert etcd_setup_main(["--config", str(etcd_prepared.root_config)]) == 0
    out = capsys.readouterr().out
    assert f"revoke READ on [b'/', b'\\x00') from role {ROLE}" in out
    assert f"revoke role root from user {PROCESS_USERS['routing']}" in out
    assert etcd_setup_main(["--config", str(etcd_prepared.root_config)]) == 0
    assert "nothing to change" in capsys.readouterr().out


def test_a_process_certificate_cannot_run_the_setup(
    etcd_prepared: SecuredEtcd, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = etcd_prepared.config(tmp_path / "metadata.yaml", PROCESS_USERS["metadata"])
    assert etcd_setup_main(["--config", str(config), "--wait-s", "0"]) == 1
    assert "PERMISSION_DENIED" in capsys.readouterr().err
