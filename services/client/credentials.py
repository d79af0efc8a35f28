"""What a kvplane client presents to the control plane: a bearer token, TLS, or both.

Used by the node agent (the vLLM connector's and the sim-engine's), the gateway's
routing client and `kvplane.services.client.RoutingClient`. Everything comes from
configuration: a token or a file holding it, PEM files for TLS. From the
environment (`from_env`, prefix `KVPLANE_CLIENT_` unless given):

    TOKEN, TOKEN_FILE               bearer token, or a file holding it
    TLS_CA_FILE                     CA of the servers' certificates; set: TLS
    TLS_CERT_FILE, TLS_KEY_FILE     this client's certificate (mTLS)
    TLS_SERVER_NAME                 the name to check the server's certificate against
    MESH_SECRET, MESH_SECRET_FILE   the mesh proxy's secret, only where no proxy adds it
                                    (development and tests)
    ALLOW_PLAINTEXT                 "true": a token or mesh secret may go without TLS to a
                                    target off this machine (a mesh that encrypts for the
                                    process, or development); read by every client

A token or mesh secret is never sent in clear off this machine unless allowed: a channel to a
target that is not loopback, without TLS, is refused (`PlaintextCredentials`) rather than
sending it silently.

A token or mesh-secret file is read again when it changes (`CallMetadata`), so a
rotated token is sent from the next call on; when a certificate file changes, calls from then on
go over a new channel made from the new files (`ReloadingChannel`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvplane.services.common.model.headers import MESH_SECRET_HEADER
from kvplane.services.common.model.loopback import loopback_target
from kvplane.services.common.runtime.reloading_channel import ReloadingChannel
from kvplane.services.common.runtime.secret_files import (
    FileStamp,
    SecretFileError,
    file_stamp,
    read_secret_file,
)
from kvplane.services.common.runtime.tls import ClientTlsFiles

log = logging.getLogger(__name__)

ALLOW_PLAINTEXT_ENV = "KVPLANE_CLIENT_ALLOW_PLAINTEXT"


def plaintext_allowed(env: Mapping[str, str] | None = None, name: str = ALLOW_PLAINTEXT_ENV) -> bool:
    """Whether the environment allows credentials in clear off this machine."""
    value = (os.environ if env is None else env).get(name, "")
    return value.strip().lower() in ("1", "true", "yes")


class PlaintextCredentials(ValueError):
    """A token or mesh secret would go without TLS to a target off this machine."""


@dataclass(frozen=True, slots=True)
class ClientCredentials:
    """A client's credentials; the default presents nothing (and is refused by every server)."""

    # The bearer token itself (prefer token_file: the environment shows in the process list).
    token: str = field(default="", repr=False)
    # A file holding the bearer token, read again when it changes.
    token_file: str = ""
    # The CA of the servers' certificates; set: TLS.
    tls_ca_file: str = ""
    # This client's certificate and key (mTLS); both or neither, and a CA with them.
    tls_cert_file: str = ""
    # This client's certificate and key (mTLS); both or neither, and a CA with them.
    tls_key_file: str = ""
    # The name the servers' certificates are checked against (default: the target's host).
    tls_server_name: str = ""
    # A mesh proxy's secret, only where no proxy adds it (development and tests).
    mesh_secret: str = field(default="", repr=False)
    # A file holding the mesh proxy's secret (development and tests).
    mesh_secret_file: str = ""
    # A token or mesh secret may go without TLS to a target off this machine; by default, what
    # KVPLANE_CLIENT_ALLOW_PLAINTEXT says.
    allow_plaintext: bool = field(default_factory=plaintext_allowed)

    def __post_init__(self) -> None:
        if self.token and self.token_file:
            raise ValueError("set token or token_file, not both")
        if self.mesh_secret and self.mesh_secret_file:
            raise ValueError("set mesh_secret or mesh_secret_file, not both")
        if (self.tls_cert_file or self.tls_key_file) and not self.tls_ca_file:
            raise ValueError("a client certificate needs tls_ca_file (the servers' CA)")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("a client certificate needs both tls_cert_file and tls_key_file")

    @property
    def tls(self) -> bool:
        return bool(self.tls_ca_file)

    def describe(self) -> str:
        """What is presented, for logs: never the secrets themselves."""
        parts = []
        if self.token or self.token_file:
            parts.append("bearer token" + (f" from {self.token_file}" if self.token_file else ""))
        if self.tls:
            parts.append("mTLS" if self.tls_cert_file else "TLS")
        if self.mesh_secret or self.mesh_secret_file:
            parts.append("mesh secret")
        return ", ".join(parts) or "no credentials"

    def call_metadata(self, extra: Sequence[tuple[str, str]] = ()) -> tuple[tuple[str, str], ...]:
        """Metadata for every call: the bearer token and mesh secret, then `extra`."""
        out: list[tuple[str, str]] = []
        token = read_secret_file(self.token_file, "client token") if self.token_file else self.token
        if token:
            out.append(("authorization", f"Bearer {token}"))
        secret = (
            read_secret_file(self.mesh_secret_file, "mesh secret")
            if self.mesh_secret_file
            else self.mesh_secret
        )
        if secret:
            out.append((MESH_SECRET_HEADER, secret))
        out.extend(extra)
        return tuple(out)

    def channel(
        self,
        target: str,
        *,
        options: Sequence[tuple[str, Any]] = (),
        interceptors: Sequence[Any] | None = None,
    ) -> grpc.aio.Channel:
        """A grpc.aio channel to `target`: TLS when a CA is configured (made again when its
        files change), else plaintext, which is refused (PlaintextCredentials) for a target off
        this machine when a secret would travel on it, unless allowed."""
        opts = list(options)
        if not self.tls:
            self.check_plaintext(target)
            return grpc.aio.insecure_channel(target, options=opts, interceptors=interceptors)
        if self.tls_server_name:
            opts.append(("grpc.ssl_target_name_override", self.tls_server_name))
        files = ClientTlsFiles(self.tls_ca_file, self.tls_cert_file, self.tls_key_file)
        return ReloadingChannel(target, files, options=opts, interceptors=interceptors)

    def check_plaintext(self, target: str) -> None:
        """Raises PlaintextCredentials when a token or mesh secret would go in clear off this
        machine without leave."""
        secret = self.token or self.token_file or self.mesh_secret or self.mesh_secret_file
        if secret and not self.tls and not self.allow_plaintext and not loopback_target(target):
            raise PlaintextCredentials(
                f"the bearer token or mesh secret would go in clear to {target}: set a TLS CA "
                f"(TLS_CA_FILE), or {ALLOW_PLAINTEXT_ENV}=true where the network encrypts for you "
                "(a service mesh) or for development"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str], prefix: str = "KVPLANE_CLIENT_") -> ClientCredentials:
        values: dict[str, Any] = {
            f.name: env[prefix + f.name.upper()]
            for f in dataclasses.fields(cls)
            if prefix + f.name.upper() in env and f.name != "allow_plaintext"
        }
        return cls(**values, allow_plaintext=plaintext_allowed(env, prefix + "ALLOW_PLAINTEXT"))

    def merged(self, **overrides: str) -> ClientCredentials:
        """These credentials with the non-empty `overrides` applied."""
        changed: dict[str, Any] = {k: v for k, v in overrides.items() if v}
        return dataclasses.replace(self, **changed)


class CallMetadata:
    """A client's call metadata, read again when its token or secret file changes.

    A file that cannot be read after a change keeps the last good metadata, with a warning:
    a rotation half-written must not take a running client down. Safe from any thread.
    """

    def __init__(self, credentials: ClientCredentials, extra: Sequence[tuple[str, str]] = ()) -> None:
        self._credentials = credentials
        self._extra = tuple(extra)
        self._files = tuple(f for f in (credentials.token_file, credentials.mesh_secret_file) if f)
        self._lock = threading.Lock()
        self._stamp = self._stamps()
        self._value = credentials.call_metadata(self._extra)  # fails loudly at start-up

    def _stamps(self) -> tuple[FileStamp, ...]:
        return tuple(file_stamp(path) for path in self._files)

    def current(self) -> tuple[tuple[str, str], ...]:
        if not self._files:
            return self._value
        stamp = self._stamps()
        if stamp == self._stamp:
            return self._value
        with self._lock:
            try:
                self._value = self._credentials.call_metadata(self._extra)
            except SecretFileError as exc:
                log.warning("credentials changed but cannot be read; keeping the previous ones: %s", exc)
            self._stamp = stamp
            return self._value
