"""Listen addresses of the gateway, IPv6 included."""

from __future__ import annotations

import pytest

from kvplane.services.gateway.app import AddressError, Gateway, split_host_port
from kvplane.services.gateway.cli import build_parser, overrides
from kvplane.services.gateway.settings import GatewaySection


def test_host_port_forms() -> None:
    assert split_host_port("127.0.0.1:8080") == ("127.0.0.1", 8080)
    assert split_host_port("[::1]:8080") == ("::1", 8080)
    assert split_host_port("localhost:0") == ("localhost", 0)


@pytest.mark.parametrize("address", ["8080", ":8080", "host:", "host:http"])
def test_malformed_addresses_are_refused(address: str) -> None:
    with pytest.raises(AddressError):
        split_host_port(address)


def test_an_ipv6_gateway_url_is_bracketed() -> None:
    assert Gateway(GatewaySection(listen="[::1]:9000")).url == "http://[::1]:9000"


def test_command_flags_become_the_gateway_section() -> None:
    args = build_parser().parse_args(
        ["--listen", "[::1]:1", "--routing", "a:1, b:2", "--model", "m", "--default-tenant", "dev"]
    )
    assert overrides(args) == {
        "gateway": {"listen": "[::1]:1", "routing": ["a:1", "b:2"], "models": ["m"], "default_tenant": "dev"}
    }
