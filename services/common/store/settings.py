"""How a process reaches etcd: endpoints, key prefix and deadlines."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvplane.services.common.store.etcd_credentials import EtcdCredentials


@dataclass(frozen=True, slots=True)
class StoreSettings:
    # host:port of each etcd member; a host may be a DNS name or an IP literal.
    endpoints: tuple[str, ...] = ("127.0.0.1:2379",)
    prefix: str = "/kvplane/v1/"
    # Deadline of one etcd request, in seconds.
    request_timeout_s: float = 2.0
    # How long an ambiguous write is re-sent before giving up, in seconds.
    settle_timeout_s: float = 10.0
    # TLS and etcd user (kvplane.services.common.store.etcd_credentials); empty: plaintext, no user.
    credentials: EtcdCredentials = field(default_factory=EtcdCredentials)
