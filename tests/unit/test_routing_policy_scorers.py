"""Table-driven tests of every routing scorer and the picker."""

from __future__ import annotations

import pytest

from kvplane.services.common.model.nodes import NodeRole
from kvplane.services.routing.policy import Leg, Prompt
from kvplane.services.routing.policy.picker import MaxScorePicker
from kvplane.services.routing.policy.scorers.free_kv import FreeKvScorer
from kvplane.services.routing.policy.scorers.holder_affinity import HolderAffinityScorer
from kvplane.services.routing.policy.scorers.holder_locality import HolderLocalityScorer
from kvplane.services.routing.policy.scorers.last_decode import LastDecodeScorer
from kvplane.services.routing.policy.scorers.last_prefill import LastPrefillScorer
from kvplane.services.routing.policy.scorers.queued_prefill import QueuedPrefillScorer
from kvplane.services.routing.policy.scorers.running_load import RunningLoadScorer
from kvplane.services.routing.policy.snapshot import NodeState
from tests.unit.routing_policy_fixtures import ctx, history, mk_handle, mk_load, mk_node, snap, state

HOLDER = mk_node("d0")
HANDLE = mk_handle(HOLDER, history(1000))


@pytest.mark.parametrize(
    ("case", "node", "load", "prompt_tokens", "expected"),
    [
        ("holder, unknown load", HOLDER, None, 1100, 1.0),
        ("holder, roomy", HOLDER, {"free_kv_blocks": 1000, "total_kv_blocks": 2000}, 1100, 1.0),
        # 100 new tokens + 1024 reserved = 1124 tokens = 71 blocks of 16 needed.
        ("holder, just enough", HOLDER, {"free_kv_blocks": 71, "total_kv_blocks": 1000}, 1100, 1.0),
        ("holder, too little", HOLDER, {"free_kv_blocks": 70, "total_kv_blocks": 1000}, 1100, 0.0),
        ("holder, nearly full", HOLDER, {"free_kv_blocks": 10, "total_kv_blocks": 100_000}, 1001, 0.0),
        # Requests already waiting there for memory are admitted first: their need is not free.
        (
            "holder, free blocks owed to waiting requests",
            HOLDER,
            {"free_kv_blocks": 1000, "waiting_kv_blocks": 930, "total_kv_blocks": 2000},
            1100,
            0.0,
        ),
        (
            "holder, room beyond the waiting requests",
            HOLDER,
            {"free_kv_blocks": 1000, "waiting_kv_blocks": 929, "total_kv_blocks": 2000},
            1100,
            1.0,
        ),
        ("another node", mk_node("d1"), None, 1100, 0.0),
        ("holder's previous life", mk_node("d0", incarnation="old"), None, 1100, 0.0),
    ],
)
def test_holder_affinity_prefers_the_holder_only_with_kv_headroom(
    case: str, node: object, load: dict[str, int] | None, prompt_tokens: int, expected: float
) -> None:
    s = NodeState(node, mk_load(node, **load) if load else None)  # type: ignore[arg-type]
    c = ctx(Leg.DECODE, holder=HOLDER, snapshot=snap(handle=HANDLE, prompt=Prompt(prompt_tokens)))
    assert HolderAffinityScorer().score(s, c) == expected, case


def test_holder_affinity_is_zero_without_a_handle() -> None:
    assert HolderAffinityScorer().score(NodeState(HOLDER), ctx(Leg.DECODE)) == 0.0


@pytest.mark.parametrize(
    ("load", "expected"),
    [
        (None, 0.5),
        ({"free_kv_blocks": 0, "total_kv_blocks": 100}, 0.0),
        ({"free_kv_blocks": 25, "total_kv_blocks": 100}, 0.25),
        ({"free_kv_blocks": 100, "total_kv_blocks": 100}, 1.0),
        ({"free_kv_blocks": 5, "total_kv_blocks": 0}, 0.5),
        # What requests waiting there for memory need is not free for the next one.
        ({"free_kv_blocks": 50, "waiting_kv_blocks": 25, "total_kv_blocks": 100}, 0.25),
        ({"free_kv_blocks": 10, "waiting_kv_blocks": 40, "total_kv_blocks": 100}, 0.0),
    ],
)
def test_free_kv_scores_the_free_share(load: dict[str, int] | None, expected: float) -> None:
    s = state(mk_node(), **load) if load else NodeState(mk_node())
    assert FreeKvScorer().score(s, ctx()) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("load", "expected"),
    [
        (None, 0.5),
        ({"running_requests": 0}, 1.0),
        ({"running_requests": 16}, 0.5),
        ({"running_requests": 8, "queued_requests": 8}, 0.5),
        ({"running_requests": 48}, 0.25),
    ],
)
def test_running_load_halves_at_its_scale(load: dict[str, int] | None, expected: float) -> None:
    s = state(mk_node(), **load) if load else NodeState(mk_node())
    assert RunningLoadScorer(scale=16).score(s, ctx()) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("queued", "expected"),
    [(None, 0.5), (0, 1.0), (8192, 0.5), (3 * 8192, 0.25)],
)
def test_queued_prefill_halves_at_its_scale(queued: int | None, expected: float) -> None:
    node = mk_node("p", NodeRole.PREFILL)
    s = NodeState(node) if queued is None else state(node, queued_prefill_tokens=queued)
    assert QueuedPrefillScorer().score(s, ctx(Leg.PREFILL)) == pytest.approx(expected)


@pytest.mark.parametrize(
    ("last", "node_id", "expected"), [("p0", "p0", 1.0), ("p0", "p1", 0.0), ("", "p0", 0.0)]
)
def test_last_prefill_affinity(last: str, node_id: str, expected: float) -> None:
    c = ctx(Leg.PREFILL, snapshot=snap(last_prefill_node_id=last))
    assert LastPrefillScorer().score(NodeState(mk_node(node_id, NodeRole.PREFILL)), c) == expected


@pytest.mark.parametrize(
    ("case", "last", "node_id", "load", "expected"),
    [
        ("last D, unknown load", "d0", "d0", None, 1.0),
        ("last D, roomy", "d0", "d0", {"free_kv_blocks": 1000, "total_kv_blocks": 2000}, 1.0),
        # 1100 prompt tokens + 1024 reserved = 2124 tokens = 133 blocks of 16 needed.
        ("last D, just enough", "d0", "d0", {"free_kv_blocks": 133, "total_kv_blocks": 1000}, 1.0),
        ("last D, too little", "d0", "d0", {"free_kv_blocks": 132, "total_kv_blocks": 1000}, 0.0),
        ("another D", "d0", "d1", None, 0.0),
        ("no previous turn", "", "d0", None, 0.0),
    ],
)
def test_last_decode_affinity_prefers_the_last_decode_node_only_with_room(
    case: str, last: str, node_id: str, load: dict[str, int] | None, expected: float
) -> None:
    node = mk_node(node_id)
    s = NodeState(node, mk_load(node, **load) if load else None)
    c = ctx(Leg.DECODE, snapshot=snap(last_decode_node_id=last, prompt=Prompt(1100)))
    assert LastDecodeScorer().score(s, c) == expected, case


@pytest.mark.parametrize(
    ("holder_labels", "node_labels", "expected"),
    [
        ({"zone": "a"}, {"zone": "a"}, 1.0),
        ({"zone": "a"}, {"zone": "b"}, 0.0),
        ({"zone": "a"}, {}, 0.0),
        ({}, {}, 0.0),
        ({"rack": "r1"}, {"rack": "r1"}, 0.0),  # another label than configured
    ],
)
def test_holder_locality_matches_the_configured_label(
    holder_labels: dict[str, str], node_labels: dict[str, str], expected: float
) -> None:
    holder = mk_node("d0", labels=holder_labels)
    node = mk_node("p0", NodeRole.PREFILL, labels=node_labels)
    assert (
        HolderLocalityScorer(label="zone").score(NodeState(node), ctx(Leg.PREFILL, holder=holder)) == expected
    )


def test_holder_locality_without_a_holder_is_zero() -> None:
    assert HolderLocalityScorer().score(NodeState(mk_node("p0", NodeRole.PREFILL)), ctx(Leg.PREFILL)) == 0.0


def test_picker_ranks_by_score_and_breaks_ties_deterministically() -> None:
    a, b, c = (NodeState(mk_node(n)) for n in ("a", "b", "c"))
    picker = MaxScorePicker()
    ranked = picker.rank([(a, 1.0), (b, 3.0), (c, 2.0)], ctx())
    assert [s.node_id for s in ranked] == ["b", "c", "a"]
    tie = [(a, 1.0), (b, 1.0), (c, 1.0)]
    first = picker.rank(tie, ctx(snapshot=snap(conversation="x")))
    assert first == picker.rank(list(reversed(tie)), ctx(snapshot=snap(conversation="x")))
    # Different conversations spread over equal nodes.
    leaders = {picker.rank(tie, ctx(snapshot=snap(conversation=f"c{i}")))[0].node_id for i in range(30)}
    assert len(leaders) > 1
