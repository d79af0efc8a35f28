"""Where the etcd client moves when no member answers a quorum read: not, unprobed, back to a
member that left a call unanswered a moment ago (a frozen member refuses nothing)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import grpc
import pytest

from kvplane.services.common.runtime.telemetry import Telemetry
from kvplane.services.common.store.etcd import EtcdClient
from kvplane.services.common.store.members import Member
from kvplane.services.common.store.settings import StoreSettings

ENDPOINTS = ("10.0.0.1:2379", "10.0.0.2:2379", "10.0.0.3:2379")


class _Channel:
    async def close(self) -> None:
        return None


def _conn(member: Member) -> Any:
    return SimpleNamespace(member=member, channel=_Channel(), generation=0)


@pytest.fixture
async def client(monkeypatch: pytest.MonkeyPatch) -> Any:
    etcd = EtcdClient(StoreSettings(endpoints=ENDPOINTS, request_timeout_s=0.01), Telemetry.disabled())

    async def opened(member: Member) -> Any:
        return _conn(member)

    async def silent(member: Member) -> Any:
        return None  # no member answers a quorum read (an election under load, say)

    monkeypatch.setattr(etcd, "_open", opened)
    monkeypatch.setattr(etcd, "_probe", silent)
    yield etcd
    await etcd.close()


async def test_with_no_member_answering_the_client_skips_one_that_just_went_silent(client: Any) -> None:
    frozen, healthy, current = client.members
    # The client left the frozen member for the last one; a call the frozen one held went
    # unanswered, and now a call on the current member is refused.
    client._conn = _conn(current)
    await client.failed(_conn(frozen), grpc.StatusCode.DEADLINE_EXCEEDED)
    await client.failed(client._conn, grpc.StatusCode.UNAVAILABLE)
    # The next in configured order after the current one is the frozen member: it comes last.
    assert client.member == healthy


async def test_with_every_other_member_silent_the_next_in_order_is_still_tried(client: Any) -> None:
    first, second, current = client.members
    client._conn = _conn(current)
    await client.failed(_conn(first), grpc.StatusCode.DEADLINE_EXCEEDED)
    await client.failed(_conn(second), grpc.StatusCode.DEADLINE_EXCEEDED)
    await client.failed(client._conn, grpc.StatusCode.UNAVAILABLE)
    assert client.member == first
