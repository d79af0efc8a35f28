"""The settings sections every kvplane process shares: etcd, telemetry, authentication, gRPC.

Each service's own section lives beside it (`metadata/settings.py`, `routing/settings.py`,
`eviction/settings.py`, `gateway/settings.py`); `kvplane.services.settings` composes them all into
the one typed settings object a process loads.
"""

from __future__ import annotations

import logging
import os
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SecretStr, model_validator

from kvplane.services.common.model.loopback import loopback_target
from kvplane.services.common.runtime.auth import (
    Authenticator,
    CertificateAuthenticator,
    MeshAuthenticator,
    Principal,
    PrincipalKind,
    ReloadingAuthenticator,
    TenantsSeeEngines,
    TokenAuthenticator,
)
from kvplane.services.common.runtime.secret_files import SecretFileError, read_secret_file
from kvplane.services.common.runtime.tls import ServerTlsFiles
from kvplane.services.common.store import StoreSettings
from kvplane.services.common.store.etcd_credentials import EtcdCredentials

log = logging.getLogger(__name__)


class Section(BaseModel):
    """A settings section: a misspelt key is an error, not silently ignored."""

    model_config = ConfigDict(extra="forbid")


class EtcdSection(Section):
    endpoints: list[str] = Field(default_factory=lambda: ["127.0.0.1:2379"])
    prefix: str = "/kvplane/v1/"
    request_timeout_s: float = 2.0
    settle_timeout_s: float = 10.0
    # A process whose etcd calls (or cluster watch) have gone unanswered this long reports
    # NOT_SERVING on its health service (so `kvplane health` and probes fail) until etcd answers.
    unreachable_after_s: float = Field(5.0, gt=0)
    # TLS to etcd: its CA (set: TLS), and a client certificate for --client-cert-auth (PEM files).
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_server_name: str = ""
    # etcd's own authentication (auth enabled in etcd); the password may come from a file.
    user: str = ""
    password: SecretStr = SecretStr("")
    password_file: str = ""
    # Development only: send the etcd password without TLS to a member that is not on loopback.
    allow_plaintext_password: bool = False
    # Development only: reach etcd members that are not on loopback without TLS (tls_ca_file) or
    # without credentials (a client certificate, or an etcd user). etcd holds every tenant's
    # handles and where every engine is: whoever reaches it unauthenticated can read the one and
    # rewrite the other, so off loopback it is refused unless this says otherwise.
    allow_insecure: bool = False

    @model_validator(mode="after")
    def _no_silent_plaintext(self) -> EtcdSection:
        """An https:// endpoint without trust roots, or a password in clear over the network, is
        refused: never downgraded to plaintext without a word."""
        if not self.tls_ca_file:
            https = [e for e in self.endpoints if e.strip().lower().startswith("https://")]
            if https:
                raise ValueError(
                    f"etcd endpoint {https[0]} asks for TLS but etcd.tls_ca_file is not set: "
                    "give the CA of etcd's certificate (nothing is sent in clear instead)"
                )
            remote = [e for e in self.endpoints if not loopback_target(e)]
            has_password = bool(self.password.get_secret_value() or self.password_file)
            if has_password and remote and not self.allow_plaintext_password:
                raise ValueError(
                    f"the etcd password would go in clear to {remote[0]}: set etcd.tls_ca_file "
                    "(TLS), or etcd.allow_plaintext_password for development"
                )
        remote = [e for e in self.endpoints if not loopback_target(e)]
        if remote and not self.allow_insecure:
            missing = [
                *([] if self.tls_ca_file else ["TLS (etcd.tls_ca_file)"]),
                *(
                    []
                    if self.tls_cert_file or self.user
                    else ["credentials (etcd.tls_cert_file or etcd.user)"]
                ),
            ]
            if missing:
                raise ValueError(
                    f"etcd member {remote[0]} is not on loopback and would be reached without "
                    f"{' or '.join(missing)}: set them, or etcd.allow_insecure for development"
                )
        return self

    def store_settings(self) -> StoreSettings:
        password = self.password.get_secret_value()
        if self.password_file:
            password = read_secret_file(self.password_file, "etcd password")
        return StoreSettings(
            endpoints=tuple(self.endpoints),
            prefix=self.prefix,
            request_timeout_s=self.request_timeout_s,
            settle_timeout_s=self.settle_timeout_s,
            credentials=EtcdCredentials(
                ca_file=self.tls_ca_file,
                cert_file=self.tls_cert_file,
                key_file=self.tls_key_file,
                server_name=self.tls_server_name,
                user=self.user,
                password=password,
                password_file=self.password_file,
            ),
        )


class TelemetrySection(Section):
    # OTLP/gRPC collector; empty: OTEL_EXPORTER_OTLP_ENDPOINT if set, else no export.
    otlp_endpoint: str = ""
    # Share of new traces kept (ignored when OTEL_TRACES_SAMPLER is set).
    sample_ratio: float = Field(1.0, ge=0.0, le=1.0)
    # Also start traces for heartbeats, load reports, health checks and background etcd requests.
    trace_background: bool = False
    metrics_host: str = "127.0.0.1"
    # 0 disables the Prometheus endpoint.
    metrics_port: int = 9464
    log_level: str = "info"
    json_logs: bool = True


# The shortest bearer token accepted: shorter ones can be guessed.
MIN_TOKEN_CHARS = 16


def _strong(token: str, name: str) -> str:
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(
            f"token entry {name!r}: a token of {len(token)} characters can be guessed; use at least "
            f"{MIN_TOKEN_CHARS} (e.g. `openssl rand -hex 24`)"
        )
    return token


class TokenEntry(Section):
    # The bearer token itself, or a file holding it (read again when it changes; surrounding
    # whitespace dropped).
    token: SecretStr = SecretStr("")
    token_file: str = ""
    kind: Literal["tenant", "node", "operator"] = "tenant"
    # The principal's name: the tenant, the node id (a node token acts only as this node), or the operator.
    name: str
    tenant: str = ""

    @model_validator(mode="after")
    def _one_source(self) -> TokenEntry:
        if bool(self.token.get_secret_value()) == bool(self.token_file):
            raise ValueError(f"token entry {self.name!r}: set exactly one of token and token_file")
        if self.kind == "node" and (not self.name.rstrip("*") or "*" in self.name.rstrip("*")):
            # `d*` covers one Deployment's pods; `*` alone would be every node.
            raise ValueError(
                f"token entry {self.name!r}: a node token's name is a node id, or a prefix ending in *"
            )
        if self.token.get_secret_value():
            _strong(self.token.get_secret_value(), self.name)
        return self

    def secret(self) -> str:
        if self.token_file:
            return _strong(read_secret_file(self.token_file, f"token of {self.name!r}"), self.name)
        return self.token.get_secret_value()


class MeshSection(Section):
    # Shared secrets the mesh proxy adds as x-kvplane-mesh-secret (several: rotation), or files holding them.
    secrets: list[SecretStr] = Field(default_factory=list)
    secret_files: list[str] = Field(default_factory=list)
    # Client-certificate identities (URI SANs) of trusted proxies, besides any kvplane://mesh/... one.
    proxy_identities: list[str] = Field(default_factory=list)


class AuthSection(Section):
    # Required by `kvplane serve`; there is no default, so nothing runs open by accident.
    # "token": bearer tokens below; "mtls": the client certificate names the principal
    # (kvplane://{kind}/{name}; needs grpc.tls with a client CA); "mesh" (experimental, see
    # `mesh_experimental`): identity headers, believed only from an authenticated mesh proxy (see
    # `mesh`).
    mode: Literal["token", "mtls", "mesh"] | None = None
    # Acknowledges that "mesh" mode is experimental: without it, settings in mesh mode are refused.
    # Its identity headers bind no identity the proxy verified: whoever holds the mesh secret (or a
    # kvplane://mesh/ certificate) names any principal in them, tenant, node or operator. Token and
    # mtls modes bind each credential to one principal. Acknowledged, a server warns at start.
    mesh_experimental: bool = False
    tokens: list[TokenEntry] = Field(default_factory=list)
    # More token entries, from a file holding a JSON or YAML list shaped like `tokens` (a
    # Kubernetes Secret volume). It and every entry's token_file are read again when they change,
    # so tokens are added, rotated and revoked without a restart.
    tokens_file: str = ""
    mesh: MeshSection = Field(default_factory=MeshSection)
    # Whether tenants may call Route and CheckOutHandle themselves, which answer with engine
    # addresses. Off: tenants reach kvplane only through the gateway (an operator principal).
    tenants_see_engines: bool = False
    # Whether the tokens file was read whole once (then deleting or emptying it revokes its tokens).
    _tokens_file_loaded: bool = PrivateAttr(default=False)

    @model_validator(mode="after")
    def _mesh_only_acknowledged(self) -> AuthSection:
        if self.mode == "mesh" and not self.mesh_experimental:
            raise ValueError(
                "auth.mode mesh is experimental, refused unless auth.mesh_experimental is true: its "
                "identity headers bind no identity the proxy verified, so anyone holding the mesh "
                "secret chooses any principal (use token or mtls; see THREAT_MODEL.md)"
            )
        return self

    def authenticator(self) -> Authenticator:
        inner = self._authenticator()
        return TenantsSeeEngines(inner) if self.tenants_see_engines else inner

    def _authenticator(self) -> Authenticator:
        if self.mode is None:
            raise ValueError(
                "auth.mode is required: token, mtls or mesh (KVPLANE_AUTH__MODE); nothing is served open"
            )
        if self.mode == "mtls":
            return CertificateAuthenticator()
        if self.mode == "mesh":
            log.warning(
                "auth.mode mesh is experimental (auth.mesh_experimental): the identity headers bind "
                "no identity the proxy verified; anyone holding the mesh secret or a kvplane://mesh/ "
                "certificate chooses any principal"
            )
            if not (self.mesh.secrets or self.mesh.secret_files or self.mesh.proxy_identities):
                # Certificates naming kvplane://mesh/... still work; say what trusts the headers.
                log.info("mesh mode: identity headers trusted only from kvplane://mesh/ client certificates")
            return ReloadingAuthenticator(self._mesh_authenticator)
        return ReloadingAuthenticator(self._token_authenticator)

    def _mesh_authenticator(self) -> tuple[Authenticator, list[str]]:
        secrets = [s.get_secret_value() for s in self.mesh.secrets]
        secrets += [read_secret_file(f, "mesh secret") for f in self.mesh.secret_files]
        return MeshAuthenticator(secrets, self.mesh.proxy_identities), list(self.mesh.secret_files)

    def _token_authenticator(self) -> tuple[Authenticator, list[str]]:
        entries = [*self.tokens, *self._file_entries()]
        principals: dict[str, Principal] = {}
        names: dict[str, str] = {}
        for entry in entries:
            secret = entry.secret()
            if secret in principals:
                # Which of the two would win is an accident of order: refuse both.
                raise ValueError(f"token entries {names[secret]!r} and {entry.name!r} share one token")
            names[secret] = entry.name
            principals[secret] = Principal(
                PrincipalKind(entry.kind),
                entry.name,
                (entry.tenant or entry.name) if entry.kind == "tenant" else "",
            )
        files = [self.tokens_file, *(e.token_file for e in entries)]
        return TokenAuthenticator(principals), [f for f in files if f]

    def _file_entries(self) -> list[TokenEntry]:
        """The tokens file's entries. Once loaded, a file that is deleted or emptied revokes every
        token it listed (the inline `tokens` stay), said at error level on every check until it is
        back: deleting the file is how all of its tokens are revoked at once. At start-up such a
        file fails loudly instead; a half-written one keeps the previous tokens (ReloadingAuthenticator)."""
        if not self.tokens_file:
            return []
        try:
            text = read_secret_file(self.tokens_file, "auth.tokens_file")
        except SecretFileError as exc:
            gone = not os.path.exists(self.tokens_file) or "is empty" in str(exc)
            if not (gone and self._tokens_file_loaded):
                raise
            log.error(
                "auth.tokens_file %r is deleted or empty: every token it listed is revoked "
                "(inline tokens stay)",
                self.tokens_file,
            )
            return []
        try:
            listed = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"auth.tokens_file {self.tokens_file!r}: not JSON or YAML: {exc}") from None
        if not isinstance(listed, list):
            raise ValueError(f"auth.tokens_file {self.tokens_file!r}: expected a list of token entries")
        entries = [TokenEntry.model_validate(item) for item in listed]
        self._tokens_file_loaded = True
        return entries


class ServerTlsSection(Section):
    # PEM files; empty cert_file: plaintext (loopback development only). Re-read when they change.
    cert_file: str = ""
    key_file: str = ""
    # CA that client certificates must chain to; set: clients must present one (mTLS).
    client_ca_file: str = ""

    def files(self) -> ServerTlsFiles | None:
        if not self.cert_file:
            return None
        return ServerTlsFiles(self.cert_file, self.key_file, self.client_ca_file)


class GrpcSection(Section):
    listen: str = "127.0.0.1:50051"
    grace_s: float = 5.0
    # The event loop `kvplane serve` runs on. On uvloop (libuv) the services' per-turn CPU is lower
    # than on asyncio's own loop, whose selector and callback dispatch are Python
    # (bench/compare.py's CPU per turn of `serve`); `asyncio` is there to rule it out.
    event_loop: Literal["uvloop", "asyncio"] = "uvloop"
    tls: ServerTlsSection = Field(default_factory=ServerTlsSection)
    # gRPC server reflection lists every method and message; off unless wanted (debugging).
    reflection: bool = False
