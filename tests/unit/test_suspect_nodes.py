"""Which nodes a route may choose once some have failed (a pure rule)."""

from __future__ import annotations

from dataclasses import replace

from kvplane.services.common.model.nodes import NodeLoad, NodeRole
from kvplane.services.common.model.suspects import NodeSuspect
from kvplane.services.routing.policy import NodeState
from kvplane.services.routing.state.suspects import usable_nodes
from tests.support.routing_cluster import node

D0 = node("d0", NodeRole.DECODE)
D1 = node("d1", NodeRole.DECODE)


def _state(n: object, reported_ms: int | None = None) -> NodeState:
    load = None if reported_ms is None else NodeLoad(n.node_id, n.incarnation, reported_unix_ms=reported_ms)  # type: ignore[attr-defined]
    return NodeState(n, load)  # type: ignore[arg-type]


def _ids(states: tuple[NodeState, ...]) -> list[str]:
    return [s.node.node_id for s in states]


def test_a_node_that_failed_this_turn_is_left_out() -> None:
    assert _ids(usable_nodes((_state(D0), _state(D1)), {}, {"d0"})) == ["d1"]


def test_a_standing_suspect_is_left_out() -> None:
    mark = NodeSuspect("d0", D0.incarnation, marked_unix_ms=1000)
    assert _ids(usable_nodes((_state(D0, 900), _state(D1, 900)), {"d0": mark}, set())) == ["d1"]


def test_a_load_report_taken_after_the_mark_clears_it() -> None:
    mark = NodeSuspect("d0", D0.incarnation, marked_unix_ms=1000)
    assert _ids(usable_nodes((_state(D0, 1001), _state(D1, 900)), {"d0": mark}, set())) == ["d0", "d1"]


def test_a_new_incarnation_is_not_suspect() -> None:
    mark = NodeSuspect("d0", D0.incarnation, marked_unix_ms=1000)
    reborn = replace(D0, incarnation="new")
    assert _ids(usable_nodes((_state(reborn), _state(D1)), {"d0": mark}, set())) == ["d0", "d1"]
