"""What ReportTurn does besides learning (routing/reports.py): the engine's handle is named, never
published here, for an engine with kvplane's connector or a tenant caller; an operator's report of
a D without the connector publishes that D's handle (the named fallback); a report of another
turn is refused."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

import pytest

from kvplane.services.common.model.errors import InvalidArgument, PermissionDenied
from kvplane.services.common.model.handles import KEY_HANDLE_ID, KEY_TENANT, CacheHandle
from kvplane.services.common.model.nodes import NodeRole
from kvplane.services.common.runtime.auth import Principal, PrincipalKind
from kvplane.services.common.store.records import HandleRecord, NodeRecord
from kvplane.services.routing.reports import TurnReports
from kvplane.services.routing.router.turns import TurnReport
from kvplane.services.routing.settings import RoutingSection
from tests.conftest import make_node
from tests.support.factories import make_handle, vllm_params

TENANT = Principal(PrincipalKind.TENANT, "acme", tenant="acme")
GATEWAY = Principal(PrincipalKind.OPERATOR, "gateway")
D0 = make_node("d0", role=NodeRole.DECODE)


@dataclass
class FakeView:
    handles: dict[tuple[str, str], HandleRecord] = field(default_factory=dict)
    nodes: dict[str, NodeRecord] = field(default_factory=lambda: {"d0": NodeRecord(D0, 1, 1)})

    def handle(self, tenant: str, conversation: str) -> HandleRecord | None:
        return self.handles.get((tenant, conversation))


@dataclass
class PublishOutcome:
    handle: CacheHandle


@dataclass
class FakeStore:
    published: list[CacheHandle] = field(default_factory=list)

    async def publish_handle(self, handle: CacheHandle) -> PublishOutcome:
        self.published.append(handle)
        return PublishOutcome(handle)


def reports(view: FakeView, store: FakeStore) -> TurnReports:
    return TurnReports(store, view, RoutingSection())  # type: ignore[arg-type]


def finished(params: dict[str, object]) -> TurnReport:
    return TurnReport(success=True, decode_kv_transfer_params_json=json.dumps(params))


async def test_the_engines_announced_handle_is_named_once_the_view_holds_it_never_published() -> None:
    view, store = FakeView(), FakeStore()
    params = {**vllm_params(D0), KEY_HANDLE_ID: "h-engine"}
    assert await reports(view, store).record(GATEWAY, "acme", "c", finished(params), None) == ""
    handle = make_handle(D0, conversation="c")
    view.handles[("acme", "c")] = HandleRecord(replace(handle, handle_id="h-engine"), 5, 1)
    assert await reports(view, store).record(GATEWAY, "acme", "c", finished(params), None) == "h-engine"
    assert store.published == []


async def test_a_tenants_report_never_publishes_a_handle() -> None:
    view, store = FakeView(), FakeStore()
    assert await reports(view, store).record(TENANT, "acme", "c", finished(vllm_params(D0)), None) == ""
    assert store.published == []


async def test_an_operators_report_of_a_d_without_the_connector_publishes_its_handle() -> None:
    view, store = FakeView(), FakeStore()
    handle_id = await reports(view, store).record(GATEWAY, "acme", "c", finished(vllm_params(D0)), None)
    [published] = store.published
    assert handle_id == published.handle_id != ""
    assert (published.tenant, published.conversation, published.holder_node_id) == ("acme", "c", "d0")


async def test_a_report_of_another_tenants_turn_or_of_nothing_retained_is_refused() -> None:
    view, store = FakeView(), FakeStore()
    with pytest.raises(PermissionDenied):
        params = {**vllm_params(D0), KEY_TENANT: "someone-else"}
        await reports(view, store).record(GATEWAY, "acme", "c", finished(params), None)
    with pytest.raises(InvalidArgument):
        params = {**vllm_params(D0), "remote_block_ids": [[]]}
        await reports(view, store).record(GATEWAY, "acme", "c", finished(params), None)
    assert store.published == []
