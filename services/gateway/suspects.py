"""Engines this gateway saw fail recently, by URL, each until its expiry.

Routing keeps the cluster's own suspect list; this one is the gateway's, for the turns it serves
without routing (its fallback engines). It is fed by the same signal the gateway reports to routing
as a failed node: a leg refused, reset or timed out. An entry lapses by itself after `suspect_s`:
the engine is then tried again, and a live one simply serves. Time is an argument (monotonic
seconds), never read here.
"""

from __future__ import annotations


def engine_key(url: str) -> str:
    """The same engine however its URL was spelt in settings or by routing (a trailing slash)."""
    return url.rstrip("/")


class SuspectEngines:
    """URL -> the time until which the engine is skipped when another can be chosen."""

    def __init__(self, suspect_s: float) -> None:
        if suspect_s <= 0:
            raise ValueError(f"suspect_s must be positive, got {suspect_s}")
        self.suspect_s = suspect_s
        self._until: dict[str, float] = {}

    def mark(self, url: str, now: float) -> None:
        """The engine at `url` failed a leg at `now`."""
        self._forget_lapsed(now)
        self._until[engine_key(url)] = now + self.suspect_s

    def current(self, now: float) -> frozenset[str]:
        """The engines still suspect at `now` (keys as `engine_key` spells them)."""
        self._forget_lapsed(now)
        return frozenset(self._until)

    def _forget_lapsed(self, now: float) -> None:
        # Pruned on every use: the set never holds more than the engines that failed in the last
        # `suspect_s`, however many distinct URLs routing ever named.
        for url in [u for u, until in self._until.items() if until <= now]:
            del self._until[url]
