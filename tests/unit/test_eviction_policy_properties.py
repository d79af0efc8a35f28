"""Properties every retention pipeline keeps, on arbitrary fleets (hypothesis)."""

from __future__ import annotations

from collections import defaultdict

from hypothesis import given, settings
from hypothesis import strategies as st

from kvplane.services.eviction.policy.model import HandleInfo, NodeInfo, Snapshot
from kvplane.services.eviction.policy.pipeline import RetentionPipeline

NOW = 1_700_000_000_000
MB = 1 << 20
NODES = ("d0", "d1", "d2")
TENANTS = ("a", "b", "c")

handles = st.lists(
    st.builds(
        lambda i, node, tenant, mb, age_s, life_s, tokens: HandleInfo(
            tenant, f"c{i}", f"h{i}", node, mb * MB, tokens, NOW - age_s * 1000, NOW + life_s * 1000
        ),
        st.integers(0, 10_000),
        st.sampled_from(NODES),
        st.sampled_from(TENANTS),
        st.integers(1, 500),
        st.integers(0, 3000),
        st.integers(1, 3000),
        st.integers(1, 60_000),
    ),
    max_size=60,
    unique_by=lambda h: h.conversation,
)
free_fractions = st.tuples(*(st.floats(0.0, 1.0) for _ in NODES))

PIPELINE = RetentionPipeline.from_config(
    {
        "policies": [
            {"name": "max_age", "engine_ttl_s": 480, "margin_s": 30},
            {
                "name": "tenant_budget",
                "tenants": {"a": 2000 * MB},
                "default_bytes": 4000 * MB,
                "low_ratio": 0.9,
            },
            {"name": "node_budget", "high_bytes": 3000 * MB, "low_bytes": 2000 * MB},
            {"name": "kv_pressure", "low_free_fraction": 0.05, "target_free_fraction": 0.15},
            {"name": "low_value", "min_ratio": 1.0},
        ]
    }
)


@settings(max_examples=200, deadline=None)
@given(handles, free_fractions)
def test_the_pipeline_keeps_its_promises(fleet: list[HandleInfo], free: tuple[float, ...]) -> None:
    nodes = {n: NodeInfo(n, 64 << 30, 0, f) for n, f in zip(NODES, free, strict=True)}
    snapshot = Snapshot(NOW, tuple(fleet), nodes)
    releases = PIPELINE.evaluate(snapshot)
    by_key = {h.key: h for h in fleet}
    # Only handles that exist, each at most once, each with a reason and its own id.
    assert len({r.key for r in releases}) == len(releases)
    for r in releases:
        assert r.key in by_key and by_key[r.key].handle_id == r.handle_id
        assert r.reason is not None and r.policy
    gone = {r.key for r in releases}
    kept = [h for h in fleet if h.key not in gone]
    # Nothing at or past the age limit stays.
    assert all(h.age_s(NOW) < 450 for h in kept)
    # Budgets hold afterwards.
    per_tenant: dict[str, int] = defaultdict(int)
    per_node: dict[str, int] = defaultdict(int)
    for h in kept:
        per_tenant[h.tenant] += h.retained_bytes
        per_node[h.node_id] += h.retained_bytes
    assert per_tenant["a"] <= 2000 * MB
    assert all(per_tenant[t] <= 4000 * MB for t in ("b", "c"))
    assert all(v <= 3000 * MB for v in per_node.values())
    # Deterministic.
    assert PIPELINE.evaluate(snapshot) == releases
