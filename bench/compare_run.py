"""Running blocks: one front's conversations of one repeat at one concurrency, measured apart.

A block starts from the same engine state for every front (engines idle, no decode handle left
from an earlier block, the front's processes settled), reads every counter, runs its
conversations with at most `concurrency` in flight, waits until the front's background work has
settled (kvplane reports each turn after its stream ends), and reads the counters again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import aiohttp

from kvplane.bench import compare_metrics as metrics
from kvplane.bench import compare_timeline as timeline
from kvplane.bench.compare_fronts import Conversation, Front, FrontError
from kvplane.bench.compare_timeline import Leg, front_share
from kvplane.bench.compare_workload import BlockPlan, ConversationShape, extended, prompt_tokens, request_body
from kvplane.connector.simengine.timeline import prompt_digest

NOT_SENT = "not sent: an earlier turn of the conversation failed"


@dataclass(frozen=True)
class TurnRecord:
    """One planned turn, completed or not."""

    front: str
    concurrency: int
    repeat: int
    conversation: int
    turn: int  # 0 is the first turn
    prompt_tokens: int
    ok: bool
    ttft_ms: float = 0.0
    decision: str = ""
    error: str = ""
    # Seconds from the block's start.
    sent_s: float = 0.0
    done_s: float = 0.0
    # The answer's time per output token after the first (nan: not measured).
    tpot_ms: float = math.nan
    # The prompt's digest (token-id prompts) and the turn's start (perf_counter; TTFT is measured
    # from it), to find the turn's legs on the engines; what the front added to its TTFT, by where
    # (compare_timeline.py; nan: not found).
    digest: str = ""
    started_at: float = math.nan
    front_before_ms: float = math.nan
    front_between_ms: float = math.nan
    front_after_ms: float = math.nan
    # Each of its legs' engine and time there (ms; compare_timeline.FrontShare.legs).
    legs: tuple[tuple[str, float], ...] = ()

    @property
    def front_ms(self) -> float:
        return self.front_before_ms + self.front_between_ms + self.front_after_ms


@dataclass
class BlockResult:
    """A block's turns and the counters' differences over it."""

    front: str
    concurrency: int
    repeat: int
    position: int  # the front's place in its repeat's order
    turns: list[TurnRecord] = field(default_factory=list)
    wall_s: float = 0.0  # from the block's start to its last turn's end
    measured_s: float = 0.0  # between the two readings (settling included)
    settled: bool = True
    released_handles: int = 0
    cpu_s: dict[str, float] = field(default_factory=dict)
    sources: dict[str, float] = field(default_factory=dict)
    etcd: dict[str, float] = field(default_factory=dict)
    gateway: dict[str, float] = field(default_factory=dict)
    # The engines' own TTFT, summed and counted over the block (`ttft_s:p0`, `ttft_n:p0`, ...).
    engines: dict[str, float] = field(default_factory=dict)

    @property
    def ok_turns(self) -> int:
        return sum(t.ok for t in self.turns)

    def decisions(self) -> Counter[str]:
        return Counter(t.decision for t in self.turns if t.ok and t.decision)


@dataclass(frozen=True)
class Engines:
    """The shared engines and the processes watched around every block."""

    prefills: Sequence[str]
    decodes: Sequence[str]
    etcd_url: str
    # kvplane fronts' gateways by front (their Route timings are read around their blocks).
    gateway_urls: Mapping[str, Sequence[str]]
    # Every process whose CPU is read (all fronts', the engines', this client's).
    pids: Mapping[str, int]
    # The Prometheus pages of kvplane's processes that talk to etcd (their etcd requests by
    # operation): the services, every routing replica, a gateway routing in its own process.
    services_metrics_urls: Sequence[str] = ()

    @property
    def all(self) -> list[str]:
        return [*self.prefills, *self.decodes]

    @property
    def named(self) -> dict[str, str]:
        """The engines by name: p0, p1, ... then d0, d1, ..."""
        return {
            **{f"p{i}": url for i, url in enumerate(self.prefills)},
            **{f"d{i}": url for i, url in enumerate(self.decodes)},
        }


async def _conversation(
    session: aiohttp.ClientSession,
    front: Front,
    plan: BlockPlan,
    shape: ConversationShape,
    started: float,
    timeout_s: float,
) -> list[TurnRecord]:
    rng = plan.tokens(shape.index)
    prompt = plan.draw(rng, shape.first_tokens)
    state = Conversation(plan.conversation_id(shape.index), shape.index)
    out: list[TurnRecord] = []
    turns = 1 + len(shape.user_tokens)
    base = (plan.front, plan.concurrency, plan.repeat, shape.index)
    for turn in range(turns):
        digest = prompt_digest(prompt) if isinstance(prompt, list) else ""
        sent = time.perf_counter() - started
        try:
            async with asyncio.timeout(timeout_s):
                outcome = await front.turn(session, state, request_body(prompt, plan.answer_tokens))
            if len(outcome.output) != plan.answer_tokens:
                raise FrontError(f"{len(outcome.output)} output tokens, not {plan.answer_tokens}")
        except Exception as exc:  # any failure fails the turn, never the run
            done = time.perf_counter() - started
            out.append(
                TurnRecord(
                    *base, turn, prompt_tokens(prompt), False, error=repr(exc)[:300], sent_s=sent, done_s=done
                )
            )
            out += [TurnRecord(*base, t, 0, False, error=NOT_SENT) for t in range(turn + 1, turns)]
            return out
        done = time.perf_counter() - started
        out.append(
            TurnRecord(
                *base,
                turn,
                prompt_tokens(prompt),
                True,
                outcome.ttft_ms,
                outcome.decision,
                sent_s=sent,
                done_s=done,
                tpot_ms=outcome.tpot_ms,
                digest=digest,
                started_at=outcome.started_at,
            )
        )
        if turn + 1 < turns:
            prompt = extended(prompt, outcome.output, outcome.text, plan.draw(rng, shape.user_tokens[turn]))
            if plan.think_s > 0:
                await asyncio.sleep(plan.think_s)  # the user's pause, the same for every front
    return out


async def drive(
    session: aiohttp.ClientSession, front: Front, plan: BlockPlan, timeout_s: float
) -> tuple[list[TurnRecord], float]:
    """Runs the block's conversations, `concurrency` at a time; returns the turns and the wall time.

    Each of `concurrency` workers takes the next conversation as soon as its last one ends; the
    first conversations start at their planned offsets (the same for every front).
    """
    started = time.perf_counter()
    queue = iter(plan.shapes)
    records: list[TurnRecord] = []

    async def worker() -> None:
        for shape in queue:
            wait = started + shape.start_s - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)  # the planned arrival of this conversation
            records.extend(await _conversation(session, front, plan, shape, started, timeout_s))

    await asyncio.gather(*(worker() for _ in range(min(plan.concurrency, len(plan.shapes)))))
    last = max((t.done_s for t in records), default=0.0)
    records.sort(key=lambda t: (t.conversation, t.turn))
    return records, last


def with_front_shares(turns: Sequence[TurnRecord], legs: Mapping[str, Sequence[Leg]]) -> list[TurnRecord]:
    """The turns, each completed one with the front's share of its TTFT where its legs are found."""
    out = []
    for t in turns:
        share = None
        if t.ok and t.digest:
            first_token_at = t.started_at + t.ttft_ms / 1e3
            share = front_share(t.started_at, first_token_at, legs.get(t.digest, ()))
        if share is not None:
            t = dataclasses.replace(
                t,
                front_before_ms=share.before_ms,
                front_between_ms=share.between_ms,
                front_after_ms=share.after_ms,
                legs=share.legs,
            )
        out.append(t)
    return out


async def prepare(session: aiohttp.ClientSession, engines: Engines, front: Front) -> int:
    """The same starting state for every block; returns the decode handles it released."""
    await metrics.wait_idle(session, engines.all)
    released = await metrics.release_decode_handles(session, engines.decodes)
    await metrics.set_decode_retention(session, engines.decodes, front.decode_retention)
    await metrics.set_decode_host_tier(session, engines.decodes, front.decode_host_tier)
    await metrics.settle(front.processes())
    return released


async def run_block(
    session: aiohttp.ClientSession,
    engines: Engines,
    front: Front,
    plan: BlockPlan,
    position: int,
    *,
    turn_timeout_s: float = 300.0,
) -> BlockResult:
    """One measured block."""
    result = BlockResult(plan.front, plan.concurrency, plan.repeat, position)
    result.released_handles = await prepare(session, engines, front)
    args = (
        session,
        engines.pids,
        engines.prefills,
        engines.etcd_url,
        engines.gateway_urls.get(plan.front, ()),
        engines.services_metrics_urls,
        engines.named,
        engines.decodes,
    )
    before = await metrics.read_all(*args)
    since = await timeline.cursors(session, engines.named)
    turns, result.wall_s = await drive(session, front, plan, turn_timeout_s)
    await metrics.wait_idle(session, engines.all)
    result.turns = with_front_shares(turns, await timeline.legs_since(session, engines.named, since))
    result.settled = await metrics.settle(front.processes())
    after = await metrics.read_all(*args, ends_window=True)
    result.measured_s = after.at - before.at
    result.cpu_s = metrics.delta(after.cpu, before.cpu)
    result.sources = metrics.delta(after.sources, before.sources)
    result.etcd = metrics.delta(after.etcd, before.etcd)
    result.gateway = metrics.delta(after.gateway, before.gateway)
    result.engines = metrics.delta(after.engines, before.engines)
    return result


@dataclass(frozen=True)
class IdleWindow:
    """Counters over a window with no traffic: what the stack does by itself."""

    seconds: float
    engines: int
    cpu_s: dict[str, float]
    etcd: dict[str, float]

    def etcd_per_s(self, key: str) -> float:
        return self.etcd.get(key, 0.0) / self.seconds if self.seconds > 0 else 0.0

    def cpu_per_s(self, process: str) -> float:
        """CPU seconds per second `process` spent with no traffic (0 for one not measured)."""
        return self.cpu_s.get(process, 0.0) / self.seconds if self.seconds > 0 else 0.0


async def idle_window(session: aiohttp.ClientSession, engines: Engines, seconds: float) -> IdleWindow:
    await metrics.wait_idle(session, engines.all)
    await metrics.release_decode_handles(session, engines.decodes)
    args = (session, engines.pids, engines.prefills, engines.etcd_url, (), engines.services_metrics_urls)
    before = await metrics.read_all(*args)
    await asyncio.sleep(seconds)  # the measurement window itself
    after = await metrics.read_all(*args, ends_window=True)
    return IdleWindow(
        after.at - before.at,
        len(engines.all),
        metrics.delta(after.cpu, before.cpu),
        metrics.delta(after.etcd, before.etcd),
    )
