"""How long simulated compute takes.

Prefill of ``n`` uncached tokens takes ``a + b*n + c*n**2`` seconds; each
decode step takes ``d + e*running`` seconds. Everything is divided by
``speedup`` so tests can run the same behaviour faster.

The defaults are calibrated to the published Qwen3-32B TTFT curve: 158 ms at
2,000 tokens and 778 ms at 24,000 tokens. Those two points give a concave
curve (12x the tokens, 4.9x the time), which no non-negative quadratic term
can follow, so the default fit is linear: ``c = 0``, and ``a`` and ``b`` are
the line through both points (a = 101.6 ms of fixed cost, b = 28.2 us per
token). ``fit_two_points`` recomputes them for another model's curve.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# The published anchor points: (prompt tokens, TTFT seconds).
QWEN3_32B_TTFT_POINTS: tuple[tuple[int, float], tuple[int, float]] = ((2_000, 0.158), (24_000, 0.778))


def fit_two_points(
    p1: tuple[int, float], p2: tuple[int, float], quadratic_s: float = 0.0
) -> tuple[float, float]:
    """(a, b) of a + b*n + c*n**2 through two (tokens, seconds) points, for a given c."""
    (n1, t1), (n2, t2) = p1, p2
    if n1 == n2:
        raise ValueError("the two points need different token counts")
    b = ((t2 - quadratic_s * n2 * n2) - (t1 - quadratic_s * n1 * n1)) / (n2 - n1)
    a = t1 - b * n1 - quadratic_s * n1 * n1
    return a, b


_A, _B = fit_two_points(*QWEN3_32B_TTFT_POINTS)


@dataclass(frozen=True)
class TimingModel:
    """Modelled compute times, in seconds."""

    prefill_base_s: float = _A
    prefill_per_token_s: float = _B
    prefill_per_token_sq_s: float = 0.0
    # A Qwen3-32B decode step at moderate batch is a few tens of ms.
    decode_step_s: float = 0.025
    decode_step_per_running_s: float = 0.0001
    speedup: float = 1.0

    def __post_init__(self) -> None:
        if self.speedup <= 0:
            raise ValueError("speedup must be positive")
        if (
            min(
                self.prefill_base_s,
                self.prefill_per_token_s,
                self.prefill_per_token_sq_s,
                self.decode_step_s,
                self.decode_step_per_running_s,
            )
            < 0
        ):
            raise ValueError("timing parameters must be non-negative")

    def prefill_s(self, computed_tokens: int) -> float:
        """Time to prefill ``computed_tokens`` uncached tokens (at least one forward pass)."""
        n = max(computed_tokens, 0)
        return (
            self.prefill_base_s + self.prefill_per_token_s * n + self.prefill_per_token_sq_s * n * n
        ) / self.speedup

    def decode_s(self, running: int) -> float:
        """Time of one decode step with ``running`` requests in the batch."""
        return (self.decode_step_s + self.decode_step_per_running_s * max(running, 1)) / self.speedup

    def with_speedup(self, speedup: float) -> TimingModel:
        return replace(self, speedup=speedup)
