"""`kvplane dev-certs`: a CA, etcd's server certificate with the names asked for, a client
certificate per etcd user whose Common Name is the user, all chaining to the CA; keys 0600; no
file written over unless asked."""

from __future__ import annotations

import datetime
import ipaddress
import os
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from kvplane.services.dev.credential_files import CredentialFilesExist, write_files
from kvplane.services.etcd_access.certificates import (
    CA_CERT,
    CA_FOLDER,
    CA_KEY,
    CERT,
    KEY,
    SERVER_FOLDER,
    Authority,
    bundle_files,
    is_key,
)
from kvplane.services.etcd_access.cli import DEFAULT_SANS, dev_certs_main
from kvplane.services.etcd_access.principals import ROOT_USER, process_users

USERS = (ROOT_USER, *process_users())


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def _cn(cert: x509.Certificate) -> str:
    return str(cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_every_holder_gets_its_folder_with_the_ca_and_its_own_pair(tmp_path: Path) -> None:
    out = tmp_path / "certs"
    assert dev_certs_main(["--out", str(out), "--san", "etcd", "--san", "10.0.0.7"]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted([CA_FOLDER, SERVER_FOLDER, *USERS])
    assert sorted(p.name for p in (out / CA_FOLDER).iterdir()) == [CA_CERT, CA_KEY]
    for holder in (SERVER_FOLDER, *USERS):
        assert sorted(p.name for p in (out / holder).iterdir()) == [CA_CERT, CERT, KEY]
        assert (out / holder / CA_CERT).read_bytes() == (out / CA_FOLDER / CA_CERT).read_bytes()


def test_keys_are_0600_certificates_0644_folders_0700(tmp_path: Path) -> None:
    out = tmp_path / "certs"
    old = os.umask(0o022)
    try:
        assert dev_certs_main(["--out", str(out)]) == 0
    finally:
        os.umask(old)
    assert _mode(out / CA_FOLDER / CA_KEY) == 0o600
    for holder in (SERVER_FOLDER, *USERS):
        assert _mode(out / holder) == 0o700
        assert _mode(out / holder / KEY) == 0o600
        assert _mode(out / holder / CERT) == 0o644
    assert not list(out.rglob(".*.new"))


def test_the_server_certificate_names_the_sans_asked_for(tmp_path: Path) -> None:
    out = tmp_path / "certs"
    args = ["--out", str(out), "--san", "etcd", "--san", "etcd-0.etcd.ns.svc", "--san", "10.0.0.7"]
    assert dev_certs_main(args) == 0
    cert = _cert(out / SERVER_FOLDER / CERT)
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["etcd", "etcd-0.etcd.ns.svc"]
    assert sans.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.0.0.7")]
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in usages


def test_without_sans_the_server_certificate_names_loopback(tmp_path: Path) -> None:
    out = tmp_path / "certs"
    assert dev_certs_main(["--out", str(out)]) == 0
    sans = _cert(out / SERVER_FOLDER / CERT).extensions.get_extension_for_class(x509.SubjectAlternativeName)
    named = [
        *sans.value.get_values_for_type(x509.DNSName),
        *map(str, sans.value.get_values_for_type(x509.IPAddress)),
    ]
    assert named == list(DEFAULT_SANS)


def test_each_client_certificate_names_its_user_and_chains_to_the_ca(tmp_path: Path) -> None:
    out = tmp_path / "certs"
    assert dev_certs_main(["--out", str(out), "--days", "30"]) == 0
    ca = _cert(out / CA_FOLDER / CA_CERT)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    for user in USERS:
        cert = _cert(out / user / CERT)
        assert _cn(cert) == user
        cert.verify_directly_issued_by(ca)
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert list(usages) == [ExtendedKeyUsageOID.CLIENT_AUTH]
        assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
        lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
        assert datetime.timedelta(days=30) <= lifetime <= datetime.timedelta(days=30, minutes=10)
    _cert(out / SERVER_FOLDER / CERT).verify_directly_issued_by(ca)


def test_existing_files_are_kept_unless_forced(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "certs"
    assert dev_certs_main(["--out", str(out)]) == 0
    first = (out / CA_FOLDER / CA_CERT).read_bytes()
    assert dev_certs_main(["--out", str(out)]) == 1
    assert "--force" in capsys.readouterr().err
    assert (out / CA_FOLDER / CA_CERT).read_bytes() == first
    assert dev_certs_main(["--out", str(out), "--force"]) == 0
    assert (out / CA_FOLDER / CA_CERT).read_bytes() != first


def test_if_missing_keeps_a_whole_set_and_refuses_a_partial_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "certs"
    assert dev_certs_main(["--out", str(out), "--if-missing"]) == 0
    first = (out / ROOT_USER / CERT).read_bytes()
    assert dev_certs_main(["--out", str(out), "--if-missing"]) == 0
    assert "kept" in capsys.readouterr().out
    assert (out / ROOT_USER / CERT).read_bytes() == first
    # A set missing one file cannot be completed without its CA's other certificates changing.
    (out / ROOT_USER / KEY).unlink()
    assert dev_certs_main(["--out", str(out), "--if-missing"]) == 1
    assert not (out / ROOT_USER / KEY).exists()


def test_owner_gives_every_file_and_folder_away(tmp_path: Path) -> None:
    uid, gid = os.getuid(), os.getgid()
    assert dev_certs_main(["--out", str(tmp_path / "certs"), "--owner", f"{uid}:{gid}"]) == 0
    for path in [tmp_path / "certs", *(tmp_path / "certs").rglob("*")]:
        assert (path.stat().st_uid, path.stat().st_gid) == (uid, gid)
    assert dev_certs_main(["--out", str(tmp_path / "other"), "--owner", "kvplane"]) == 1


def test_nothing_is_written_when_one_file_is_in_the_way(tmp_path: Path) -> None:
    now = datetime.datetime.now(datetime.UTC)
    ca = Authority.create("test", now, 1)
    files = bundle_files(
        ca, ca.issue_server(["etcd"], now, 1), {ROOT_USER: ca.issue_client(ROOT_USER, now, 1)}
    )
    (tmp_path / ROOT_USER).mkdir()
    (tmp_path / ROOT_USER / CERT).write_bytes(b"mine")
    with pytest.raises(CredentialFilesExist):
        write_files(tmp_path, files, is_key)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == [
        ROOT_USER,
        f"{ROOT_USER}/{CERT}",
    ]


def test_user_limits_the_client_certificates_to_those_named(tmp_path: Path) -> None:
    out = tmp_path / "certs"
    assert dev_certs_main(["--out", str(out), "--user", ROOT_USER, "--user", "kvplane-metadata"]) == 0
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [CA_FOLDER, SERVER_FOLDER, ROOT_USER, "kvplane-metadata"]
    )
    assert _cn(_cert(out / "kvplane-metadata" / CERT)) == "kvplane-metadata"
