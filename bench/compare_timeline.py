"""Each turn's TTFT split into the engines' time and the front's own.

The sim-engines time every request they finish (`/sim/timeline`: arrival, first token, finish, by
the prompt's digest). Joined with the client's turns by that digest, a turn's legs are the
requests with its prompt that arrived between the turn's start and its first token, and its TTFT
is the engines' time on those legs plus what the front added:

- before: from the turn's start to the first leg's arrival (the front's routing, its parsing and
  forwarding of the body);
- between: from the end of each leg to the arrival of the next (P's answer back, D's leg sent);
- after: from the last leg's first token to the client's (the relay of D's stream).

Every process reads the same CLOCK_MONOTONIC (`time.perf_counter()` on Linux), so the times of
client and engines compare. A zero-hop client's share is the client's own cost of two calls, the
floor every front's share stands on.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

TIMELINE = "/sim/timeline"
_READ_TIMEOUT = aiohttp.ClientTimeout(total=120)


@dataclass(frozen=True)
class Leg:
    """One request an engine finished."""

    engine: str
    arrived: float
    first_token: float
    finished: float


@dataclass(frozen=True)
class FrontShare:
    """What a front added to one turn's TTFT (ms), by where."""

    before_ms: float
    between_ms: float
    after_ms: float
    # Each leg's engine and its time there (ms): to its end, the last leg to its first token.
    legs: tuple[tuple[str, float], ...]


async def _get(session: aiohttp.ClientSession, url: str, since: int) -> dict[str, Any]:
    async with session.get(url + TIMELINE, params={"since": str(since)}, timeout=_READ_TIMEOUT) as resp:
        resp.raise_for_status()
        answer: dict[str, Any] = await resp.json()
        return answer


async def cursors(session: aiohttp.ClientSession, engines: Mapping[str, str]) -> dict[str, int]:
    """Each engine's last finished request now (by engine name), to read on from after a block."""
    # Since a seq no request reaches: only `last_seq` comes back.
    answers = await asyncio.gather(*(_get(session, url, 1 << 62) for url in engines.values()))
    return {name: int(a["last_seq"]) for name, a in zip(engines, answers, strict=True)}


async def legs_since(
    session: aiohttp.ClientSession, engines: Mapping[str, str], since: Mapping[str, int]
) -> dict[str, list[Leg]]:
    """The requests the engines finished after `since`, by prompt digest, earliest arrival first."""
    answers = await asyncio.gather(*(_get(session, url, since[name]) for name, url in engines.items()))
    out: dict[str, list[Leg]] = defaultdict(list)
    for name, answer in zip(engines, answers, strict=True):
        for r in answer["requests"]:
            out[r["digest"]].append(Leg(name, r["arrived"], r["first_token"], r["finished"]))
    for legs in out.values():
        legs.sort(key=lambda leg: leg.arrived)
    return dict(out)


def front_share(started: float, first_token: float, legs: Sequence[Leg]) -> FrontShare | None:
    """The front's share of a turn that started at `started` and whose client saw its first token
    at `first_token`, from the legs of its prompt (None: no leg of it arrived in between, or the
    last one's first token came after the client's, as a clock at odds would have it)."""
    mine = [leg for leg in legs if started <= leg.arrived <= first_token]
    if not mine or mine[-1].first_token > first_token:
        return None
    between = sum(nxt.arrived - prev.finished for prev, nxt in itertools.pairwise(mine))
    times = [(leg.engine, (leg.finished - leg.arrived) * 1e3) for leg in mine[:-1]]
    times.append((mine[-1].engine, (mine[-1].first_token - mine[-1].arrived) * 1e3))
    return FrontShare(
        (mine[0].arrived - started) * 1e3,
        between * 1e3,
        (first_token - mine[-1].first_token) * 1e3,
        tuple(times),
    )
