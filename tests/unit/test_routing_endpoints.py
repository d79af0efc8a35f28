"""Addresses: IPv6 literals are bracketed in URLs and host:port forms, bare elsewhere."""

from __future__ import annotations

import pytest

from kvplane.services.routing.endpoints import (
    AddressError,
    bare_host,
    host_port,
    http_base_url,
    side_channel_url,
)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://10.0.0.7:8000", "http://10.0.0.7:8000"),
        ("http://10.0.0.7:8000/", "http://10.0.0.7:8000"),
        ("http://[fd00::7]:8000", "http://[fd00::7]:8000"),
        ("http://fd00::7:8000", "http://[fd00::7]:8000"),
        ("https://engine-0.svc:443/base/", "https://engine-0.svc:443/base"),
        ("http://[::1]:8000", "http://[::1]:8000"),
    ],
)
def test_http_base_url_is_normalized_and_bracketed(url: str, expected: str) -> None:
    assert http_base_url(url) == expected


@pytest.mark.parametrize(
    "url", ["ftp://h:1", "http://:80", "not a url", "http://h:99999", "http://fd00::zz:80"]
)
def test_bad_urls_are_refused(url: str) -> None:
    with pytest.raises(AddressError):
        http_base_url(url)


@pytest.mark.parametrize(
    ("host", "port", "expected"),
    [
        ("10.0.0.1", 5600, "10.0.0.1:5600"),
        ("fd00::1", 5600, "[fd00::1]:5600"),
        ("[fd00::1]", 5600, "[fd00::1]:5600"),
        ("d0.engines", 5601, "d0.engines:5601"),
    ],
)
def test_host_port_brackets_ipv6_once(host: str, port: int, expected: str) -> None:
    assert host_port(host, port) == expected
    assert side_channel_url(host, port) == f"tcp://{expected}"


def test_bare_host_strips_brackets_only() -> None:
    assert bare_host("[::1]") == "::1"
    assert bare_host("::1") == "::1"
    assert bare_host("host") == "host"
