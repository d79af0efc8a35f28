"""Table-driven tests of every routing filter."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvplane.services.common.model.nodes import Fingerprint, NodeRole
from kvplane.services.routing.policy import Leg
from kvplane.services.routing.policy.filters.fingerprint import SameFingerprintFilter
from kvplane.services.routing.policy.filters.live import LiveFilter
from kvplane.services.routing.policy.filters.model import SameModelFilter
from kvplane.services.routing.policy.filters.not_draining import NotDrainingFilter
from kvplane.services.routing.policy.filters.role import RoleFilter
from kvplane.services.routing.policy.snapshot import NodeState
from tests.unit.routing_policy_fixtures import FP, NOW, ctx, mk_load, mk_node, snap


@pytest.mark.parametrize(
    ("role", "leg", "kept"),
    [
        (NodeRole.PREFILL, Leg.PREFILL, True),
        (NodeRole.PREFILL, Leg.DECODE, False),
        (NodeRole.DECODE, Leg.DECODE, True),
        (NodeRole.DECODE, Leg.PREFILL, False),
        (NodeRole.BOTH, Leg.PREFILL, True),
        (NodeRole.BOTH, Leg.DECODE, True),
    ],
)
def test_role_filter_keeps_nodes_that_can_serve_the_leg(role: NodeRole, leg: Leg, kept: bool) -> None:
    assert RoleFilter().keep(NodeState(mk_node(role=role)), ctx(leg)) is kept


@pytest.mark.parametrize(
    ("model", "kept"),
    [("m", True), ("other", False), ("", False), ("M", False)],
)
def test_same_model_filter_keeps_only_the_requested_model(model: str, kept: bool) -> None:
    node = mk_node(fingerprint=Fingerprint(model, "bfloat16", "NHD"))
    assert SameModelFilter().keep(NodeState(node), ctx()) is kept


@pytest.mark.parametrize(
    ("fingerprint", "reference", "kept"),
    [
        (FP, None, True),
        (FP, FP, True),
        (Fingerprint("m", "fp8_e4m3", "NHD"), FP, False),
        (Fingerprint("m", "bfloat16", "HND"), FP, False),
        (Fingerprint("m", "bfloat16", "NHD", "awq"), FP, False),
        (Fingerprint("other", "bfloat16", "NHD"), FP, False),
    ],
)
def test_same_fingerprint_filter_compares_every_field(
    fingerprint: Fingerprint, reference: Fingerprint | None, kept: bool
) -> None:
    node = mk_node(fingerprint=fingerprint)
    assert SameFingerprintFilter().keep(NodeState(node), ctx(fingerprint=reference)) is kept


@pytest.mark.parametrize(("draining", "kept"), [(False, True), (True, False)])
def test_not_draining_filter_drops_draining_nodes(draining: bool, kept: bool) -> None:
    assert NotDrainingFilter().keep(NodeState(mk_node(draining=draining)), ctx()) is kept


@pytest.mark.parametrize(
    ("report_age_ms", "require_load", "kept"),
    [
        (None, False, True),  # registered, not reported yet
        (None, True, False),
        (0, False, True),
        (10_000, False, True),
        (10_001, False, False),  # stuck agent: lease alive, no reports
        (-500, False, True),  # a reporter's clock slightly ahead
    ],
)
def test_live_filter_drops_nodes_whose_load_reports_stopped(
    report_age_ms: int | None, require_load: bool, kept: bool
) -> None:
    node = mk_node()
    load = None if report_age_ms is None else mk_load(node, reported_unix_ms=NOW - report_age_ms)
    f = LiveFilter(max_load_age_ms=10_000, require_load=require_load)
    assert f.keep(NodeState(node, load), ctx()) is kept


def test_live_filter_keeps_a_quiet_node_between_its_load_heartbeats() -> None:
    # An idle node's agent reports only every load_heartbeat_s (10 s) while nothing changes.
    node = mk_node()
    quiet = mk_load(node, reported_unix_ms=NOW - 25_000)
    assert LiveFilter().keep(NodeState(node, quiet), ctx())
    stopped = mk_load(node, reported_unix_ms=NOW - 31_000)
    assert not LiveFilter().keep(NodeState(node, stopped), ctx())


def test_live_filter_judges_report_age_as_of_the_last_live_view() -> None:
    # etcd has been unreachable for a minute: reports stopped for every node alike.
    node = mk_node()
    load = mk_load(node, reported_unix_ms=NOW - 61_000)
    outage = snap(now_unix_ms=NOW, loads_as_of_unix_ms=NOW - 60_000)
    assert LiveFilter(max_load_age_ms=10_000).keep(NodeState(node, load), ctx(snapshot=outage))
    stuck = mk_load(node, reported_unix_ms=NOW - 75_000)
    assert not LiveFilter(max_load_age_ms=10_000).keep(NodeState(node, stuck), ctx(snapshot=outage))


def test_filters_are_frozen_values() -> None:
    f = LiveFilter()
    with pytest.raises(AttributeError):
        f.max_load_age_ms = 1  # type: ignore[misc]
    assert replace(f, max_load_age_ms=5).max_load_age_ms == 5
