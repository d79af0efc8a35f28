"""The loads nodes stream to a routing replica stand in for etcd's only while they are fresh, for the
registration routing sees, and no older than what etcd holds."""

from __future__ import annotations

import dataclasses

import pytest

from kvplane.services.common.model.nodes import NodeLoad, NodeRole
from kvplane.services.routing.state.streamed_loads import StreamedLoads
from tests.support.routing_cluster import node

P0 = node("p0", NodeRole.PREFILL)


def _load(reported_unix_ms: int, running: int, incarnation: str = P0.incarnation) -> NodeLoad:
    return NodeLoad("p0", incarnation, running_requests=running, reported_unix_ms=reported_unix_ms)


def test_a_fresh_streamed_load_replaces_an_older_stored_one() -> None:
    loads = StreamedLoads(stale_after_s=2.0, max_nodes=8)
    stored = _load(1_000, running=1)
    assert loads.load(P0, stored, 0.0) is stored, "nothing streamed yet"
    loads.heard("p0", P0.incarnation, _load(1_500, running=7), now_s=10.0)
    assert loads.load(P0, stored, 11.0) == _load(1_500, running=7)
    # A keep-alive keeps the last streamed load fresh.
    loads.heard("p0", P0.incarnation, None, now_s=12.5)
    assert loads.load(P0, stored, 14.0) == _load(1_500, running=7)


def test_a_silent_stream_falls_back_to_the_stored_load() -> None:
    loads = StreamedLoads(stale_after_s=2.0, max_nodes=8)
    stored = _load(1_000, running=1)
    loads.heard("p0", P0.incarnation, _load(1_500, running=7), now_s=10.0)
    assert loads.load(P0, stored, 12.5) is stored
    assert loads.newest_report_unix_ms(12.5) == 0 and loads.newest_report_unix_ms(11.0) == 1_500


def test_a_stored_load_newer_than_the_streamed_one_wins() -> None:
    loads = StreamedLoads(stale_after_s=2.0, max_nodes=8)
    loads.heard("p0", P0.incarnation, _load(1_500, running=7), now_s=10.0)
    newer = _load(2_000, running=2)
    assert loads.load(P0, newer, 10.5) is newer


def test_another_incarnations_stream_is_not_used() -> None:
    loads = StreamedLoads(stale_after_s=2.0, max_nodes=8)
    loads.heard("p0", "old-incarnation", _load(1_500, running=7, incarnation="old-incarnation"), now_s=10.0)
    assert loads.load(P0, None, 10.5) is None
    restarted = dataclasses.replace(P0, incarnation="old-incarnation")
    assert loads.load(restarted, None, 10.5) is not None
    # A new incarnation's stream starts without the old one's load.
    loads.heard("p0", P0.incarnation, None, now_s=11.0)
    assert loads.load(P0, None, 11.5) is None


def test_the_least_recently_heard_node_is_forgotten_beyond_the_bound() -> None:
    loads = StreamedLoads(stale_after_s=2.0, max_nodes=2)
    for i, name in enumerate(("a", "b", "c")):
        loads.heard(name, "i", NodeLoad(name, "i", reported_unix_ms=i), now_s=float(i))
    assert len(loads) == 2
    a = dataclasses.replace(node("a", NodeRole.PREFILL), incarnation="i")
    assert loads.load(a, None, 2.0) is None


def test_bounds_are_checked() -> None:
    with pytest.raises(ValueError):
        StreamedLoads(stale_after_s=0, max_nodes=1)
    with pytest.raises(ValueError):
        StreamedLoads(stale_after_s=1.0, max_nodes=0)
