"""Who is calling: caller credentials -> a Principal, and the tenant it may act for.

The tenant of a request always comes from the caller's credentials when the
caller is a tenant. Nodes (engine agents) and operators are trusted internal
principals: they name the tenant in the request, because they act on behalf
of whichever tenant the router assigned. See THREAT_MODEL.md.
"""

from __future__ import annotations

import enum
import hmac
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvplane.services.common import validation
from kvplane.services.common.errors import PermissionDenied, Unauthenticated


class PrincipalKind(enum.Enum):
    TENANT = "tenant"
    NODE = "node"
    OPERATOR = "operator"


@dataclass(frozen=True, slots=True)
class Principal:
    kind: PrincipalKind
    name: str
    tenant: str = ""

    def acts_for(self, requested_tenant: str, field: str = "tenant") -> str:
        """The tenant this call acts for; never a tenant caller's body field."""
        if self.kind is PrincipalKind.TENANT:
            if requested_tenant and requested_tenant != self.tenant:
                raise PermissionDenied(f"{field}: a tenant caller may act only on its own tenant")
            return self.tenant
        return validation.tenant(requested_tenant, field)

    def require(self, *kinds: PrincipalKind) -> None:
        if self.kind not in kinds:
            allowed = ", ".join(k.value for k in kinds)
            raise PermissionDenied(f"this call needs a {allowed} principal; caller is {self.kind.value}")


class Authenticator(Protocol):
    """Maps a call's metadata (lower-cased keys) and peer to a Principal."""

    def authenticate(self, metadata: Mapping[str, str], peer: str) -> Principal: ...


class TokenAuthenticator:
    """Bearer tokens (`authorization: Bearer <t>` or `x-api-key: <t>`) from configuration."""

    def __init__(self, tokens: Mapping[str, Principal]) -> None:
        self._tokens = dict(tokens)

    def authenticate(self, metadata: Mapping[str, str], peer: str) -> Principal:
        token = metadata.get("x-api-key", "")
        auth = metadata.get("authorization", "")
        if auth.lower().startswith("bearer "):
            token = auth[7:].strip()
        if not token:
            raise Unauthenticated("no credentials: send 'authorization: Bearer <token>'")
        for known, principal in self._tokens.items():
            if hmac.compare_digest(known.encode(), token.encode()):
                return principal
        raise Unauthenticated("unknown token")


class HeaderAuthenticator:
    """Trusts `x-kvplane-tenant` / `x-kvplane-role` headers.

    For development, and behind a mesh whose proxy authenticates the caller
    (mTLS) and sets these headers itself, stripping any the client sent.
    A call with neither header is an operator call.
    """

    def authenticate(self, metadata: Mapping[str, str], peer: str) -> Principal:
        role = metadata.get("x-kvplane-role", "")
        tenant = metadata.get("x-kvplane-tenant", "")
        if role == PrincipalKind.NODE.value:
            return Principal(PrincipalKind.NODE, metadata.get("x-kvplane-node", peer))
        if tenant:
            return Principal(PrincipalKind.TENANT, tenant, validation.tenant(tenant, "x-kvplane-tenant"))
        if role in ("", PrincipalKind.OPERATOR.value):
            return Principal(PrincipalKind.OPERATOR, peer)
        raise Unauthenticated(f"unknown x-kvplane-role {role!r}")


def metadata_dict(pairs: Sequence[tuple[str, str | bytes]] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for key, value in pairs or ():
        if isinstance(value, str):
            out[key.lower()] = value
    return out
