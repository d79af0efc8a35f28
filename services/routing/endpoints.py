"""Addresses handed to gateways: HTTP base URLs and NIXL side-channel addresses.

IPv6 literals are bracketed in every URL and host:port form and stored bare
elsewhere (node registrations, handles), as vLLM expects: it brackets
`remote_host` itself when it builds the side channel's ZMQ address.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit, urlunsplit


class AddressError(ValueError):
    """A node address that cannot be turned into a valid URL."""


def is_ipv6_literal(host: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(host.split("%", 1)[0]), ipaddress.IPv6Address)
    except ValueError:
        return False


def bare_host(host: str) -> str:
    """`host` without IPv6 brackets."""
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def host_port(host: str, port: int) -> str:
    """`host:port`, with IPv6 literals bracketed."""
    host = bare_host(host)
    return f"[{host}]:{port}" if is_ipv6_literal(host) else f"{host}:{port}"


def side_channel_url(host: str, port: int) -> str:
    """The ZMQ address vLLM builds from `remote_host`/`remote_port`."""
    return f"tcp://{host_port(host, port)}"


def http_base_url(url: str) -> str:
    """A node's base URL, normalized: IPv6 host bracketed, no trailing slash.

    Registrations are validated to be bracketed already; a bare IPv6 literal
    with a port (`http://fd00::7:8000`) is repaired rather than mis-parsed.
    """
    parts = urlsplit(url)
    netloc = parts.netloc
    if netloc.count(":") > 1 and "[" not in netloc:
        host, _, port = netloc.rpartition(":")
        if not (port.isdigit() and is_ipv6_literal(host)):
            raise AddressError(f"ambiguous address in {url!r}: bracket IPv6 literals")
        netloc = f"[{host}]:{port}"
        parts = parts._replace(netloc=netloc)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise AddressError(f"{url!r} is not an http(s) URL with a host")
    try:
        parts.port  # noqa: B018 - raises on a malformed port
    except ValueError:
        raise AddressError(f"{url!r} has an invalid port") from None
    return urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))
