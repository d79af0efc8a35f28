"""Input limits over the domain values: each refusal is INVALID_ARGUMENT naming the field."""

from __future__ import annotations

import dataclasses
import time

import pytest

from kvplane.services.common.model import validation
from kvplane.services.common.model.errors import InvalidArgument
from tests.conftest import make_node
from tests.support.factories import make_handle


def _refused(call: object, field: str) -> str:
    with pytest.raises(InvalidArgument) as raised:
        call()  # type: ignore[operator]
    assert raised.value.field == field
    return raised.value.reason


def test_text_limits_count_utf8_bytes_and_a_required_field_must_be_present() -> None:
    assert validation.tenant("t" * 128) == "t" * 128
    reason = _refused(lambda: validation.tenant("é" * 65), "tenant")
    assert reason == "is 130 bytes; the limit is 128"
    assert _refused(lambda: validation.conversation(""), "conversation") == "is required"
    assert validation.ident("", "handle_id", required=False) == ""
    _refused(lambda: validation.ident("x" * 129, "node_id"), "node_id")


def test_numbers_and_counts_are_checked_against_their_bounds() -> None:
    assert validation.in_range(2, "lease_ttl_s", 2, 300) == 2
    assert _refused(lambda: validation.in_range(1, "lease_ttl_s", 2, 300), "lease_ttl_s") == (
        "is 1; it must be between 2 and 300"
    )
    assert "has 0 entries" in _refused(lambda: validation.count(0, "handles", 1, 256), "handles")
    _refused(lambda: validation.port(0, "port"), "port")
    _refused(lambda: validation.port(65536, "port"), "port")


@pytest.mark.parametrize("url", ["http://10.0.0.1:8000", "https://engine.local", "http://[::1]:8000/v1"])
def test_engine_urls_are_http_with_a_host(url: str) -> None:
    assert validation.http_url(url, "http_url") == url


@pytest.mark.parametrize("url", ["ftp://h", "http://", "engine:8000", "http://h:99999", "http://::1:80"])
def test_other_urls_are_refused(url: str) -> None:
    _refused(lambda: validation.http_url(url, "http_url"), "http_url")


@pytest.mark.parametrize("value", ["10.0.0.1", "::1", "fe80::1", "d0.kvplane.svc.cluster.local", "host."])
def test_hosts_are_bare_names_or_ip_literals(value: str) -> None:
    assert validation.host(value, "host") == value


@pytest.mark.parametrize("value", ["[::1]", "-bad.example", "a..b", "under_score", "x" * 64])
def test_bracketed_or_malformed_hosts_are_refused(value: str) -> None:
    _refused(lambda: validation.host(value, "host"), "host")


def test_a_stored_handle_meets_every_bound_and_names_the_first_it_breaks() -> None:
    now = int(time.time() * 1000)
    handle = make_handle(make_node("d0"))
    assert validation.cache_handle(handle, "handle", now_unix_ms=now) is handle

    expired = dataclasses.replace(handle, wall_expiry_unix_ms=now)
    _refused(
        lambda: validation.cache_handle(expired, "handle", now_unix_ms=now), "handle.wall_expiry_unix_ms"
    )
    too_far = dataclasses.replace(handle, wall_expiry_unix_ms=now + validation.MAX_HANDLE_LIFE_MS + 1)
    _refused(
        lambda: validation.cache_handle(too_far, "handle", now_unix_ms=now), "handle.wall_expiry_unix_ms"
    )
    no_blocks = dataclasses.replace(handle, vllm=dataclasses.replace(handle.vllm, remote_block_ids=((),)))
    _refused(
        lambda: validation.cache_handle(no_blocks, "handle", now_unix_ms=now),
        "handle.vllm.remote_block_ids[0]",
    )
    negative = dataclasses.replace(handle, vllm=dataclasses.replace(handle.vllm, remote_block_ids=((-1,),)))
    assert "out of range" in _refused(
        lambda: validation.cache_handle(negative, "handle", now_unix_ms=now),
        "handle.vllm.remote_block_ids[0]",
    )
    bracketed = dataclasses.replace(handle, vllm=dataclasses.replace(handle.vllm, remote_host="[::1]"))
    _refused(lambda: validation.cache_handle(bracketed, "handle", now_unix_ms=now), "handle.vllm.remote_host")
