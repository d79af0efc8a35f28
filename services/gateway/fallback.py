"""Which fallback engine serves a turn while routing is unreachable.

Without routing, the gateway knows only its configured lists and what its own legs saw. The
order of checks, for each role separately:

1. Candidates are taken in turn from a cursor that advances on every pick (round-robin), so a
   routing outage spreads its turns over every configured engine.
2. The engine a retry names as the one that just failed (`avoid`) is never chosen while another
   is configured.
3. An engine suspect at `now` (a recent leg to it failed) is skipped while a candidate that is not
   suspect remains.
4. When every remaining candidate is suspect, the first is tried all the same: a suspect may be
   back already, and a turn that could be served must not fail on a guess.

`pick_engine` is a pure rule; `FallbackEngines` only holds the cursors. Time is an argument.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from kvplane.services.gateway.suspects import SuspectEngines, engine_key


@dataclass(frozen=True, slots=True)
class FallbackPick:
    """The engine chosen, and why (for the turn's log line)."""

    url: str
    reason: str


def pick_engine(
    urls: Sequence[str], start: int, suspect: Collection[str], avoid: Collection[str] = ()
) -> FallbackPick:
    """The engine for one leg among `urls`, scanning from index `start` (see the module docstring).

    `suspect` and `avoid` hold URLs as `engine_key` spells them.
    """
    if not urls:
        raise ValueError("no fallback engines to pick from")
    order = [urls[(start + i) % len(urls)] for i in range(len(urls))]
    allowed = [u for u in order if engine_key(u) not in avoid] or order
    for url in allowed:
        if engine_key(url) not in suspect:
            return FallbackPick(url, "next in turn" if url == order[0] else "skipped failed engines")
    if len(allowed) < len(order):
        return FallbackPick(allowed[0], "every other engine suspect")
    return FallbackPick(allowed[0], "every engine suspect" if len(order) > 1 else "the only engine")


class FallbackEngines:
    """The configured fallback P and D engines, with a round-robin cursor per role.

    One per gateway, used from its event loop only.
    """

    def __init__(self, prefill: Sequence[str], decode: Sequence[str], suspects: SuspectEngines) -> None:
        self.prefill_urls = tuple(prefill)
        self.decode_urls = tuple(decode)
        self.suspects = suspects
        self._cursor = {"prefill": 0, "decode": 0}

    @property
    def configured(self) -> bool:
        return bool(self.prefill_urls and self.decode_urls)

    def prefill(self, now: float, avoid: Collection[str] = ()) -> FallbackPick:
        return self._pick("prefill", self.prefill_urls, now, avoid)

    def decode(self, now: float, avoid: Collection[str] = ()) -> FallbackPick:
        return self._pick("decode", self.decode_urls, now, avoid)

    def _pick(self, role: str, urls: Sequence[str], now: float, avoid: Collection[str]) -> FallbackPick:
        start = self._cursor[role]
        self._cursor[role] = (start + 1) % len(urls)
        return pick_engine(urls, start, self.suspects.current(now), {engine_key(u) for u in avoid})
