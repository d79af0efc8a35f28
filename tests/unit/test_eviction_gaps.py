"""Gap statistics and value ordering on synthetic gap distributions."""

from __future__ import annotations

import random

import pytest

from kvplane.services.eviction.policy.gaps import (
    BinLayout,
    GapHistogram,
    GapPrior,
    GapStatistics,
    LogNormal,
    TurnTracker,
    fit_lognormal,
)
from kvplane.services.eviction.policy.model import HandleInfo, NodeInfo, Snapshot
from kvplane.services.eviction.policy.value import ValueModel

NOW = 1_700_000_000_000


def test_the_prior_is_the_documented_weak_guess_and_fitted_to_no_trace() -> None:
    stats = GapStatistics()
    dist = stats.distribution()
    for q, gap_s in ((0.10, 6.0), (0.50, 60.0), (0.90, 600.0)):
        assert dist.cdf(gap_s) == pytest.approx(q, abs=0.04)
    assert stats.continue_rate() == pytest.approx(0.5)


def test_a_few_dozen_observed_gaps_outweigh_the_prior() -> None:
    stats = GapStatistics()
    rng = random.Random(3)
    for _ in range(60):
        stats.observe_gap("t", rng.uniform(400.0, 500.0))
    dist = stats.distribution()
    # The prior put half its mass under 60 s; the learned distribution puts little there.
    assert dist.cdf(60.0) < 0.15
    assert dist.cdf(500.0) > 0.6


def test_the_continue_rate_is_learned_from_continuations_and_ends() -> None:
    stats = GapStatistics()
    for _ in range(10):
        stats.observe_gap("t", 30.0)
    for _ in range(90):
        stats.observe_end("t")
    assert stats.continue_rate() == pytest.approx(11 / 102)
    assert stats.continue_rate("t") < 0.15


@pytest.mark.parametrize(
    ("quantiles", "mu", "sigma"),
    [
        ({0.5: 100.0, 0.8413447460685429: 271.8281828459045}, 4.60517, 1.0),
        ({0.1: 10.0, 0.5: 10.0 * 3.6, 0.9: 10.0 * 3.6 * 3.6}, 3.58352, 0.99953),
    ],
)
def test_lognormal_fit(quantiles: dict[float, float], mu: float, sigma: float) -> None:
    fit = fit_lognormal(quantiles)
    assert fit.mu == pytest.approx(mu, abs=1e-3)
    assert fit.sigma == pytest.approx(sigma, abs=1e-3)


def test_histogram_cdf_is_monotone_and_bounded() -> None:
    hist = GapHistogram.from_distribution(BinLayout(), LogNormal(4.8, 1.0), 100)
    xs = [0.1, 0.9, 1, 5, 60, 600, 6000, 14399, 14400, 30000, 57600, 1e6]
    cdfs = [hist.cdf(x) for x in xs]
    assert cdfs == sorted(cdfs)
    assert cdfs[0] >= 0 and cdfs[-1] == 1.0


# The chance that a conversation idle `idle_s` returns within `window_s`.
P_CASES = [
    # (gaps the tenant showed, conversations that ended, idle, window, lower bound, upper bound)
    ("fast tenant, fresh handle", [8.0] * 400, 0, 1.0, 60.0, 0.5, 1.0),
    ("fast tenant, half its conversations end, fresh handle", [8.0] * 400, 400, 1.0, 60.0, 0.4, 0.6),
    ("fast tenant, half end, idle long past its gaps", [8.0] * 400, 400, 120.0, 300.0, 0.0, 0.1),
    ("slow tenant, fresh handle, short window", [900.0] * 400, 0, 1.0, 60.0, 0.0, 0.1),
    ("slow tenant, idle 600 s, window to 1200 s", [900.0] * 400, 0, 600.0, 600.0, 0.5, 1.0),
]


@pytest.mark.parametrize(
    ("name", "gaps", "ends", "idle", "window", "low", "high"), P_CASES, ids=[c[0] for c in P_CASES]
)
def test_p_next_turn_follows_the_tenants_own_gaps(
    name: str, gaps: list[float], ends: int, idle: float, window: float, low: float, high: float
) -> None:
    stats = GapStatistics()
    for g in gaps:
        stats.observe_gap("t", g)
    for _ in range(ends):
        stats.observe_end("t")
    assert low <= stats.p_next_turn_within("t", idle, window) <= high


def test_ended_conversations_lower_the_chance_of_return() -> None:
    stats = GapStatistics()
    before = stats.p_next_turn_within("t", 10, 400)
    for _ in range(500):
        stats.observe_end("t")
    assert stats.p_next_turn_within("t", 10, 400) < before / 3
    # Other tenants lean on the global rate, which moved less.
    assert stats.p_next_turn_within("u", 10, 400) > stats.p_next_turn_within("t", 10, 400)


def info(
    name: str, tenant: str, age_s: float, life_s: float = 600, tokens: int = 8000, mb: int = 200
) -> HandleInfo:
    return HandleInfo(
        tenant, name, f"h-{name}", "d0", mb << 20, tokens, NOW - int(age_s * 1000), NOW + int(life_s * 1000)
    )


@pytest.mark.parametrize(
    ("name", "observations", "handles", "expected_order"),
    [
        (
            "global prior: the long-idle handle goes first",
            {},
            [info("fresh", "a", 30), info("stale", "a", 1500), info("mid", "a", 300)],
            ["stale", "mid", "fresh"],
        ),
        (
            "a fast tenant's idle handle goes before a slow tenant's equally idle one",
            {"fast": [10.0] * 300, "slow": [600.0] * 300},
            [info("slow-60", "slow", 60), info("fast-60", "fast", 60)],
            ["fast-60", "slow-60"],
        ),
        (
            "bimodal gaps: a handle in the trough between modes is worth less than one entering a mode",
            {"bi": [5.0] * 200 + [800.0] * 200},
            [info("at-700", "bi", 700, life_s=300), info("at-100", "bi", 100, life_s=300)],
            ["at-100", "at-700"],
        ),
        (
            "same chance: fewer tokens saved is worth less",
            {},
            [info("long", "a", 60, tokens=30000), info("short", "a", 60, tokens=1000)],
            ["short", "long"],
        ),
        (
            "same chance and tokens: more bytes held costs more",
            {},
            [info("small", "a", 60, mb=100), info("big", "a", 60, mb=4000)],
            ["big", "small"],
        ),
    ],
)
def test_value_ordering_on_synthetic_gap_distributions(
    name: str, observations: dict[str, list[float]], handles: list[HandleInfo], expected_order: list[str]
) -> None:
    stats = GapStatistics()
    for tenant, gaps in observations.items():
        for g in gaps:
            stats.observe_gap(tenant, g)
    model = ValueModel(stats)
    snap = Snapshot(NOW, tuple(handles), {"d0": NodeInfo("d0", 64 << 30)})
    assert [h.conversation for h in model.lowest_value_first(list(handles), snap)] == expected_order


def test_learning_moves_the_distribution_toward_observed_gaps() -> None:
    rng = random.Random(7)
    stats = GapStatistics(GapPrior(global_weight=50))
    for _ in range(3000):
        stats.observe_gap("t", rng.lognormvariate(2.0, 0.3))  # median ~7.4 s
    assert stats.distribution("t").cdf(7.4) == pytest.approx(0.5, abs=0.1)
    assert stats.distribution().cdf(7.4) > 0.4  # the global histogram learned too


def test_turn_tracker_measures_gaps_and_counts_silence_as_an_end() -> None:
    stats = GapStatistics()
    tracker = TurnTracker(stats, horizon_s=100)
    assert tracker.on_publish("t", "c1", NOW) is None
    assert tracker.on_publish("t", "c1", NOW + 42_000) == 42.0
    assert tracker.on_publish("t", "c1", NOW + 42_000) is None  # a re-delivered publish
    tracker.on_publish("t", "c2", NOW + 50_000)
    assert tracker.expire(NOW + 143_000) == 1  # c1 silent 101 s; c2 only 93 s
    assert len(tracker) == 1


def test_tenant_memory_is_bounded_and_the_forgotten_fall_back_to_the_fleet() -> None:
    stats = GapStatistics(max_tenants=2)
    for tenant in ("a", "b", "c"):
        for _ in range(200):
            stats.observe_gap(tenant, 5.0)
    fleet = stats.distribution()
    assert stats.distribution("a") is fleet  # forgotten: the global histogram
    assert stats.distribution("c") is not fleet
    assert stats.continue_rate("a") == stats.continue_rate("never-seen")
