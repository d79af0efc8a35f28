"""One typed settings object for every kvplane process.

Sources, lowest to highest precedence: defaults, a YAML file (--config or
KVPLANE_CONFIG), environment variables (KVPLANE_<SECTION>__<FIELD>, e.g.
KVPLANE_ETCD__ENDPOINTS='["10.0.0.1:2379"]'), then command-line flags.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

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
from kvplane.services.common.runtime.secret_files import read_secret_file
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
    # TLS to etcd: its CA (set: TLS), and a client certificate for --client-cert-auth (PEM files).
    tls_ca_file: str = ""
    tls_cert_file: str = ""
    tls_key_file: str = ""
    tls_server_name: str = ""
    # etcd's own authentication (auth enabled in etcd); the password may come from a file.
    user: str = ""
    password: SecretStr = SecretStr("")
    password_file: str = ""

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
        return self

    def secret(self) -> str:
        if self.token_file:
            return read_secret_file(self.token_file, f"token of {self.name!r}")
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
    # (kvplane://{kind}/{name}; needs grpc.tls with a client CA); "mesh": identity headers,
    # believed only from an authenticated mesh proxy (see `mesh`).
    mode: Literal["token", "mtls", "mesh"] | None = None
    tokens: list[TokenEntry] = Field(default_factory=list)
    # More token entries, from a file holding a JSON or YAML list shaped like `tokens` (a
    # Kubernetes Secret volume). It and every entry's token_file are read again when they change,
    # so tokens are added, rotated and revoked without a restart.
    tokens_file: str = ""
    mesh: MeshSection = Field(default_factory=MeshSection)
    # Whether tenants may call Route and CheckOutHandle themselves, which answer with engine
    # addresses. Off: tenants reach kvplane only through the gateway (an operator principal).
    tenants_see_engines: bool = False

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
        principals = {
            entry.secret(): Principal(
                PrincipalKind(entry.kind),
                entry.name,
                (entry.tenant or entry.name) if entry.kind == "tenant" else "",
            )
            for entry in entries
        }
        files = [self.tokens_file, *(e.token_file for e in entries)]
        return TokenAuthenticator(principals), [f for f in files if f]

    def _file_entries(self) -> list[TokenEntry]:
        if not self.tokens_file:
            return []
        try:
            listed = yaml.safe_load(read_secret_file(self.tokens_file, "auth.tokens_file"))
        except yaml.YAMLError as exc:
            raise ValueError(f"auth.tokens_file {self.tokens_file!r}: not JSON or YAML: {exc}") from None
        if not isinstance(listed, list):
            raise ValueError(f"auth.tokens_file {self.tokens_file!r}: expected a list of token entries")
        return [TokenEntry.model_validate(item) for item in listed]


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
    tls: ServerTlsSection = Field(default_factory=ServerTlsSection)
    # gRPC server reflection lists every method and message; off unless wanted (debugging).
    reflection: bool = False


class MetadataSection(Section):
    default_lease_ttl_s: int = Field(10, ge=2, le=300)
    # How often the node reaper sweeps for handles of vanished nodes, seconds.
    reaper_interval_s: float = 5.0
    # A checked-out handle nobody read within this long is released (its turn never reached P),
    # seconds. Longer than a turn's wait in P's queue plus the gateway's prefill timeout.
    claim_deadline_s: float = Field(60.0, gt=0)
    # How often the claim reaper sweeps, seconds.
    claim_sweep_interval_s: float = Field(2.0, gt=0)


class EvictionSection(BaseModel):
    """`eviction:` in the settings file (KVPLANE_EVICTION__<FIELD> in the environment)."""

    # The election key's name; replicas of one coordinator share it.
    election_name: str = "eviction"
    # This replica's id in the election; empty: host, pid and a random suffix.
    replica_id: str = ""
    # The leader's etcd lease TTL, seconds: a killed leader is replaced within it.
    lease_ttl_s: int = Field(10, ge=2, le=300)
    # How often policies are evaluated when nothing changes, seconds.
    evaluate_interval_s: float = Field(1.0, gt=0)
    # How often the leader sweeps for handles of unregistered nodes, seconds.
    orphan_sweep_interval_s: float = Field(10.0, gt=0)
    # Release transactions in flight at once.
    release_concurrency: int = Field(16, ge=1, le=1024)
    # Conversations silent this long count as ended for the gap statistics, seconds.
    gap_horizon_s: float = Field(3600.0, gt=0)
    # Retention policy YAML (see kvplane.services.eviction.policy.pipeline);
    # `policy` inline wins over the file; neither: the built-in default.
    policy_file: str = ""
    policy: dict[str, Any] | None = None


class RoutingSection(Section):
    # Routing policy YAML (services/routing/policy/config.py); empty: the packaged default.
    policy_file: str = ""
    # Longest a Route waits on the check-out transaction before recomputing, seconds.
    checkout_timeout_s: float = Field(1.0, gt=0)
    # D's decoder_kv_blocks_ttl: how long a handle published by ReportTurn lives, seconds.
    decode_kv_ttl_s: float = Field(480.0, gt=0)
    # Subtracted from that life to give the handle's wall-clock expiry, seconds.
    expiry_margin_s: float = Field(5.0, ge=0)
    # Conversations whose last prefill node is remembered (best effort, per replica).
    max_tracked_conversations: int = Field(100_000, ge=0)
    # Routes remembered for ReportTurn (per replica).
    max_tracked_routes: int = Field(100_000, ge=0)
    # Longest a Route waits for the engine's publish of the handle its caller says the previous
    # turn retained (RouteRequest.awaited_handle_id), and only when no prefill node is believed to
    # hold the history already, seconds. Also bounds EndConversation's wait for that publish.
    publish_wait_s: float = Field(0.3, ge=0)


def engine_url_list(value: Any) -> list[str]:
    """Engine base URLs from a list, a JSON list, or one string of comma-separated URLs.

    Each must be an absolute http(s) URL with a host; a malformed entry is an error naming it,
    never silently dropped (a typo would otherwise leave one engine fewer to fail over to).
    """
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            try:
                value = json.loads(text)
            except ValueError as exc:
                raise ValueError(f"not a JSON list of URLs: {text!r} ({exc})") from None
        else:
            value = [] if not text else [part.strip() for part in text.split(",")]
    if not isinstance(value, list | tuple):
        raise ValueError(f"expected a URL, a list of URLs or comma-separated URLs, got {value!r}")
    urls: list[str] = []
    for entry in value:
        if not isinstance(entry, str) or not entry.strip():
            raise ValueError(f"empty or non-string entry {entry!r} in the URL list {value!r}")
        url = entry.strip()
        try:
            parts = urlsplit(url)
            port = parts.port  # raises on a port that is not a number in range
        except ValueError as exc:
            raise ValueError(f"{url!r} is not a valid URL: {exc}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"{url!r} is not an http(s) URL with a host (e.g. http://10.0.0.5:8100)")
        if parts.query or parts.fragment or port == 0:
            raise ValueError(f"{url!r} is not an engine base URL (no query, fragment or port 0)")
        if url.rstrip("/") in (u.rstrip("/") for u in urls):
            raise ValueError(f"{url!r} is listed twice")
        urls.append(url)
    return urls


class GatewayKey(Section):
    token: SecretStr
    tenant: str


class GatewaySection(Section):
    # HTTP listen address of the OpenAI-compatible front, host:port.
    listen: str = "127.0.0.1:8080"
    # Routing service replicas, host:port each.
    routing: list[str] = Field(default_factory=lambda: ["127.0.0.1:50051"])
    # Credentials the gateway presents to routing (`kvplane.services.gateway.app.routing_credentials`):
    # an operator token (or a file holding it); TLS to routing with its CA, and a client certificate
    # for mTLS.
    routing_token: SecretStr = SecretStr("")
    routing_token_file: str = ""
    routing_tls_ca_file: str = ""
    routing_tls_cert_file: str = ""
    routing_tls_key_file: str = ""
    routing_tls_server_name: str = ""

    # A Route's whole deadline, seconds. Above routing's check-out timeout (1 s): a Route cut short
    # may already have taken the handle.
    routing_timeout_s: float = Field(2.0, gt=0)
    # A routing replica silent this long has its health checked (a frozen process still accepts
    # TCP, so only a deadline tells), and the Route goes to the next replica as well, first answer
    # wins (hedging covers speed). Seconds.
    routing_hedge_after_s: float = Field(0.2, gt=0)
    # The health check's deadline: it judges liveness, not speed. A replica that is refused or
    # errs is suspect at once; one that stays silent this long is frozen or gone, and is skipped
    # by every later turn until it answers (with none left, turns fall back at once). A replica
    # that is only busy answers within it. Seconds.
    routing_liveness_timeout_s: float = Field(2.0, gt=0)
    routing_attempts: int = Field(2, ge=1)
    # API keys clients present (Authorization: Bearer, or x-api-key), each mapped to its tenant.
    api_keys: list[GatewayKey] = Field(default_factory=list)
    # More API keys, from a file holding a JSON or YAML list of {token, tenant} (a Kubernetes
    # Secret volume), read again when it changes: keys are added, rotated and revoked without a
    # restart.
    api_keys_file: str = ""
    # Development only: the tenant of requests that carry no key at all. Empty: such requests get 401.
    default_tenant: str = ""
    # Used while routing is unreachable: engines that recompute every turn, P and D each a list of
    # base URLs (a YAML list, or one string of comma-separated URLs, e.g. from the environment).
    # Turns rotate over each list. Both empty: 503. One URL each: the single fallback pair.
    fallback_prefill_url: Annotated[list[str], NoDecode] = Field(default_factory=list)
    fallback_decode_url: Annotated[list[str], NoDecode] = Field(default_factory=list)
    # A fallback engine whose leg just failed (refused, reset, timed out) is skipped for this long
    # while another is configured, seconds; then tried again.
    fallback_suspect_s: float = Field(5.0, gt=0)

    @field_validator("fallback_prefill_url", "fallback_decode_url", mode="before")
    @classmethod
    def _url_list(cls, value: Any) -> Any:
        return engine_url_list(value)

    @model_validator(mode="after")
    def _fallback_engines_in_pairs(self) -> GatewaySection:
        if bool(self.fallback_prefill_url) != bool(self.fallback_decode_url):
            raise ValueError(
                "fallback_prefill_url and fallback_decode_url go together: set both (a turn needs a "
                "P and a D) or neither"
            )
        return self

    # The gateway's event loop: on uvloop (libuv) a turn took about a sixth less of the gateway's CPU
    # than on asyncio's own loop (kvplane.bench.gateway_bench); `asyncio` is there to rule it out.
    event_loop: Literal["uvloop", "asyncio"] = "uvloop"
    # Deadlines of the engine legs, seconds. The decode leg's idle limit applies between chunks.
    prefill_timeout_s: float = Field(30.0, gt=0)
    decode_timeout_s: float = Field(600.0, gt=0)
    decode_idle_timeout_s: float = Field(60.0, gt=0)
    connect_timeout_s: float = Field(2.0, gt=0)
    report_timeout_s: float = Field(2.0, gt=0)
    # An engine base URL offering vLLM's /tokenize, for the token ids of text prompts. Empty: none.
    tokenize_url: str = ""
    # Served model names for /v1/models. Empty: asks the fallback decode engine, if any.
    models: list[str] = Field(default_factory=list)
    # Largest request body accepted, bytes: refused from Content-Length before reading, and while reading.
    max_body_bytes: int = Field(16 << 20, gt=0)
    # A request head (request line and headers) must arrive within this, seconds; also the idle
    # keep-alive limit of a client connection.
    header_timeout_s: float = Field(10.0, gt=0)
    # A request body must arrive within this once its head is in, seconds.
    body_timeout_s: float = Field(30.0, gt=0)
    # Deepest nesting of JSON arrays and objects accepted in a body.
    max_json_depth: int = Field(32, ge=2)
    # The engines' vocabulary size, to refuse out-of-range token ids up front; 0: unknown (ids < 2^32).
    vocab_size: int = Field(0, ge=0)
    # The engines' context length in tokens, to refuse up front what D would reject; 0: unknown.
    max_model_len: int = Field(0, ge=0)
    # vLLM's prefix-cache isolation (`cache_salt`): "tenant" (each tenant its own cache), "group"
    # (tenants in one `tenant_groups` group share theirs) or "off" (one cache for all: timing then
    # tells one tenant what another recently sent).
    cache_salt: Literal["tenant", "group", "off"] = "tenant"
    # Key of the salt's HMAC, so that a salt names no tenant. Gateways sharing engines must share
    # it, else each salts differently and their turns miss each other's cache. Empty: random.
    cache_salt_key: SecretStr = SecretStr("")
    # Tenant -> group name, for cache_salt "group"; a tenant in no group is alone.
    tenant_groups: dict[str, str] = Field(default_factory=dict)
    # Most prompt tokens one tenant may have in flight at once: a bound on the KV its turns hold on
    # any engine between the P and D legs. 0: unbounded.
    max_inflight_tokens_per_tenant: int = Field(1 << 20, ge=0)
    # HTTPS: the server certificate and its key (PEM files, re-read when they change). Empty: HTTP.
    tls_cert_file: str = ""
    tls_key_file: str = ""


class KvplaneSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVPLANE_", env_nested_delimiter="__", extra="forbid")

    grpc: GrpcSection = Field(default_factory=GrpcSection)
    etcd: EtcdSection = Field(default_factory=EtcdSection)
    telemetry: TelemetrySection = Field(default_factory=TelemetrySection)
    auth: AuthSection = Field(default_factory=AuthSection)
    metadata: MetadataSection = Field(default_factory=MetadataSection)
    eviction: EvictionSection = Field(default_factory=EvictionSection)
    routing: RoutingSection = Field(default_factory=RoutingSection)
    gateway: GatewaySection = Field(default_factory=GatewaySection)

    @model_validator(mode="after")
    def _mtls_needs_a_client_ca(self) -> KvplaneSettings:
        if self.auth.mode == "mtls" and not (self.grpc.tls.cert_file and self.grpc.tls.client_ca_file):
            raise ValueError("auth.mode mtls needs grpc.tls: cert_file, key_file and client_ca_file")
        return self

    @classmethod
    def load(cls, config_file: str | None = None, overrides: dict[str, Any] | None = None) -> KvplaneSettings:
        """Defaults < file < environment < `overrides` (from flags)."""
        path = config_file or os.environ.get("KVPLANE_CONFIG")
        file_values: dict[str, Any] = {}
        if path:
            loaded = yaml.safe_load(Path(path).read_text())
            if not isinstance(loaded, dict):
                raise ValueError(f"{path}: expected a mapping at the top level")
            file_values = loaded
        env_values = cls().model_dump(exclude_unset=True)
        merged = _merge(_merge(file_values, env_values), overrides or {})
        return cls.model_validate(merged)

    def masked_json(self) -> str:
        """The effective settings with secrets masked, for the start-up log."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True)


def _merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out
