"""Table-driven tests of each retention policy plugin and their composition."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from kvplane.services.common.model.handles import ReleaseReason
from kvplane.services.eviction.policy.base import PolicyConfigError
from kvplane.services.eviction.policy.demand import OnDemand
from kvplane.services.eviction.policy.kv_pressure import KvPressure
from kvplane.services.eviction.policy.low_value import LowValue
from kvplane.services.eviction.policy.max_age import MaxAge
from kvplane.services.eviction.policy.model import HandleInfo, NodeInfo, Snapshot
from kvplane.services.eviction.policy.node_budget import NodeBudget
from kvplane.services.eviction.policy.pipeline import RetentionPipeline, build_policy
from kvplane.services.eviction.policy.tenant_budget import TenantBudget
from kvplane.services.eviction.policy.value import ValueModel

NOW = 1_700_000_000_000
MB = 1 << 20
GB = 1 << 30


def handle(
    name: str,
    *,
    node: str = "d0",
    tenant: str = "acme",
    mb: int = 100,
    age_s: float = 60,
    life_s: float = 400,
    tokens: int = 8000,
) -> HandleInfo:
    return HandleInfo(
        tenant=tenant,
        conversation=name,
        handle_id=f"h-{name}",
        node_id=node,
        retained_bytes=mb * MB,
        num_tokens=tokens,
        published_unix_ms=NOW - int(age_s * 1000),
        wall_expiry_unix_ms=NOW + int(life_s * 1000),
    )


def released(releases: list) -> list[str]:  # type: ignore[type-arg]
    return [r.conversation for r in releases]


VALUES = ValueModel()


# -- max_age ---------------------------------------------------------------------------


@dataclass(frozen=True)
class AgeCase:
    name: str
    policy: MaxAge
    ages_s: tuple[float, ...]
    expected: tuple[int, ...]


AGE_CASES = [
    AgeCase("default limit is ttl minus margin", MaxAge(480, 30), (100, 449, 450, 470), (2, 3)),
    AgeCase("max_age below the ttl wins", MaxAge(1800, 60, max_age_s=300), (299, 300, 900), (1, 2)),
    AgeCase("max_age above ttl minus margin is capped", MaxAge(480, 30, max_age_s=1000), (449, 451), (1,)),
    AgeCase("nothing old enough", MaxAge(480, 30), (0, 10, 200), ()),
]


@pytest.mark.parametrize("case", AGE_CASES, ids=lambda c: c.name)
def test_max_age(case: AgeCase) -> None:
    handles = tuple(handle(f"c{i}", age_s=a) for i, a in enumerate(case.ages_s))
    out = case.policy.evaluate(Snapshot(NOW, handles), VALUES)
    assert released(out) == [f"c{i}" for i in case.expected]
    assert all(r.reason is ReleaseReason.MAX_AGE and r.policy == "max_age" for r in out)


@pytest.mark.parametrize("bad", [{"engine_ttl_s": 30, "margin_s": 30}, {"margin_s": -1}, {"max_age_s": 0}])
def test_max_age_rejects_a_limit_at_or_past_the_ttl(bad: dict[str, float]) -> None:
    with pytest.raises(PolicyConfigError):
        MaxAge(**bad)  # type: ignore[arg-type]


# -- node_budget ------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeCase:
    name: str
    policy: NodeBudget
    capacity: int
    handles: tuple[HandleInfo, ...]
    expected: tuple[str, ...]


NODE_CASES = [
    NodeCase(
        "under the high watermark: nothing",
        NodeBudget(high_bytes=500 * MB, low_bytes=300 * MB),
        0,
        (handle("a"), handle("b"), handle("c")),
        (),
    ),
    NodeCase(
        "between the marks after a release: nothing (hysteresis)",
        NodeBudget(high_bytes=450 * MB, low_bytes=300 * MB),
        0,
        (handle("a"), handle("b"), handle("c"), handle("d")),
        (),
    ),
    NodeCase(
        "over high: oldest (lowest value) released down to low",
        NodeBudget(high_bytes=350 * MB, low_bytes=200 * MB),
        0,
        (
            handle("young", age_s=5),
            handle("mid", age_s=100),
            handle("old", age_s=1500),
            handle("older", age_s=2500),
        ),
        ("older", "old"),
    ),
    NodeCase(
        "fractions of capacity",
        NodeBudget(high_fraction=0.3, low_fraction=0.1),
        1000 * MB,
        (handle("a", age_s=10), handle("b", age_s=20), handle("c", age_s=30), handle("d", age_s=40)),
        ("d", "c", "b"),
    ),
    NodeCase(
        "fractions without a reported capacity: nothing",
        NodeBudget(high_fraction=0.1, low_fraction=0.05),
        0,
        (handle("a"), handle("b")),
        (),
    ),
    NodeCase(
        "the tighter of bytes and fraction applies",
        NodeBudget(high_bytes=1000 * MB, low_bytes=1000 * MB, high_fraction=0.15, low_fraction=0.1),
        1000 * MB,
        (handle("a", age_s=10), handle("b", age_s=20)),
        ("b",),
    ),
    NodeCase(
        "a short handle is worth less than a long one of the same size and age",
        NodeBudget(high_bytes=150 * MB, low_bytes=100 * MB),
        0,
        (handle("long", tokens=30000), handle("short", tokens=500)),
        ("short",),
    ),
    NodeCase(
        "per node: another node's handles don't count",
        NodeBudget(high_bytes=150 * MB, low_bytes=100 * MB),
        0,
        (handle("a", age_s=10), handle("b", node="d1", age_s=20), handle("c", node="d2", age_s=30)),
        (),
    ),
]


def test_node_budget_counts_what_the_node_reports_when_it_is_more() -> None:
    handles = (handle("a", age_s=10), handle("b", age_s=20))
    policy = NodeBudget(high_bytes=250 * MB, low_bytes=150 * MB)
    quiet = Snapshot(NOW, handles, {"d0": NodeInfo("d0", 0, 120 * MB)})
    assert policy.evaluate(quiet, VALUES) == []
    # 300 MB pinned by the node's count, 200 MB of it in handles: both go.
    loud = Snapshot(NOW, handles, {"d0": NodeInfo("d0", 0, 300 * MB)})
    assert released(policy.evaluate(loud, VALUES)) == ["b", "a"]


@pytest.mark.parametrize("case", NODE_CASES, ids=lambda c: c.name)
def test_node_budget(case: NodeCase) -> None:
    nodes = {n: NodeInfo(n, case.capacity) for n in ("d0", "d1", "d2")}
    out = case.policy.evaluate(Snapshot(NOW, case.handles, nodes), VALUES)
    assert released(out) == list(case.expected)
    assert all(r.reason is ReleaseReason.NODE_BUDGET for r in out)


def test_node_budget_leaves_the_node_at_or_under_its_low_watermark() -> None:
    handles = tuple(handle(f"c{i}", mb=10 + i, age_s=10 * i) for i in range(50))
    policy = NodeBudget(high_bytes=600 * MB, low_bytes=400 * MB)
    out = policy.evaluate(Snapshot(NOW, handles), VALUES)
    gone = set(released(out))
    left = sum(h.retained_bytes for h in handles if h.conversation not in gone)
    assert left <= 400 * MB
    # Minimal: putting back the last one released would cross the low mark.
    assert left + out[-1].retained_bytes > 400 * MB


@pytest.mark.parametrize(
    "bad",
    [
        {},
        {"high_bytes": 10},
        {"high_bytes": 10, "low_bytes": 20},
        {"high_fraction": 0.5, "low_fraction": 0.6},
        {"high_fraction": 1.5, "low_fraction": 0.5},
    ],
)
def test_node_budget_rejects_bad_watermarks(bad: dict[str, float]) -> None:
    with pytest.raises(PolicyConfigError):
        NodeBudget(**bad)  # type: ignore[arg-type]


# -- tenant_budget ------------------------------------------------------------------------


@dataclass(frozen=True)
class TenantCase:
    name: str
    policy: TenantBudget
    handles: tuple[HandleInfo, ...]
    expected: tuple[str, ...]


TENANT_CASES = [
    TenantCase(
        "no budgets: nothing",
        TenantBudget(),
        (handle("a"), handle("b", tenant="other")),
        (),
    ),
    TenantCase(
        "an over-budget tenant loses its lowest-value handles across nodes",
        TenantBudget({"acme": 250 * MB}, low_ratio=0.5),
        (
            handle("a", age_s=10),
            handle("b", node="d1", age_s=900),
            handle("c", node="d2", age_s=300),
            handle("x", tenant="other", age_s=5000),
        ),
        ("b", "c"),
    ),
    TenantCase(
        "the default budget covers unnamed tenants; named ones keep theirs",
        TenantBudget({"vip": 10 * GB}, default_bytes=150 * MB, low_ratio=1.0),
        (
            handle("v1", tenant="vip"),
            handle("v2", tenant="vip"),
            handle("z1", tenant="z", age_s=10),
            handle("z2", tenant="z", age_s=20),
        ),
        ("z2",),
    ),
    TenantCase(
        "a zero budget releases everything",
        TenantBudget({"banned": 0}),
        (handle("a", tenant="banned"), handle("b", tenant="banned")),
        ("a", "b"),
    ),
]


@pytest.mark.parametrize("case", TENANT_CASES, ids=lambda c: c.name)
def test_tenant_budget(case: TenantCase) -> None:
    out = case.policy.evaluate(Snapshot(NOW, case.handles), VALUES)
    assert sorted(released(out)) == sorted(case.expected)
    assert all(r.reason is ReleaseReason.TENANT_BUDGET for r in out)


# -- low_value ------------------------------------------------------------------------------


@dataclass(frozen=True)
class LowCase:
    name: str
    policy: LowValue
    handle: HandleInfo
    release: bool


LOW_CASES = [
    LowCase("fresh and long: keep", LowValue(), handle("a", age_s=30, tokens=20000), False),
    LowCase(
        "idle far past every usual gap: release",
        LowValue(),
        handle("a", age_s=5000, mb=2000, life_s=3000),
        True,
    ),
    LowCase(
        "younger than min_age: keep whatever",
        LowValue(min_age_s=6000),
        handle("a", age_s=5000, mb=2000, life_s=3000),
        False,
    ),
    LowCase(
        "huge and tiny in tokens: release", LowValue(), handle("a", age_s=60, mb=20000, tokens=100), True
    ),
    LowCase(
        "ratio 0 never releases", LowValue(min_ratio=0), handle("a", age_s=60, mb=20000, tokens=100), False
    ),
]


@pytest.mark.parametrize("case", LOW_CASES, ids=lambda c: c.name)
def test_low_value(case: LowCase) -> None:
    snap = Snapshot(NOW, (case.handle,), {"d0": NodeInfo("d0", 64 * GB)})
    out = case.policy.evaluate(snap, VALUES)
    assert (len(out) == 1) is case.release
    assert all(r.reason is ReleaseReason.LOW_VALUE for r in out)


# -- the pipeline ---------------------------------------------------------------------------


def test_pipeline_releases_each_handle_once_with_the_first_reason() -> None:
    pipeline = RetentionPipeline.from_config(
        {
            "policies": [
                {"name": "max_age", "engine_ttl_s": 480, "margin_s": 30},
                {"name": "node_budget", "high_bytes": 150 * MB, "low_bytes": 100 * MB},
            ]
        }
    )
    handles = (handle("stale", age_s=460), handle("a", age_s=50), handle("b", age_s=100))
    out = pipeline.evaluate(Snapshot(NOW, handles))
    # max_age takes "stale", leaving 200 MB: node_budget releases one more.
    assert [(r.conversation, r.reason) for r in out] == [
        ("stale", ReleaseReason.MAX_AGE),
        ("b", ReleaseReason.NODE_BUDGET),
    ]


def test_pipeline_is_deterministic() -> None:
    pipeline = RetentionPipeline.from_config(None)
    handles = tuple(handle(f"c{i}", mb=100 + i, age_s=i * 37 % 900) for i in range(40))
    snap = Snapshot(NOW, handles, {"d0": NodeInfo("d0", 4 * GB)})
    assert pipeline.evaluate(snap) == pipeline.evaluate(snap)


@pytest.mark.parametrize(
    "config",
    [
        {"policies": [{"name": "nope"}]},
        {"policies": [{"name": "max_age", "bogus": 1}]},
        {"policies": [], "extra": {}},
        {"policies": [], "value": {"prefill_tokens_per_s": -1}},
        {"policies": [], "gaps": {"unknown": 1}},
    ],
)
def test_bad_configuration_is_rejected_by_name(config: dict[str, object]) -> None:
    with pytest.raises(PolicyConfigError):
        RetentionPipeline.from_config(config)


def test_plugins_are_built_by_name() -> None:
    assert build_policy({"name": "tenant_budget", "tenants": {"a": 5}}).name == "tenant_budget"
    assert isinstance(build_policy({"name": "low_value"}), LowValue)


# -- kv_pressure -----------------------------------------------------------------------------


@dataclass(frozen=True)
class PressureCase:
    name: str
    policy: KvPressure
    free: float
    capacity: int
    expected: tuple[str, ...]


PRESSURE_HANDLES = (
    handle("a", age_s=10),
    handle("b", age_s=300),
    handle("c", age_s=900),
    handle("d", age_s=1800),
)
PRESSURE_CASES = [
    PressureCase("plenty free: nothing", KvPressure(0.05, 0.15), 0.5, 4000 * MB, ()),
    PressureCase("at the trigger: nothing", KvPressure(0.05, 0.15), 0.05, 4000 * MB, ()),
    # 2% free of 4,000 MB: 520 MB to free toward 15%: six 100 MB handles would
    # do; only four exist, all go, lowest value first.
    PressureCase(
        "short: free toward the target", KvPressure(0.05, 0.15), 0.02, 4000 * MB, ("d", "c", "b", "a")
    ),
    # 4% free of 2,000 MB: 120 MB toward 10%: two handles.
    PressureCase("just short: the two least valuable", KvPressure(0.05, 0.10), 0.04, 2000 * MB, ("d", "c")),
    PressureCase("no capacity reported: nothing", KvPressure(0.05, 0.15), 0.01, 0, ()),
]


@pytest.mark.parametrize("case", PRESSURE_CASES, ids=lambda c: c.name)
def test_kv_pressure(case: PressureCase) -> None:
    snap = Snapshot(NOW, PRESSURE_HANDLES, {"d0": NodeInfo("d0", case.capacity, 0, case.free)})
    out = case.policy.evaluate(snap, VALUES)
    assert released(out) == list(case.expected)
    assert all(r.reason is ReleaseReason.NODE_BUDGET and r.policy == "kv_pressure" for r in out)


def test_kv_pressure_rejects_a_target_below_the_trigger() -> None:
    with pytest.raises(PolicyConfigError):
        KvPressure(0.2, 0.1)


# -- host tier -----------------------------------------------------------------------------


def test_handles_in_host_memory_free_nothing_on_the_device_so_device_policies_pass_them_over() -> None:
    """A node short of KV cache gets its device handles back; its host-tier ones stay retained."""
    on_host = [dataclasses.replace(handle(f"host-{i}", age_s=900, mb=400), on_device=False) for i in range(3)]
    on_device = [handle("dev-old", age_s=300), handle("dev-new", age_s=10)]
    nodes = {"d0": NodeInfo("d0", 1000 * MB, 0, 0.01, 150 * MB)}
    snap = Snapshot(NOW, tuple(on_host + on_device), nodes)

    by_policy = {
        "node_budget": NodeBudget(high_bytes=150 * MB, low_bytes=100 * MB).evaluate(snap, VALUES),
        "kv_pressure": KvPressure(0.05, 0.15).evaluate(snap, VALUES),
        "demand": OnDemand().evaluate(snap, VALUES),
    }

    for name, releases in by_policy.items():
        assert released(releases), name
        assert all(r.startswith("dev-") for r in released(releases)), name
    # A release chosen for another reason does not count as memory handed back to the device.
    assert snap.without({h.key: None for h in on_host}).nodes["d0"].demand_bytes == 150 * MB
    assert snap.without({on_device[0].key: None}).nodes["d0"].demand_bytes == 50 * MB
