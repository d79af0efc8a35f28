"""The certificates an etcd for kvplane needs, and the files they are written to.

A CA; etcd's server certificate, naming every address clients reach it by (its SANs); and a
client certificate per etcd user, whose Common Name is the user (etcd's `--client-cert-auth`
reads it). Keys are ECDSA P-256, signed with SHA-256, by the `cryptography` package.

Each holder gets a folder of its own, laid out as a Kubernetes TLS Secret is (`ca.crt`,
`tls.crt`, `tls.key`), so that a container mounts only its own: `ca/` (the CA's certificate and
key, for issuing more), `etcd-server/`, and one folder per user (`bundle_files`); keys are
written 0600 (`is_key`, by `kvplane.services.dev.credential_files`).
"""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_FOLDER = "ca"
SERVER_FOLDER = "etcd-server"
CA_CERT = "ca.crt"
CA_KEY = "ca.key"
CERT = "tls.crt"
KEY = "tls.key"
# Certificates back-date their start by this much: a clock a little behind still accepts them.
_SKEW = datetime.timedelta(minutes=5)


@dataclass(frozen=True, slots=True)
class Issued:
    """A certificate and its private key, PEM-encoded."""

    cert: bytes
    key: bytes = field(repr=False)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def subject_alt_names(names: Sequence[str]) -> list[x509.GeneralName]:
    """Each name as an IP address SAN when it is one, else as a DNS name SAN."""
    out: list[x509.GeneralName] = []
    for name in names:
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            out.append(x509.DNSName(name))
    return out


_LEAF_USAGE = x509.KeyUsage(
    digital_signature=True,
    content_commitment=False,
    key_encipherment=False,
    data_encipherment=False,
    key_agreement=True,
    key_cert_sign=False,
    crl_sign=False,
    encipher_only=False,
    decipher_only=False,
)


class Authority:
    """A CA that issues etcd's server certificate and its users' client certificates."""

    def __init__(self, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> None:
        self.cert = cert
        self._key = key

    @classmethod
    def create(cls, name: str, now: datetime.datetime, days: int) -> Authority:
        """A new self-signed CA, valid from `now` (less a little skew) for `days` days."""
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _SKEW)
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )
        return cls(cert, key)

    @property
    def issued(self) -> Issued:
        """The CA's own certificate and key."""
        return Issued(self.cert.public_bytes(serialization.Encoding.PEM), _key_pem(self._key))

    def _issue(
        self,
        common_name: str,
        usages: Sequence[x509.ObjectIdentifier],
        sans: Sequence[str],
        now: datetime.datetime,
        days: int,
    ) -> Issued:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - _SKEW)
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_LEAF_USAGE, critical=True)
            .add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self._key.public_key()), critical=False
            )
        )
        if sans:
            builder = builder.add_extension(
                x509.SubjectAlternativeName(subject_alt_names(sans)), critical=False
            )
        cert = builder.sign(self._key, hashes.SHA256())
        return Issued(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))

    def issue_server(self, sans: Sequence[str], now: datetime.datetime, days: int) -> Issued:
        """etcd's serving certificate for `sans` (host names and addresses). It may also act as a
        client: etcd's gRPC gateway calls etcd itself with it."""
        if not sans:
            raise ValueError("etcd's server certificate needs at least one name or address (SAN)")
        usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
        return self._issue(SERVER_FOLDER, usages, sans, now, days)

    def issue_client(self, user: str, now: datetime.datetime, days: int) -> Issued:
        """A client certificate whose Common Name is the etcd user `user`."""
        return self._issue(user, [ExtendedKeyUsageOID.CLIENT_AUTH], (), now, days)


def bundle_files(ca: Authority, server: Issued, clients: Mapping[str, Issued]) -> dict[str, bytes]:
    """Every file to write, by its path under the output folder."""
    ca_cert = ca.issued.cert
    files = {f"{CA_FOLDER}/{CA_CERT}": ca_cert, f"{CA_FOLDER}/{CA_KEY}": ca.issued.key}
    for folder, issued in {SERVER_FOLDER: server, **clients}.items():
        files[f"{folder}/{CA_CERT}"] = ca_cert
        files[f"{folder}/{CERT}"] = issued.cert
        files[f"{folder}/{KEY}"] = issued.key
    return files


def is_key(relative: str) -> bool:
    """Whether the file holds a private key (written 0600)."""
    return relative.endswith((f"/{KEY}", f"/{CA_KEY}"))
