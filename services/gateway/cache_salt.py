"""vLLM's `cache_salt` for each tenant: per-tenant prefix-cache isolation.

Engines share one prefix cache across requests. Without a salt, tenant B can
tell from a fast first token that tenant A recently sent the same prefix.
vLLM mixes a request's `cache_salt` into the hash of its first block, so
requests with different salts never share cached blocks.

The salt is an HMAC of the tenant (or of its group, where tenants are meant
to share a cache) under a key of the gateway's: it names no tenant to the
engines, and no client can compute another tenant's salt. The gateway sets
it on every request it sends, overwriting any salt the client sent; the P
and D legs of a turn carry the same one.

What this scopes: a P's cache hit and routing's expectation of one count only
within a tenant (or group). kvplane's D->P pulls are unaffected: a handle is
pulled only by its own tenant's turns, whose salt is the same, and the KV
pulled does not depend on the salt.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

log = logging.getLogger(__name__)

BODY_KEY = "cache_salt"

Mode = Literal["tenant", "group", "off"]


@dataclass(frozen=True, slots=True)
class CacheSalts:
    mode: Mode
    key: bytes
    # tenant -> group, for mode "group".
    groups: Mapping[str, str] = field(default_factory=dict)

    @classmethod
    def create(cls, mode: Mode, key: str, groups: Mapping[str, str]) -> CacheSalts:
        if mode != "off" and not key:
            # Fine for one gateway; several gateways in front of the same engines must share a key.
            log.warning(
                "gateway.cache_salt_key is not set: this gateway salts with a random key, so "
                "another gateway in front of the same engines would split every tenant's prefix "
                "cache; give all gateways one key (the Helm chart shares one from a Secret)"
            )
        return cls(mode, key.encode() if key else secrets.token_bytes(32), dict(groups))

    def salt(self, tenant: str) -> str | None:
        """The tenant's salt; None when isolation is off."""
        if self.mode == "off":
            return None
        group = self.groups.get(tenant) if self.mode == "group" else None
        scope = f"group:{group}" if group else f"tenant:{tenant}"
        return hmac.new(self.key, scope.encode(), hashlib.sha256).hexdigest()[:32]
