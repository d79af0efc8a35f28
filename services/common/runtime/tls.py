"""TLS for kvplane's gRPC servers and clients, from PEM files.

Servers read their certificate, key and client CA again whenever one of the
files changes (checked at each new connection), so a rotated certificate is
served without a restart. Clients read theirs when a channel is made.

A verified client certificate's identities (its URI SANs) are what mTLS
authentication and the mesh-proxy check read (`certificate_ids`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509

from kvplane.services.common.runtime.secret_files import file_stamp

log = logging.getLogger(__name__)


class TlsConfigError(ValueError):
    """A TLS setting names a file that cannot be read, or an incomplete pair."""


def _read(path: str, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise TlsConfigError(f"{what} {path!r}: {exc.strerror or exc}") from None


@dataclass(frozen=True, slots=True)
class ServerTlsFiles:
    """A server's certificate chain and key, and the CA its clients' certificates must chain to."""

    cert_file: str
    key_file: str
    # Empty: clients are not asked for a certificate (TLS without mTLS).
    client_ca_file: str = ""

    @property
    def mutual(self) -> bool:
        return bool(self.client_ca_file)

    def _files(self) -> tuple[str, ...]:
        return tuple(f for f in (self.cert_file, self.key_file, self.client_ca_file) if f)

    def _configuration(self) -> grpc.ServerCertificateConfiguration:
        key = _read(self.key_file, "TLS key")
        chain = _read(self.cert_file, "TLS certificate")
        ca = _read(self.client_ca_file, "client CA") if self.client_ca_file else None
        return grpc.ssl_server_certificate_configuration([(key, chain)], root_certificates=ca)

    def server_credentials(self) -> grpc.ServerCredentials:
        """Credentials that re-read the files when they change, at the next handshake."""
        if not self.cert_file or not self.key_file:
            raise TlsConfigError("TLS needs both cert_file and key_file")
        lock = threading.Lock()
        seen = {f: file_stamp(f) for f in self._files()}
        initial = self._configuration()

        def fetch() -> grpc.ServerCertificateConfiguration | None:
            # Called by gRPC before each handshake; None keeps the current files.
            with lock:
                now = {f: file_stamp(f) for f in self._files()}
                if now == seen:
                    return None
                try:
                    config = self._configuration()
                except TlsConfigError as exc:
                    log.warning("TLS files changed but cannot be read; serving the previous ones: %s", exc)
                    return None
                seen.update(now)
                log.info("TLS certificate reloaded", extra={"cert_file": self.cert_file})
                return config

        # gRPC's stubs say the fetcher never returns None; gRPC takes None as "unchanged".
        return grpc.dynamic_ssl_server_credentials(
            initial,
            fetch,  # type: ignore[arg-type]
            require_client_authentication=self.mutual,
        )


@dataclass(frozen=True, slots=True)
class ClientTlsFiles:
    """The CA a client trusts, and the certificate it presents for mTLS (optional)."""

    ca_file: str
    cert_file: str = ""
    key_file: str = ""

    def channel_credentials(self) -> grpc.ChannelCredentials:
        if bool(self.cert_file) != bool(self.key_file):
            raise TlsConfigError("a client certificate needs both cert_file and key_file")
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file, "TLS CA"),
            private_key=_read(self.key_file, "TLS key") if self.key_file else None,
            certificate_chain=_read(self.cert_file, "TLS certificate") if self.cert_file else None,
        )


def certificate_ids(auth_context: Mapping[str, Iterable[bytes]]) -> tuple[str, ...]:
    """The URI SANs of the peer's verified certificate; empty without one.

    gRPC puts the peer's certificate in the auth context only once the
    handshake verified it against the server's client CA.
    """
    pems = list(auth_context.get("x509_pem_cert", ()))
    if not pems:
        return ()
    try:
        cert = x509.load_pem_x509_certificate(pems[0])
        sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return ()
    return tuple(str(uri) for uri in sans.get_values_for_type(x509.UniformResourceIdentifier))
