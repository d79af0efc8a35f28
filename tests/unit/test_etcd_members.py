"""Parsing etcd endpoints: names, addresses and client URLs."""

from __future__ import annotations

import pytest

from kvplane.services.common.store.members import BadEndpoint, Member, parse_members


@pytest.mark.parametrize(
    ("endpoint", "host", "port", "literal"),
    [
        ("etcd-0.etcd.infra:2379", "etcd-0.etcd.infra", 2379, False),
        ("localhost:2379", "localhost", 2379, False),
        ("10.0.0.1:2379", "10.0.0.1", 2379, True),
        ("[::1]:2379", "::1", 2379, True),
        ("http://etcd:2379", "etcd", 2379, False),
        ("https://[fd00::2]:2380/", "fd00::2", 2380, True),
    ],
)
def test_an_endpoint_is_a_host_by_name_or_address_and_a_port(
    endpoint: str, host: str, port: int, literal: bool
) -> None:
    member = Member.parse(endpoint)
    assert (member.host, member.port, member.is_literal) == (host, port, literal)
    assert member.endpoint == endpoint


@pytest.mark.parametrize("endpoint", ["etcd", "etcd:", ":2379", "etcd:99999", "[::1:2379", "etcd:port"])
def test_an_endpoint_without_a_host_and_valid_port_is_refused(endpoint: str) -> None:
    with pytest.raises(BadEndpoint):
        Member.parse(endpoint)


def test_no_endpoint_at_all_is_refused() -> None:
    with pytest.raises(BadEndpoint):
        parse_members(())


async def test_a_literal_address_needs_no_resolution() -> None:
    assert await Member.parse("[::1]:2379").target() == "ipv6:[::1]:2379"
    assert await Member.parse("127.0.0.1:2379").target() == "ipv4:127.0.0.1:2379"


async def test_a_name_resolves_to_its_addresses() -> None:
    assert "127.0.0.1:2379" in await Member.parse("localhost:2379").target()
