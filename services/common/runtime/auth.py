"""Who is calling: a call's credentials -> a Principal, and what it may act on.

Closed by default: every mode answers a call that carries no identity with
UNAUTHENTICATED. The modes (settings `auth.mode`; there is no default):

- `token`: bearer tokens (`authorization: Bearer <t>` or `x-api-key`), each
  configured with its principal;
- `mtls`: the principal is named by the client certificate (a URI SAN
  `kvplane://{kind}/{name}`, see `peer_identity`), the certificate checked by
  the server's client CA;
- `mesh`: a sidecar proxy authenticates the caller and names it in headers
  (`x-kvplane-role`, `x-kvplane-tenant`, `x-kvplane-node`). Those headers are
  believed only from an authenticated proxy: a peer whose client certificate
  names a mesh proxy (`kvplane://mesh/{name}`), or a call carrying the
  proxy's shared secret (`x-kvplane-mesh-secret`). From anyone else they are
  ignored, and the call is unauthenticated. Experimental (settings refuse it
  unless `auth.mesh_experimental`): the headers are not bound to the identity
  the proxy verified, so any holder of the secret names any principal.

Principals are bound to what they may touch: a tenant acts only on its own
tenant, a node only as its own node id, and operator methods need an
operator. See THREAT_MODEL.md.
"""

from __future__ import annotations

import dataclasses
import enum
import hmac
import logging
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvplane.services.common.model import validation
from kvplane.services.common.model.errors import InvalidArgument, PermissionDenied, Unauthenticated
from kvplane.services.common.model.headers import (
    MESH_SECRET_HEADER,
    NODE_HEADER,
    OPERATOR_HEADER,
    ROLE_HEADER,
    TENANT_HEADER,
)
from kvplane.services.common.runtime.secret_files import file_stamp

log = logging.getLogger(__name__)


class PrincipalKind(enum.Enum):
    TENANT = "tenant"
    NODE = "node"
    OPERATOR = "operator"


@dataclass(frozen=True, slots=True)
class Principal:
    kind: PrincipalKind
    # The tenant's, node's or operator's name; for a node, its node id.
    name: str
    tenant: str = ""
    # A tenant that may be told engine addresses (auth.tenants_see_engines): it runs its turns
    # against the engines itself instead of through the gateway.
    sees_engines: bool = False

    def acts_for(self, requested_tenant: str, field: str = "tenant") -> str:
        """The tenant this call acts for; never a tenant caller's body field.

        Nodes never act for a tenant: a node credential must not read, check
        out or release any tenant's handles.
        """
        if self.kind is PrincipalKind.TENANT:
            if requested_tenant and requested_tenant != self.tenant:
                raise PermissionDenied(f"{field}: a tenant caller may act only on its own tenant")
            return self.tenant
        if self.kind is PrincipalKind.NODE:
            raise PermissionDenied("a node principal may not act on a tenant's handles")
        return validation.tenant(requested_tenant, field)

    def require_engine_access(self, method: str) -> None:
        """Tenants are told no engine address unless the deployment lets them drive engines."""
        if self.kind is PrincipalKind.TENANT and not self.sees_engines:
            raise PermissionDenied(
                f"{method} answers with engine addresses: tenants go through the gateway "
                "(auth.tenants_see_engines lets them call it themselves)"
            )

    def require(self, *kinds: PrincipalKind) -> None:
        if self.kind not in kinds:
            allowed = " or ".join(k.value for k in kinds)
            raise PermissionDenied(f"this call needs a {allowed} principal; caller is a {self.kind.value}")

    def may_be_node(self, node_id: str) -> bool:
        """Whether this node principal is `node_id`.

        A name ending in `*` covers the node ids it prefixes: the pods of one Kubernetes
        Deployment, whose node ids are their pod names, share one token. They can act as one
        another, never as a node outside the prefix (see THREAT_MODEL.md).
        """
        if self.name.endswith("*"):
            return node_id.startswith(self.name[:-1]) and len(node_id) > len(self.name) - 1
        return node_id == self.name

    def as_node(self, node_id: str, field: str, *, operator: bool = False) -> str:
        """`node_id` (already validated) when this caller may act as that node.

        A node principal acts only as itself; an operator only where `operator`.
        """
        if self.kind is PrincipalKind.NODE:
            if not self.may_be_node(node_id):
                raise PermissionDenied(f"{field}: a node may act only as its own node id")
            return node_id
        if operator and self.kind is PrincipalKind.OPERATOR:
            return node_id
        self.require(PrincipalKind.NODE, *((PrincipalKind.OPERATOR,) if operator else ()))
        return node_id


@dataclass(frozen=True, slots=True)
class CallCredentials:
    """What a call presents: its metadata (lower-cased keys), its peer address, and the
    identities its verified client certificate names (empty without mTLS)."""

    metadata: Mapping[str, str]
    peer: str = ""
    certificate_ids: tuple[str, ...] = ()


class Authenticator(Protocol):
    """Maps a call's credentials to a Principal, or raises Unauthenticated."""

    def authenticate(self, call: CallCredentials) -> Principal: ...


class TenantsSeeEngines:
    """`inner`, with its tenant principals allowed to be told engine addresses."""

    def __init__(self, inner: Authenticator) -> None:
        self._inner = inner

    def authenticate(self, call: CallCredentials) -> Principal:
        principal = self._inner.authenticate(call)
        if principal.kind is PrincipalKind.TENANT:
            return dataclasses.replace(principal, sees_engines=True)
        return principal


class ReloadingAuthenticator:
    """An authenticator built from files (tokens, mesh secrets), rebuilt when one of them changes.

    The files are checked at most every `check_interval_s`, on the calling thread (a few `stat`
    calls). A rebuild that fails (a half-written file, an invalid entry) keeps the previous
    credentials and says so at warning level: a bad rotation must not lock every caller out.
    `build` returns the authenticator and the files it was built from (which may change with it).
    """

    def __init__(
        self,
        build: Callable[[], tuple[Authenticator, Sequence[str]]],
        *,
        check_interval_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._build = build
        self._interval = check_interval_s
        self._clock = clock
        # At start-up a bad file fails loudly: nothing is served with credentials half-read.
        self._current, files = build()
        self._files = tuple(files)
        self._stamps = tuple(file_stamp(f) for f in self._files)
        self._next_check = clock() + check_interval_s

    def authenticate(self, call: CallCredentials) -> Principal:
        now = self._clock()
        if now >= self._next_check:
            self._next_check = now + self._interval
            self.reload_if_changed()
        return self._current.authenticate(call)

    def reload_if_changed(self) -> bool:
        """Rebuilds when a file changed; whether the credentials now in use are new ones."""
        stamps = tuple(file_stamp(f) for f in self._files)
        if stamps == self._stamps:
            return False
        self._stamps = stamps
        try:
            current, files = self._build()
        except (ValueError, OSError) as exc:
            log.warning("credential files changed but cannot be used; keeping the previous ones: %s", exc)
            return False
        self._current = current
        if tuple(files) != self._files:
            self._files = tuple(files)
            self._stamps = tuple(file_stamp(f) for f in self._files)
        log.info("credentials reloaded", extra={"files": list(self._files)})
        return True


def bearer_token(metadata: Mapping[str, str]) -> str:
    auth = metadata.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return metadata.get("x-api-key", "").strip()


class TokenAuthenticator:
    """Bearer tokens from configuration, each bound to one principal."""

    def __init__(self, tokens: Mapping[str, Principal]) -> None:
        # Compared as bytes in constant time; an empty token never matches.
        self._tokens = [(known.encode(), principal) for known, principal in tokens.items() if known]

    def authenticate(self, call: CallCredentials) -> Principal:
        token = bearer_token(call.metadata)
        if not token:
            raise Unauthenticated("no credentials: send 'authorization: Bearer <token>'")
        presented = token.encode("utf-8", "surrogatepass")
        found: Principal | None = None
        for known, principal in self._tokens:
            # No early exit: the time taken does not depend on which token matched.
            if hmac.compare_digest(known, presented):
                found = principal
        if found is None:
            raise Unauthenticated("unknown token")
        return found


class CertificateAuthenticator:
    """The principal a verified client certificate names (`kvplane://{kind}/{name}`).

    A certificate names exactly one kvplane identity: with several, which one counts would be a
    matter of their order, so such a certificate is refused. The name is taken as written (never
    percent-decoded) and must be a plain name (`valid_identity_name`): no wildcard, no separator,
    no control character can come from a certificate.
    """

    def authenticate(self, call: CallCredentials) -> Principal:
        identities = kvplane_identities(call.certificate_ids)
        if len(identities) > 1:
            raise Unauthenticated(
                f"the client certificate names {len(identities)} kvplane identities; exactly one is allowed"
            )
        for identity in identities:
            principal = principal_from_identity(identity)
            if principal is not None:
                return principal
            raise Unauthenticated("the client certificate's kvplane identity is not a valid principal")
        if call.certificate_ids:
            raise Unauthenticated("the client certificate names no kvplane principal")
        raise Unauthenticated("no credentials: present a client certificate")


class MeshAuthenticator:
    """Identity headers set by an authenticated mesh proxy.

    The proxy is authenticated by its client certificate (`kvplane://mesh/...`,
    or one of `proxy_identities`) or by the shared secret it adds to every call.
    """

    def __init__(self, secrets: Iterable[str], proxy_identities: Iterable[str] = ()) -> None:
        self._secrets = [s.encode() for s in secrets if s]
        self._proxies = frozenset(proxy_identities)

    def _from_proxy(self, call: CallCredentials) -> bool:
        identities = kvplane_identities(call.certificate_ids)
        if len(identities) > 1:
            raise Unauthenticated("the client certificate names several kvplane identities")
        for identity in call.certificate_ids:
            if identity in self._proxies or identity.startswith("kvplane://mesh/"):
                return True
        presented = call.metadata.get(MESH_SECRET_HEADER, "").encode("utf-8", "surrogatepass")
        matched = False
        for secret in self._secrets:
            if presented and hmac.compare_digest(secret, presented):
                matched = True
        return matched

    def authenticate(self, call: CallCredentials) -> Principal:
        if not self._from_proxy(call):
            # Identity headers from a bare client are worth nothing.
            raise Unauthenticated("no credentials: calls must come through the authenticated mesh proxy")
        md = call.metadata
        role = md.get(ROLE_HEADER, "")
        tenant = md.get(TENANT_HEADER, "")
        if role == PrincipalKind.NODE.value:
            node = md.get(NODE_HEADER, "")
            if not node:
                raise Unauthenticated(f"a node call needs {NODE_HEADER}")
            return Principal(PrincipalKind.NODE, _header_id(node, NODE_HEADER))
        if role == PrincipalKind.OPERATOR.value:
            name = md.get(OPERATOR_HEADER, "") or "mesh-operator"
            return Principal(PrincipalKind.OPERATOR, _header_id(name, OPERATOR_HEADER))
        if role in ("", PrincipalKind.TENANT.value) and tenant:
            name = _header_id(tenant, TENANT_HEADER, tenant=True)
            return Principal(PrincipalKind.TENANT, name, name)
        if role:
            raise Unauthenticated(f"unknown {ROLE_HEADER} {role!r}")
        raise Unauthenticated(f"the proxy named no caller ({ROLE_HEADER} or {TENANT_HEADER})")


def _header_id(value: str, header: str, *, tenant: bool = False) -> str:
    try:
        return validation.tenant(value, header) if tenant else validation.ident(value, header)
    except InvalidArgument as exc:
        raise Unauthenticated(str(exc)) from None


_IDENTITY_SCHEME = "kvplane://"
# A name a certificate may carry: letters, digits and . _ : @ -, starting with a letter or digit.
_IDENTITY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}")


def kvplane_identities(certificate_ids: Sequence[str]) -> list[str]:
    """The certificate's URI names in kvplane's scheme."""
    return [i for i in certificate_ids if i.startswith(_IDENTITY_SCHEME)]


def valid_identity_name(name: str) -> bool:
    """Whether `name` is a plain principal name: no wildcard, separator, escape or control character."""
    return _IDENTITY_NAME.fullmatch(name) is not None


def principal_from_identity(identity: str) -> Principal | None:
    """`kvplane://tenant/acme` -> a tenant principal; None for anything else, a name that is not
    plain included (`kvplane://node/d%2A` is not the wildcard `d*`: it names nothing)."""
    if not identity.startswith(_IDENTITY_SCHEME):
        return None
    kind_name, _, name = identity[len(_IDENTITY_SCHEME) :].partition("/")
    if not valid_identity_name(name):
        return None
    try:
        kind = PrincipalKind(kind_name)
    except ValueError:
        return None
    return Principal(kind, name, name if kind is PrincipalKind.TENANT else "")


def metadata_dict(pairs: Sequence[tuple[str, str | bytes]] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in pairs or ():
        if isinstance(value, str):
            out[key.lower()] = value
    return out
