"""A seeded synthetic workload of agentic sessions.

Sessions arrive as a Poisson process. Each runs a number of turns drawn from
a shifted geometric distribution. Between turns the agent either calls a tool
(a short pause, then the tool's output joins the context) or waits for its
user (minutes, with a Pareto tail that reaches past the engine's TTL). The
context grows every turn by the answer and the new tool output or message.

Three things break an exact continuation, as they do in real agents:
stripping the previous answer's reasoning (the new prompt keeps the old
prompt but not the answer verbatim), and compaction when the context would
pass `context_limit_tokens` (only the system prompt survives, plus a summary).

The generator is open-loop, like a trace: the next turn's arrival adds a
nominal answer time (`nominal_s_per_output_token`), not the simulated one.
Turns come out in arrival order, lazily, so a million of them never sit in
memory at once.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

from kvplane.bench.workloads.turns import Turn


@dataclass(frozen=True, slots=True)
class LogNormalSpec:
    """A log-normal by its median and the sigma of its logarithm."""

    median: float
    sigma: float

    def draw(self, rng: random.Random) -> float:
        return self.median * math.exp(self.sigma * rng.gauss(0.0, 1.0))


@dataclass(frozen=True, slots=True)
class AgenticWorkload:
    """Parameters of the generator (seconds, tokens)."""

    seed: int = 0
    sessions_per_s: float = 0.5
    # Sessions start within [0, duration_s); their later turns may run past it.
    duration_s: float = 3600.0
    # Stop after this many turns in all (0: no cap).
    max_turns: int = 0
    mean_turns: float = 8.0
    tenants: int = 1
    # A system prompt every session starts with (0: none).
    system_prompt_tokens: int = 2048
    first_message: LogNormalSpec = LogNormalSpec(400.0, 1.0)
    output: LogNormalSpec = LogNormalSpec(250.0, 0.8)
    tool_output: LogNormalSpec = LogNormalSpec(1200.0, 1.2)
    user_message: LogNormalSpec = LogNormalSpec(80.0, 0.8)
    tool_call_probability: float = 0.7
    tool_pause: LogNormalSpec = LogNormalSpec(3.0, 0.8)
    user_think: LogNormalSpec = LogNormalSpec(60.0, 1.0)
    # A share of user pauses comes from a Pareto tail: gaps of many minutes.
    long_pause_probability: float = 0.12
    long_pause_min_s: float = 300.0
    long_pause_alpha: float = 1.3
    strip_reasoning_probability: float = 0.05
    context_limit_tokens: int = 128_000
    summary_tokens: int = 2048
    nominal_s_per_output_token: float = 0.03

    def __post_init__(self) -> None:
        if self.sessions_per_s <= 0 or self.duration_s <= 0 or self.mean_turns < 1:
            raise ValueError("sessions_per_s and duration_s must be positive, mean_turns at least 1")


class _Session:
    """A live session's state between its turns."""

    __slots__ = ("context", "index", "name", "next_is_tool", "prompt", "tenant", "turns_left")

    def __init__(self, name: str, tenant: str, turns: int) -> None:
        self.name = name
        self.tenant = tenant
        self.turns_left = turns
        self.index = 0
        self.prompt = 0
        self.context = 0
        # Whether the pause before the next turn is a tool call (its output joins the context).
        self.next_is_tool = False


def _turns(rng: random.Random, mean: float) -> int:
    # 1 + geometric with the given mean: most sessions are short, a few run long.
    if mean <= 1:
        return 1
    p = 1.0 / mean
    return 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - p))


def agentic_turns(spec: AgenticWorkload) -> Iterator[Turn]:
    """The workload's turns in arrival order."""
    rng = random.Random(spec.seed)
    pending: list[tuple[float, int, _Session]] = []
    seq = 0
    emitted = 0
    next_session = rng.expovariate(spec.sessions_per_s)
    sessions = 0
    while True:
        if next_session < spec.duration_s and (not pending or next_session <= pending[0][0]):
            tenant = f"t{rng.randrange(spec.tenants)}" if spec.tenants > 1 else "default"
            session = _Session(f"s{sessions}", tenant, _turns(rng, spec.mean_turns))
            sessions += 1
            heapq.heappush(pending, (next_session, seq, session))
            seq += 1
            next_session += rng.expovariate(spec.sessions_per_s)
            continue
        if not pending:
            return
        arrival, _, session = heapq.heappop(pending)
        yield _next_turn(spec, rng, session, arrival)
        emitted += 1
        if spec.max_turns and emitted >= spec.max_turns:
            return
        session.turns_left -= 1
        if session.turns_left > 0:
            gap = _gap(spec, rng, session)
            heapq.heappush(pending, (arrival + gap, seq, session))
            seq += 1


def _next_turn(spec: AgenticWorkload, rng: random.Random, session: _Session, arrival: float) -> Turn:
    output = max(1, int(spec.output.draw(rng)))
    previous_context = session.context
    if session.index == 0:
        prompt = spec.system_prompt_tokens + max(1, int(spec.first_message.draw(rng)))
        reused = 0
    else:
        source = spec.tool_output if session.next_is_tool else spec.user_message
        added = max(1, int(source.draw(rng)))
        if previous_context + added > spec.context_limit_tokens:
            # Compaction: the history is replaced by a summary; only the system prompt is shared.
            prompt = spec.system_prompt_tokens + spec.summary_tokens + added
            reused = min(spec.system_prompt_tokens, previous_context)
        elif rng.random() < spec.strip_reasoning_probability:
            # The answer's reasoning is dropped: the old prompt is kept, the answer shortened.
            kept_answer = (previous_context - session.prompt) // 2
            prompt = session.prompt + kept_answer + added
            reused = session.prompt
        else:
            prompt = previous_context + added
            reused = previous_context
    turn = Turn(
        arrival_s=arrival,
        conversation=session.name,
        turn_index=session.index,
        prompt_tokens=prompt,
        output_tokens=output,
        reused_prefix_tokens=reused,
        previous_context_tokens=previous_context,
        tenant=session.tenant,
    )
    session.index += 1
    session.prompt = prompt
    session.context = prompt + output
    return turn


def _gap(spec: AgenticWorkload, rng: random.Random, session: _Session) -> float:
    answer_s = (session.context - session.prompt) * spec.nominal_s_per_output_token
    session.next_is_tool = rng.random() < spec.tool_call_probability
    if session.next_is_tool:
        return answer_s + spec.tool_pause.draw(rng)
    if rng.random() < spec.long_pause_probability:
        pareto: float = spec.long_pause_min_s * (1.0 - rng.random()) ** (-1.0 / spec.long_pause_alpha)
        return answer_s + pareto
    return answer_s + spec.user_think.draw(rng)
