"""Inter-turn gap statistics, learned online from the turns seen, with a weak prior.

A gap is the time from one turn's handle being published to the next turn of
the same conversation. The distribution lives in a log-binned histogram
(gaps span seconds to hours, so equal bins in log-time resolve both ends),
seeded with a few pseudo-observations of a deliberately vague log-normal
(`WEAK_PRIOR_GAP_QUANTILES`: p10 6 s, p50 60 s, p90 600 s, from an agent's
next call seconds later to a person reading for minutes). It is fitted to no
trace: at `GapPrior.global_weight` = 20 pseudo-observations, a few dozen real
gaps outweigh it. Each tenant's histogram borrows the global one as its
prior, so a tenant with few observations behaves like the fleet and drifts
to its own shape as turns arrive.

Not every turn has a successor: the chance that a conversation continues at
all is a Beta-Bernoulli estimate, fed by continuations and by conversations
that stayed silent past a horizon (see `TurnTracker`). Its prior is an even
chance worth two observations (Beta(1, 1), the uniform distribution).

Nothing here reads a clock or does I/O; callers pass times in.
"""

from __future__ import annotations

import itertools
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist
from types import MappingProxyType

# The prior's gap quantiles, in seconds: a minute typical, a decade of spread either way.
# A vague guess on purpose; the learned histogram replaces it within a few dozen gaps.
WEAK_PRIOR_GAP_QUANTILES: Mapping[float, float] = MappingProxyType({0.10: 6.0, 0.50: 60.0, 0.90: 600.0})
# The prior chance that a turn has a successor: even, for lack of knowledge.
WEAK_PRIOR_CONTINUE_RATE = 0.5

_STD_NORMAL = NormalDist()


@dataclass(frozen=True, slots=True)
class LogNormal:
    """A log-normal distribution: ln(gap) ~ Normal(mu, sigma)."""

    mu: float
    sigma: float

    def cdf(self, x_s: float) -> float:
        if x_s <= 0:
            return 0.0
        return _STD_NORMAL.cdf((math.log(x_s) - self.mu) / self.sigma)

    def quantile(self, q: float) -> float:
        return math.exp(self.mu + self.sigma * _STD_NORMAL.inv_cdf(q))


def fit_lognormal(quantiles: Mapping[float, float]) -> LogNormal:
    """Least-squares fit of ln(x_q) = mu + sigma * z_q over the given quantiles."""
    if len(quantiles) < 2:
        raise ValueError("need at least two quantiles to fit a log-normal")
    zs = [_STD_NORMAL.inv_cdf(q) for q in quantiles]
    ys = [math.log(x) for x in quantiles.values()]
    z_mean = sum(zs) / len(zs)
    y_mean = sum(ys) / len(ys)
    szz = sum((z - z_mean) ** 2 for z in zs)
    sigma = sum((z - z_mean) * (y - y_mean) for z, y in zip(zs, ys, strict=True)) / szz
    if sigma <= 0:
        raise ValueError("quantiles must increase with q")
    return LogNormal(y_mean - sigma * z_mean, sigma)


@dataclass(frozen=True, slots=True)
class BinLayout:
    """Log-spaced bin edges from `min_s` to `max_s`, plus an under- and an
    overflow bin. Overflow mass is spread log-uniformly up to `tail_factor`
    times `max_s`, beyond which no gap is expected."""

    min_s: float = 1.0
    max_s: float = 4 * 3600.0
    bins: int = 64
    tail_factor: float = 4.0

    def edges(self) -> list[float]:
        ratio = (self.max_s / self.min_s) ** (1.0 / self.bins)
        return [self.min_s * ratio**i for i in range(self.bins + 1)]

    def index(self, gap_s: float) -> int:
        """0 is the underflow bin, bins + 1 the overflow bin."""
        if gap_s < self.min_s:
            return 0
        if gap_s >= self.max_s:
            return self.bins + 1
        i = int(math.log(gap_s / self.min_s) / math.log(self.max_s / self.min_s) * self.bins)
        return 1 + min(i, self.bins - 1)


class GapHistogram:
    """Weighted counts of gaps over a `BinLayout`; answers CDF queries."""

    def __init__(self, layout: BinLayout, counts: Sequence[float] | None = None) -> None:
        self.layout = layout
        self._edges = layout.edges()
        self.counts = list(counts) if counts is not None else [0.0] * (layout.bins + 2)
        self._cum: list[float] | None = None
        if len(self.counts) != layout.bins + 2:
            raise ValueError("counts do not match the bin layout")

    @classmethod
    def from_distribution(cls, layout: BinLayout, dist: LogNormal, weight: float) -> GapHistogram:
        """`weight` pseudo-observations spread over the bins as `dist` says."""
        edges = layout.edges()
        cdfs = [dist.cdf(e) for e in edges]
        counts = [cdfs[0] * weight]
        counts += [(hi - lo) * weight for lo, hi in itertools.pairwise(cdfs)]
        counts.append((1.0 - cdfs[-1]) * weight)
        return cls(layout, counts)

    @property
    def total(self) -> float:
        return self._cumulative()[-1]

    def _cumulative(self) -> list[float]:
        # Mass up to and including each bin; rebuilt after a change, so a CDF
        # query costs O(1) however many handles are valued between changes.
        if self._cum is None:
            cum, running = [], 0.0
            for c in self.counts:
                running += c
                cum.append(running)
            self._cum = cum
        return self._cum

    def add(self, gap_s: float, weight: float = 1.0) -> None:
        self.counts[self.layout.index(gap_s)] += weight
        self._cum = None

    def scale(self, factor: float) -> None:
        self.counts = [c * factor for c in self.counts]
        self._cum = None

    def cdf(self, x_s: float) -> float:
        """P(gap <= x_s), log-linear within a bin."""
        cum = self._cumulative()
        total = cum[-1]
        if total <= 0 or x_s <= 0:
            return 0.0
        layout = self.layout
        if x_s < layout.min_s:
            # Underflow mass spread linearly over (0, min_s).
            return self.counts[0] * (x_s / layout.min_s) / total
        if x_s >= layout.max_s:
            mass = cum[layout.bins]
            tail_end = layout.max_s * layout.tail_factor
            frac = 1.0 if x_s >= tail_end else math.log(x_s / layout.max_s) / math.log(layout.tail_factor)
            return min(1.0, (mass + self.counts[-1] * frac) / total)
        i = layout.index(x_s)
        mass = cum[i - 1]
        lo, hi = self._edges[i - 1], self._edges[i]
        frac = math.log(x_s / lo) / math.log(hi / lo)
        return min(1.0, (mass + self.counts[i] * frac) / total)

    def blended(self, prior: GapHistogram, prior_weight: float) -> GapHistogram:
        """These counts plus `prior` rescaled to `prior_weight` observations."""
        prior_total = prior.total
        k = prior_weight / prior_total if prior_total > 0 else 0.0
        return GapHistogram(self.layout, [c + k * p for c, p in zip(self.counts, prior.counts, strict=True)])


@dataclass(frozen=True, slots=True)
class GapPrior:
    """Where the statistics start, and how much they trust the start."""

    quantiles: Mapping[float, float] = field(default_factory=lambda: WEAK_PRIOR_GAP_QUANTILES)
    # Pseudo-observations behind the global prior: few, so that observed gaps dominate soon.
    global_weight: float = 20.0
    # Pseudo-observations a tenant borrows from the global (learned) histogram.
    tenant_weight: float = 50.0
    continue_rate: float = WEAK_PRIOR_CONTINUE_RATE
    # Pseudo-observations behind the prior continue rate: Beta(1, 1).
    continue_weight: float = 2.0


class GapStatistics:
    """Online gap distribution, global and per tenant, and the continue rate.

    `p_next_turn_within(tenant, idle_s, window_s)` is the policy's input: the
    chance that a conversation silent for `idle_s` sends its next turn within
    the following `window_s`.
    """

    def __init__(
        self,
        prior: GapPrior | None = None,
        layout: BinLayout | None = None,
        *,
        max_weight: float = 20000.0,
        max_tenants: int = 10000,
    ) -> None:
        self.prior = prior or GapPrior()
        self.layout = layout or BinLayout()
        self.max_weight = max_weight
        self.max_tenants = max_tenants
        self.prior_distribution = fit_lognormal(self.prior.quantiles)
        self._global = GapHistogram.from_distribution(
            self.layout, self.prior_distribution, self.prior.global_weight
        )
        self._tenants: OrderedDict[str, GapHistogram] = OrderedDict()
        # Beta(continued, ended) over "a turn has a successor".
        self._continued: dict[str, float] = {}
        self._ended: dict[str, float] = {}
        self._global_continued = self.prior.continue_rate * self.prior.continue_weight
        self._global_ended = (1.0 - self.prior.continue_rate) * self.prior.continue_weight
        self._cache: dict[str, GapHistogram] = {}

    # -- learning --------------------------------------------------------------

    def observe_gap(self, tenant: str, gap_s: float) -> None:
        """A conversation's next turn came `gap_s` after the previous one."""
        self._global.add(gap_s)
        if self._global.total > self.max_weight:
            # Halving keeps the histogram adaptive: old traffic fades.
            self._global.scale(0.5)
        hist = self._tenants.get(tenant)
        if hist is None:
            hist = GapHistogram(self.layout)
            self._tenants[tenant] = hist
            while len(self._tenants) > self.max_tenants:
                gone, _ = self._tenants.popitem(last=False)
                # The least recently active tenant falls back to the global prior.
                self._continued.pop(gone, None)
                self._ended.pop(gone, None)
        self._tenants.move_to_end(tenant)
        hist.add(gap_s)
        if hist.total > self.max_weight:
            hist.scale(0.5)
        self._continued[tenant] = self._continued.get(tenant, 0.0) + 1.0
        self._global_continued += 1.0
        self._cache.clear()

    def observe_end(self, tenant: str) -> None:
        """A conversation sent no further turn within the tracking horizon."""
        self._ended[tenant] = self._ended.get(tenant, 0.0) + 1.0
        self._global_ended += 1.0
        self._cache.clear()

    # -- queries ----------------------------------------------------------------

    def distribution(self, tenant: str = "") -> GapHistogram:
        """The tenant's gap histogram with the global one as its prior."""
        cached = self._cache.get(tenant)
        if cached is not None:
            return cached
        own = self._tenants.get(tenant) if tenant else None
        hist = own.blended(self._global, self.prior.tenant_weight) if own is not None else self._global
        self._cache[tenant] = hist
        return hist

    def continue_rate(self, tenant: str = "") -> float:
        """P(a turn has a successor), the tenant's own counts over the global rate."""
        g_total = self._global_continued + self._global_ended
        global_rate = self._global_continued / g_total if g_total > 0 else self.prior.continue_rate
        # A tenant borrows the fleet's learned rate as it borrows the fleet's gap histogram.
        w = self.prior.tenant_weight
        c = self._continued.get(tenant, 0.0)
        e = self._ended.get(tenant, 0.0)
        return (c + w * global_rate) / (c + e + w)

    def p_next_turn_within(self, tenant: str, idle_s: float, window_s: float) -> float:
        """P(next turn in (idle_s, idle_s + window_s] | none by idle_s).

        With p the continue rate and F the gap CDF:
        p * (F(idle + window) - F(idle)) / (p * (1 - F(idle)) + 1 - p).
        """
        if window_s <= 0:
            return 0.0
        p = self.continue_rate(tenant)
        dist = self.distribution(tenant)
        f_idle = dist.cdf(idle_s)
        f_end = dist.cdf(idle_s + window_s)
        alive = p * (1.0 - f_idle) + (1.0 - p)
        if alive <= 0:
            return 0.0
        return max(0.0, min(1.0, p * (f_end - f_idle) / alive))


class TurnTracker:
    """Turns observed handle publishes into gap and end observations.

    A gap is measured publish to publish: the later publish comes after the
    next turn's prefill and decode, so it overstates the idle time by one
    turn's service time, seconds against gaps of minutes. Conversations silent
    past `horizon_s` count as ended. Memory is bounded by `max_conversations`;
    the oldest are dropped (and counted as ended).
    """

    def __init__(
        self, stats: GapStatistics, *, horizon_s: float = 3600.0, max_conversations: int = 200_000
    ) -> None:
        self.stats = stats
        self.horizon_s = horizon_s
        self.max_conversations = max_conversations
        self._last: OrderedDict[tuple[str, str], int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._last)

    def on_publish(self, tenant: str, conversation: str, published_unix_ms: int) -> float | None:
        """Records a turn; returns the gap it closed, in seconds, if any."""
        key = (tenant, conversation)
        previous = self._last.get(key)
        gap: float | None = None
        if previous is not None:
            if published_unix_ms <= previous:
                return None  # a re-delivered or out-of-order publish
            gap = (published_unix_ms - previous) / 1000.0
            self.stats.observe_gap(tenant, gap)
        self._last[key] = published_unix_ms
        self._last.move_to_end(key)
        while len(self._last) > self.max_conversations:
            (old_tenant, _), _ = self._last.popitem(last=False)
            self.stats.observe_end(old_tenant)
        return gap

    def expire(self, now_unix_ms: int) -> int:
        """Counts conversations silent past the horizon as ended; returns how many."""
        cutoff = now_unix_ms - int(self.horizon_s * 1000)
        ended = 0
        # Entries are kept in order of their last turn, so the silent ones lead.
        while self._last:
            key, last = next(iter(self._last.items()))
            if last >= cutoff:
                break
            del self._last[key]
            self.stats.observe_end(key[0])
            ended += 1
        return ended
