"""The etcd members a process may talk to: endpoints given as names or
addresses, each resolved by DNS when a connection to it is made.

An endpoint is `host:port`, `[v6]:port` or either with an `http://` or
`https://` scheme (as etcd prints its client URLs). A name resolves to every
address DNS gives for it; gRPC's pick_first then tries them in order, so a
name behind several addresses (a headless Service) is covered too.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from dataclasses import dataclass


class BadEndpoint(ValueError):
    """An etcd endpoint that is not host:port."""


@dataclass(frozen=True, slots=True)
class Member:
    """One etcd endpoint as configured."""

    endpoint: str
    host: str
    port: int

    @classmethod
    def parse(cls, endpoint: str) -> Member:
        text = endpoint.strip()
        for scheme in ("http://", "https://"):
            if text.startswith(scheme):
                text = text[len(scheme) :]
        text = text.rstrip("/")
        if text.startswith("["):
            host, sep, rest = text[1:].partition("]")
            port_text = rest[1:] if rest.startswith(":") else ""
            if not sep:
                raise BadEndpoint(f"etcd endpoint {endpoint!r}: unclosed '['")
        else:
            host, _, port_text = text.rpartition(":")
        if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise BadEndpoint(f"etcd endpoint {endpoint!r} is not host:port")
        return cls(endpoint, host, int(port_text))

    @property
    def is_literal(self) -> bool:
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            return False
        return True

    async def target(self) -> str:
        """A gRPC target of this member's addresses, resolved now.

        Raises OSError when the name does not resolve.
        """
        if self.is_literal:
            addresses = [self.host]
        else:
            infos = await asyncio.get_running_loop().getaddrinfo(
                self.host, self.port, type=socket.SOCK_STREAM
            )
            # One address family per target (gRPC's ipv4:/ipv6: schemes); IPv4
            # first, as a name like localhost usually listens there.
            v4 = [str(info[4][0]) for info in infos if info[0] == socket.AF_INET]
            v6 = [str(info[4][0]) for info in infos if info[0] == socket.AF_INET6]
            addresses = list(dict.fromkeys(v4 or v6))
            if not addresses:
                raise OSError(f"{self.host!r} resolves to no address")
        if ":" in addresses[0]:
            return "ipv6:" + ",".join(f"[{a}]:{self.port}" for a in addresses)
        return "ipv4:" + ",".join(f"{a}:{self.port}" for a in addresses)


def parse_members(endpoints: tuple[str, ...] | list[str]) -> list[Member]:
    if not endpoints:
        raise BadEndpoint("no etcd endpoint configured")
    return [Member.parse(e) for e in endpoints]
