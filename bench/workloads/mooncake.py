"""Conversations recovered from a Mooncake-format trace (chained prompt-block hash ids).

Each line of such a trace is one request::

    {"timestamp": <ms>, "input_length": <tokens>, "output_length": <tokens>,
     "hash_ids": [<one id per prompt block; equal prefixes give equal leading ids>]}

It has no conversation ids; what it defines is which requests share which
leading blocks. Ids are chained (the id at position k names the whole prefix
up to k), so the longest prefix a request shares with anything earlier ends
at its last id seen before, and one dict from id to its latest sender finds
the request that holds it (shared/traces/README.md: a request re-sending an
earlier request's leading blocks re-sends that context).

Linking, as the trace's README defines it:

- Block 0 is a system prompt nearly every request shares: it alone links
  nothing. A request sharing more than it (`min_shared_blocks`, 2) with an
  earlier request re-sends that request's context.
- It is the next turn of that request's conversation when that request is
  still the conversation's latest: a conversation is one line of requests.
- When the conversation has moved on since (its latest request no longer
  holds this prefix), the request starts a conversation of its own that
  shares the prefix: another session over the same system prompt or
  document (the trace has such prefixes, tens of thousands of tokens long,
  continued along several lines that interleave in time). Linking it to the
  other line would merge users.

Every turn carries its blocks' ids (`Turn.block_ids`), so prompts of
different conversations that share a prefix share it in the simulator's
prefix caches too.

The trace records prompts, not answers. A request that re-sends every whole
block of its conversation's previous prompt and is at least as long as that
prompt plus its answer is taken to re-send the answer verbatim, as chat APIs
do: it continues the whole previous context. Otherwise only the shared
blocks count as reused.

`trace_statistics` measures the README's own figures, which count a
continuation as 3 shared leading blocks with any earlier request.
"""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from kvplane.bench.workloads.turns import Turn

# The trace sits in shared/traces beside the repository's checkout; KVPLANE_MOONCAKE_TRACE overrides.
DEFAULT_TRACE = Path(
    os.environ.get(
        "KVPLANE_MOONCAKE_TRACE",
        Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake_conversation_trace.jsonl",
    )
)


# The README's figures count a continuation as this many shared leading blocks.
README_MIN_SHARED_BLOCKS = 3


@dataclass(frozen=True, slots=True)
class TraceFormat:
    """How to read a trace: block size in tokens, and the continuation rule (more than the
    system prompt's one block)."""

    block_size: int = 512
    min_shared_blocks: int = 2
    tenant: str = "default"


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Link:
    """Where one request belongs: its conversation and what it shares with it."""

    conversation: int
    # Index of the conversation's latest earlier request (-1 for a first turn).
    previous: int
    # Leading blocks shared with that request.
    shared_blocks: int
    # Leading blocks shared with any earlier request (a new line over a shared prefix too).
    resent_blocks: int
    # Seconds since the longest shared prefix was last sent (0 when nothing is shared).
    context_age_s: float


class TraceError(ValueError):
    """A trace line that cannot be read; the message names the line and the field."""


def _int_field(raw: dict[str, object], name: str, minimum: int, where: str) -> int:
    if name not in raw:
        raise TraceError(f"{where}: missing field {name!r}")
    value = raw[name]
    # JSON numbers only: a bool is an int to Python, and a float timestamp is fine if whole.
    if isinstance(value, bool) or not isinstance(value, int | float) or value != int(value):
        raise TraceError(f"{where}: field {name!r} must be an integer, got {value!r}")
    if value < minimum:
        raise TraceError(f"{where}: field {name!r} must be at least {minimum}, got {value!r}")
    return int(value)


def parse_request(line: str, where: str) -> TraceRequest:
    """One trace line; `where` (e.g. "trace.jsonl line 3") prefixes any error."""
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not valid JSON ({e.msg})") from None
    if not isinstance(raw, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(raw).__name__}")
    timestamp = _int_field(raw, "timestamp", 0, where)
    input_length = _int_field(raw, "input_length", 1, where)
    output_length = _int_field(raw, "output_length", 0, where)
    if "hash_ids" not in raw:
        raise TraceError(f"{where}: missing field 'hash_ids'")
    ids = raw["hash_ids"]
    if not isinstance(ids, list) or not all(isinstance(h, int) and not isinstance(h, bool) for h in ids):
        raise TraceError(f"{where}: field 'hash_ids' must be a list of integers")
    return TraceRequest(timestamp, input_length, output_length, tuple(ids))


def read_requests(path: str | Path = DEFAULT_TRACE) -> Iterator[TraceRequest]:
    """The trace's requests in order; a malformed line raises `TraceError` naming it and the field."""
    previous = 0
    with Path(path).open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path} line {number}"
            request = parse_request(line, where)
            # Conversations are linked in trace order, so time must not run backwards.
            if request.timestamp_ms < previous:
                raise TraceError(
                    f"{where}: field 'timestamp' {request.timestamp_ms} is earlier than the"
                    f" previous request's {previous}"
                )
            previous = request.timestamp_ms
            yield request


def _shared_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class ConversationLinker:
    """Assigns requests, fed in trace order, to conversations."""

    def __init__(self, fmt: TraceFormat) -> None:
        self.fmt = fmt
        self._holder: dict[int, int] = {}  # block id -> latest request that sent it
        self._conversation_of: list[int] = []
        self._latest: dict[int, int] = {}  # conversation -> its latest request
        self._requests: list[TraceRequest] = []

    def longest_shared(self, request: TraceRequest) -> tuple[int, int]:
        """Leading blocks `request` shares with any earlier request, and the latest such request
        (-1 if none)."""
        ids = request.hash_ids
        for i in range(len(ids) - 1, -1, -1):
            holder = self._holder.get(ids[i])
            if holder is not None:
                return i + 1, holder
        return 0, -1

    def link(self, request: TraceRequest) -> Link:
        index = len(self._requests)
        longest, source = self.longest_shared(request)
        if longest >= self.fmt.min_shared_blocks:
            conversation = self._conversation_of[source]
            age_s = (request.timestamp_ms - self._requests[source].timestamp_ms) / 1000.0
            if self._latest[conversation] == source:
                link = Link(conversation, source, longest, longest, age_s)
            else:
                # The conversation moved on from this prefix: another line over it starts here.
                link = Link(len(self._latest), -1, 0, longest, age_s)
        else:
            link = Link(len(self._latest), -1, 0, 0, 0.0)
        self._conversation_of.append(link.conversation)
        self._latest[link.conversation] = index
        self._requests.append(request)
        for h in request.hash_ids:
            self._holder[h] = index
        return link

    def request(self, index: int) -> TraceRequest:
        return self._requests[index]


def reused_prefix(request: TraceRequest, previous: TraceRequest, shared_blocks: int, block_size: int) -> int:
    """Leading tokens of `request` equal to `previous`'s prompt and, when re-sent whole, its answer."""
    whole_previous = previous.input_length // block_size
    context = previous.input_length + previous.output_length
    if shared_blocks >= whole_previous and request.input_length >= context:
        return context
    return min(shared_blocks * block_size, previous.input_length, request.input_length)


def conversation_turns(requests: Iterable[TraceRequest], fmt: TraceFormat | None = None) -> Iterator[Turn]:
    """The trace's requests as turns, in trace order."""
    fmt = fmt or TraceFormat()
    linker = ConversationLinker(fmt)
    turn_count: dict[int, int] = {}
    for request in requests:
        link = linker.link(request)
        index = turn_count.get(link.conversation, 0)
        turn_count[link.conversation] = index + 1
        reused = previous_context = 0
        if link.previous >= 0:
            previous = linker.request(link.previous)
            previous_context = previous.input_length + previous.output_length
            reused = reused_prefix(request, previous, link.shared_blocks, fmt.block_size)
        yield Turn(
            arrival_s=request.timestamp_ms / 1000.0,
            conversation=f"c{link.conversation}",
            turn_index=index,
            prompt_tokens=request.input_length,
            output_tokens=request.output_length,
            reused_prefix_tokens=reused,
            previous_context_tokens=previous_context,
            tenant=fmt.tenant,
            block_ids=request.hash_ids[: request.input_length // fmt.block_size],
            block_id_tokens=fmt.block_size,
        )


def mooncake_turns(
    path: str | Path = DEFAULT_TRACE, fmt: TraceFormat | None = None, seed: int | None = None
) -> list[Turn]:
    """The trace's turns in arrival order.

    The trace stamps requests in whole milliseconds; with a `seed`, each request arrives at a
    random point of its millisecond (requests stamped alike then come in a seeded order), so
    runs with other seeds see other interleavings, as replays of the same trace would. None:
    on the stamps, in trace order.
    """
    turns = list(conversation_turns(read_requests(path), fmt))
    if seed is None:
        return turns
    rng = random.Random(seed)
    jittered = [replace(t, arrival_s=t.arrival_s + rng.random() / 1000.0) for t in turns]
    jittered.sort(key=lambda t: t.arrival_s)
    return jittered


@dataclass(frozen=True, slots=True)
class TraceStatistics:
    """The figures shared/traces/README.md quotes, measured the same way."""

    requests: int
    continuations: int
    # Share of all prompt blocks that continuations re-send as their shared leading prefix.
    resent_block_share: float
    # Quantiles of the time since a continued context was last used, in seconds.
    gap_quantiles_s: dict[float, float]
    gaps_s: tuple[float, ...]
    input_quantiles: dict[float, int]
    max_input: int

    def share_of_gaps_over(self, seconds: float) -> float:
        return sum(1 for g in self.gaps_s if g > seconds) / len(self.gaps_s) if self.gaps_s else 0.0


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    # Nearest rank: the smallest value with at least q of the data at or below it.
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


def trace_statistics(requests: Iterable[TraceRequest], fmt: TraceFormat | None = None) -> TraceStatistics:
    """The README's figures: a continuation shares `README_MIN_SHARED_BLOCKS` leading blocks with
    any earlier request (whatever conversation the linker then gives it)."""
    fmt = fmt or TraceFormat()
    linker = ConversationLinker(fmt)
    count = continuations = blocks = resent = 0
    gaps: list[float] = []
    inputs: list[int] = []
    for request in requests:
        count += 1
        blocks += len(request.hash_ids)
        inputs.append(request.input_length)
        longest, source = linker.longest_shared(request)
        if longest >= README_MIN_SHARED_BLOCKS:
            continuations += 1
            resent += longest
            gaps.append((request.timestamp_ms - linker.request(source).timestamp_ms) / 1000.0)
        linker.link(request)
    gaps.sort()
    inputs.sort()
    qs = (0.10, 0.50, 0.90, 0.99)
    return TraceStatistics(
        requests=count,
        continuations=continuations,
        resent_block_share=resent / blocks if blocks else 0.0,
        gap_quantiles_s={q: _quantile(gaps, q) for q in qs} if gaps else {},
        gaps_s=tuple(gaps),
        input_quantiles={q: int(_quantile(inputs, q)) for q in (0.5, 0.9)} if inputs else {},
        max_input=inputs[-1] if inputs else 0,
    )
