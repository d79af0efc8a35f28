"""The `demand` retention plugin: a node short of KV memory gets it back, in value order, no more."""

from __future__ import annotations

import pytest

from kvplane.services.common.model.handles import ReleaseReason
from kvplane.services.eviction.policy.demand import OnDemand
from kvplane.services.eviction.policy.model import HandleInfo, NodeInfo, Snapshot
from kvplane.services.eviction.policy.pipeline import RetentionPipeline
from kvplane.services.eviction.policy.value import ValueModel

NOW = 1_700_000_000_000
MB = 1 << 20
VALUES = ValueModel()


def handle(name: str, *, age_s: float, mb: int = 100, tokens: int = 8000, node: str = "d0") -> HandleInfo:
    return HandleInfo(
        tenant="acme",
        conversation=name,
        handle_id=f"h-{name}",
        node_id=node,
        retained_bytes=mb * MB,
        num_tokens=tokens,
        published_unix_ms=NOW - int(age_s * 1000),
        wall_expiry_unix_ms=NOW + 400_000,
    )


def snapshot(handles: list[HandleInfo], demand_mb: float, free: float = 0.0) -> Snapshot:
    nodes = {
        "d0": NodeInfo("d0", 4000 * MB, 0, free, int(demand_mb * MB)),
        "d1": NodeInfo("d1", 4000 * MB, 0, free, 0),
    }
    return Snapshot(NOW, tuple(handles), nodes)


def released(snap: Snapshot) -> list[str]:
    return [r.conversation for r in OnDemand().evaluate(snap, VALUES)]


AGED = [
    handle("fresh", age_s=10),
    handle("minute", age_s=60),
    handle("old", age_s=200),
    handle("oldest", age_s=400),
]


def test_a_node_without_demand_keeps_all_its_handles() -> None:
    assert released(snapshot(AGED, 0)) == []


@pytest.mark.parametrize(
    ("demand_mb", "expected"),
    [
        (1, ["oldest"]),
        (100, ["oldest"]),
        (101, ["oldest", "old"]),
        (250, ["oldest", "old", "minute"]),
        (10_000, ["oldest", "old", "minute", "fresh"]),
    ],
)
def test_releases_go_oldest_lowest_value_first_and_stop_once_the_demand_is_covered(
    demand_mb: float, expected: list[str]
) -> None:
    assert released(snapshot(AGED, demand_mb)) == expected


def test_value_per_byte_orders_before_age() -> None:
    # Same age, same tokens saved: the one holding twice the memory is worth half as much per byte.
    handles = [handle("small", age_s=60, mb=50), handle("big", age_s=60, mb=100)]
    assert released(snapshot(handles, 10)) == ["big"]
    # A long history is worth keeping longer than a short one of the same size and a lower age.
    handles = [
        handle("long-history", age_s=200, tokens=200_000),
        handle("short-history", age_s=60, tokens=500),
    ]
    assert released(snapshot(handles, 10)) == ["short-history"]


def test_only_the_demanding_node_gives_anything_back() -> None:
    handles = [handle("on-d0", age_s=60), handle("on-d1", age_s=400, node="d1")]
    assert released(snapshot(handles, 50)) == ["on-d0"]


def test_releases_carry_the_node_reason_and_the_demand_label() -> None:
    [release] = OnDemand().evaluate(snapshot(AGED, 1), VALUES)
    assert release.reason is ReleaseReason.NODE_BUDGET
    assert release.policy == "demand"
    assert release.retained_bytes == 100 * MB


def test_memory_another_policy_frees_in_the_same_round_counts_toward_the_demand() -> None:
    config = {"policies": [{"name": "max_age", "engine_ttl_s": 300, "margin_s": 0}, {"name": "demand"}]}
    out = RetentionPipeline.from_config(config).evaluate(snapshot(AGED, 150))
    # max_age takes "oldest" (100 MB); demand adds only "old" for the other 50 MB.
    assert [(r.conversation, r.policy) for r in out] == [("oldest", "max_age"), ("old", "demand")]


def test_the_default_pipeline_answers_demand_and_keeps_no_headroom() -> None:
    pipeline = RetentionPipeline.from_config(None)
    assert [p.name for p in pipeline.policies] == ["max_age", "demand", "low_value"]
    valuable = [handle(f"c{i}", age_s=5, mb=10, tokens=100_000) for i in range(4)]
    # 1% free and nobody waiting: everything stays.
    assert pipeline.evaluate(snapshot(valuable, 0, free=0.01)) == []
    # Someone waits for 15 MB: two 10 MB handles go, no more.
    assert len(pipeline.for_demand(snapshot(valuable, 15, free=0.01), "d0")) == 2
