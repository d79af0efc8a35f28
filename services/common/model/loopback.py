"""Whether an address stays on this machine: what may carry a credential without TLS.

Pure: no I/O, no name resolution (a name is on loopback only when it is `localhost`).
"""

from __future__ import annotations

import ipaddress

# gRPC target schemes that name a host (`dns:///host:port`, `ipv4:host:port`, `ipv6:[v6]:port`).
_SCHEMES = ("dns:", "ipv4:", "ipv6:")


def loopback_target(target: str) -> bool:
    """A gRPC target or an etcd endpoint (`host:port`, `[v6]:port`, `http(s)://host:port`,
    `dns:///host:port`, `unix:path`) that reaches this machine only."""
    text = target.strip()
    if text.startswith(("unix:", "unix-abstract:")):
        return True
    text = text.split("://", 1)[-1].lstrip("/") if "://" in text else text
    for scheme in _SCHEMES:
        if text.startswith(scheme):
            text = text[len(scheme) :].lstrip("/")
    text = text.rstrip("/")
    if text.startswith("["):
        host = text[1:].partition("]")[0]
    else:
        host = text.rpartition(":")[0] if ":" in text else text
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
