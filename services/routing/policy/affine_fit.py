"""An online least-squares fit of a cost that is affine in a few counts: y = c0 + c1*x1 + c2*x2 ...

Exponentially weighted ridge regression, kept as its normal equations so
that each sample is one rank-one update and one small solve:

- every sample weighs `alpha`, and every update multiplies what was there
  before by `1 - alpha`, so the fit follows a drifting engine with a memory
  of about `1 / alpha` samples, like a moving average with the same alpha;
- a sample's weight is also divided by its size squared (|z|^2, z below), so
  the fit weighs relative errors: a large turn does not outvote many small
  ones, and one sample moves the fit about `alpha` of the way to it, as a
  moving average would, whatever its size;
- the prior (the configured coefficients) is the fit's starting point and
  weighs 1 before any sample, as a moving average's start does: after n
  samples it weighs (1 - alpha)^n (alpha 0.1: a third after 10 samples, 4%
  after 30). Each coefficient's prior never weighs less than
  `min_prior_weight` times that coefficient's own weight in the samples: a
  coefficient the samples cannot tell apart from another (every turn
  computes one message's worth, so the fixed cost and the per-token rate
  move together; no turn ever reused a token) stays near its prior instead
  of drifting on noise, while one they do measure moves to within that
  share of the truth;
- counts are divided by `scale` before the fit, so the prior holds each
  coefficient as firmly as one sample of that size would, and the solve
  stays well conditioned whatever the units;
- coefficients are kept at or above `floor` (a cost never falls with more
  work): one that would fall below is held there and the others refitted.

A frozen value: `update` returns the new fit, so a replay of the same
samples gives the same fit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class AffineFit:
    """c0 + c1*x1 + ..., fitted online; the intercept c0 is coefficient 0."""

    # The coefficients before any sample, and what the fit leans on where samples say nothing.
    prior: tuple[float, ...]
    # A typical size of each count (x1, x2, ...): a sample of this size weighs like the prior.
    scale: tuple[float, ...]
    # The least each coefficient may be.
    floor: tuple[float, ...]
    alpha: float = 0.1
    min_prior_weight: float = 1e-6
    prior_weight: float = 1.0
    # Sum of weight * z z^T over samples, z = (1, x1/scale1, ...): row-major, n x n.
    zz: tuple[float, ...] = ()
    # Sum of weight * z * y.
    zy: tuple[float, ...] = ()
    # The fitted coefficients, in the caller's units (empty: the prior).
    coef: tuple[float, ...] = ()
    samples: int = 0

    def __post_init__(self) -> None:
        n = len(self.prior)
        if n < 1 or len(self.scale) != n - 1 or len(self.floor) != n:
            raise ValueError("prior, scale (one per count) and floor must match")
        if any(s <= 0 for s in self.scale):
            raise ValueError("scales must be positive")
        if not 0 < self.alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        if not 0 < self.min_prior_weight <= 1:
            raise ValueError("min_prior_weight must be in (0, 1]")

    @property
    def coefficients(self) -> tuple[float, ...]:
        return self.coef or tuple(max(p, f) for p, f in zip(self.prior, self.floor, strict=True))

    def predict(self, counts: tuple[float, ...]) -> float:
        c = self.coefficients
        return c[0] + sum(ci * xi for ci, xi in zip(c[1:], counts, strict=True))

    def update(self, counts: tuple[float, ...], y: float) -> AffineFit:
        """The fit with one more sample: `y` observed for `counts`."""
        n = len(self.prior)
        if len(counts) != n - 1:
            raise ValueError(f"expected {n - 1} counts")
        z = (1.0, *(x / s for x, s in zip(counts, self.scale, strict=True)))
        keep = 1.0 - self.alpha
        a = self.alpha / sum(v * v for v in z)
        zz = self.zz or (0.0,) * (n * n)
        zy = self.zy or (0.0,) * n
        zz = tuple(keep * zz[i * n + j] + a * z[i] * z[j] for i in range(n) for j in range(n))
        zy = tuple(keep * zy[i] + a * z[i] * y for i in range(n))
        weight = self.prior_weight * keep
        # Each coefficient's pull toward its prior never falls below a share of its own samples'
        # weight: where the samples cannot tell two coefficients apart, the prior decides.
        weights = [max(weight, self.min_prior_weight * zz[i * n + i]) for i in range(n)]
        scaled = _solve_bounded(zz, zy, weights, self._scaled(self.prior), self._scaled(self.floor))
        coef = tuple(c / s for c, s in zip(scaled, (1.0, *self.scale), strict=True))
        return replace(self, prior_weight=weight, zz=zz, zy=zy, coef=coef, samples=self.samples + 1)

    def _scaled(self, values: tuple[float, ...]) -> tuple[float, ...]:
        return tuple(v * s for v, s in zip(values, (1.0, *self.scale), strict=True))


def _solve_bounded(
    zz: tuple[float, ...],
    zy: tuple[float, ...],
    weights: list[float],
    prior: tuple[float, ...],
    floor: tuple[float, ...],
) -> list[float]:
    """argmin of sum_i weights_i*(c_i - prior_i)^2 + c^T zz c - 2 c^T zy with c >= floor (an active set)."""
    n = len(prior)
    held: dict[int, float] = {}
    while True:
        free = [i for i in range(n) if i not in held]
        # (diag(weights) + zz) c = weights*prior + zy, over the free coefficients, the held ones fixed.
        m = [[zz[i * n + j] + (weights[i] if i == j else 0.0) for j in free] for i in free]
        rhs = [weights[i] * prior[i] + zy[i] - sum(zz[i * n + j] * v for j, v in held.items()) for i in free]
        solved = _gauss(m, rhs) if free else []
        c = [0.0] * n
        for i, v in held.items():
            c[i] = v
        for i, v in zip(free, solved, strict=True):
            c[i] = v
        below = [i for i in free if c[i] < floor[i]]
        if not below:
            return c
        worst = min(below, key=lambda i: c[i] - floor[i])
        held[worst] = floor[worst]


def _gauss(m: list[list[float]], rhs: list[float]) -> list[float]:
    """Solves m x = rhs (m symmetric positive definite, so no pivot is zero)."""
    n = len(rhs)
    a = [[*row, r] for row, r in zip(m, rhs, strict=True)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(col + 1, n):
            f = a[r][col] / a[col][col]
            if f:
                for k in range(col, n + 1):
                    a[r][k] -= f * a[col][k]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (a[r][n] - sum(a[r][k] * x[k] for k in range(r + 1, n))) / a[r][r]
    return x
