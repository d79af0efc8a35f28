"""The discrete-event loop: turns arrive, P computes, D decodes and retains, handles go.

Events sit in one heap as (time, sequence, kind, payload) tuples; arrivals
are read lazily from the workload, so memory does not grow with its length.
Time is simulated seconds from the workload's start; policies see it as
Unix milliseconds from `SimConfig.epoch_unix_ms`.

Per turn:

1. The router picks P and D and, maybe, a handle to pull up to some length
   (its `remote_num_tokens`; single use: D frees the handle's blocks once P
   has read them). A handle routed to a pull is checked out: no other route
   gets it and no control-plane release frees it.
2. The turn joins P's waiting queue once the front's own hop is over
   (`SimConfig.control_path_s`: kvplane's gateway waits for its Route
   answer before it sends the P leg). P is one compute stream whose
   scheduler takes turns in order, as vLLM's does (below).
3. When P's scheduler takes the turn, P looks its prefix cache up first, as
   vLLM does: it holds the leading blocks of the prompts it computed or
   imported, until pressure recycles them (`prefix_cache.py`). A pull moves
   only what P lacks (`remote_num_tokens` minus the local hit), and P
   computes the rest (plus the attention over the held and pulled tokens,
   see `costs.py`). TTFT is arrival to the end of that compute, or later if
   D cannot admit the turn then.
4. D hears of the turn when P is done, as the gateway (and vLLM's proxies)
   send a turn's D leg only once P answers, and reserves the turn's KV
   (prompt and answer) then. The default engine model is vLLM's: `pressure="wait"`. Retained blocks stay
   pinned until read, released or expired, and a turn that does not fit
   waits (FIFO) for memory; its first token, hence its TTFT, waits with it.
   The what-if `pressure="evict"` is an engine that may drop retained KV
   under pressure: D frees its oldest retained handles first; if that is not
   enough the turn runs anyway and is counted as overcommitted (a
   preemption).
5. After decoding, D keeps the turn's KV as the conversation's handle until
   it is read, released by the control plane or freed by D's TTL (or, with
   `pressure="evict"`, pushed out). Then the router hears P's report of the
   turn (its cache hits, pulled and computed tokens), as routing gets
   ReportTurn from the gateway after D's last token: until then its record
   of P's cache is what it believed at routing, whatever P evicted since.

A host tier (`ClusterSpec.decode_host_bytes`, the tiered engine model). Each
D has host memory for KV beside its accelerators. With kvplane's control
plane, a handle stays on D's accelerators until the control plane wants its
blocks back (a demand, its value, its age): then, as a live D does on the
leader's MoveCommand or when it runs short itself, D copies it to host memory
(`SimCosts.spill_s`), making room there by dropping entries in the control
plane's value order, and frees its accelerator blocks once the copy is
whole: the handle stays the conversation's and readable, from host memory,
and is offered until `decode_host_ttl_s` after its publish. While the copy
is under way the control plane no longer judges the handle (nor after: a
host-tier handle leaves by its TTL, a full tier or its conversation moving
on), and a demand waits for the copy (D's demand counts those bytes as
freed). A handle for which no room can be made is freed. A live D short of
blocks starts its copies at once; here they start when the demand is
answered (`demand_latency_s` later), and a demand that lasts is repeated
every `DEFAULT_DEMAND_REFRESH_S` (the node agent's default), as a live agent
repeats it: turns ending on a full D turn their running blocks into retained
handles, not free ones, and only a repeated demand has those released. A
pull reads from whichever tier holds the handle, at the same cost (the NIC
bounds both). A superseded handle (its
conversation moved on) is freed from both. `ClusterSpec.decode_write_through`
is a what-if no engine runs: D copies each handle as it publishes it, and
frees its accelerator blocks once the copy is whole.

Copies ahead (`ClusterSpec.decode_copy_ahead`, the default, as both live
engines run). D starts the copy as it publishes a handle, off every turn's
path, where host memory can be made to hold it (below), and keeps the handle
on its accelerators. Moving it then waits only for what is left of
that copy (nothing, once it is whole). A turn short of blocks on D first
moves, at once, the handles whose copies are whole, in the control plane's
order (least expected reuse per byte first), as a live D does by itself
before it asks the control plane; only the rest waits for a demand's answer.
A copy ahead takes host memory as a move would: room is made by dropping
handles there in the control plane's order, as vLLM's CPU tier evicts older
blocks to store new ones, and only then by giving back older copies ahead
(their handles are still on the accelerators; giving them back first would
leave the next moves to wait for whole copies). A handle that ends on the
accelerators gives its copy back. With
`decode_offload_all` instead (llm-d's P/D + P2P path), D offloads every
finished turn's KV to the host tier, an LRU of blocks by hash, keeps nothing
on its accelerators, and a route may name a D whose host tier P reads from
(`RouteChoice.source`); nothing is freed by the read.

When a pull starts. vLLM's prefill engine does not read a remote prefix when
a request arrives: its scheduler asks the connector for external tokens
(`get_num_new_matched_tokens`) only when it takes the request from the
waiting queue, right after the local prefix-cache lookup. An asynchronous
read then parks the request in `WAITING_FOR_REMOTE_KVS`, with its blocks
allocated, and the scheduler goes on to other requests; once the worker
reports the read finished, the request is cached and put back, and requests
that already hold KV blocks are scheduled before new ones. Here: P's
scheduler, whenever its compute stream is free, takes the turn whose read
has landed first, else the head of its waiting queue; a turn with blocks to
pull starts its read then (its transfer begins only when P takes it, never
at arrival) and P moves on to the next waiting turn while the read is in
flight; the turn's compute starts once its read is done and P is free. D's
blocks stay allocated until the read finishes (or D's own TTL or pressure
frees them first, and the pull fails: P recomputes).

A pull the router marks `prefix_ok=False` (no prefix check, and the prompt
does not extend the handle) imports KV computed for other tokens: the turn
is counted as a wrong-prefix turn and none of its pulled tokens as reuse.
The blocks it imports, and those P computes after them, land in P's cache
under the prompt's hashes, as they would in vLLM, and D keeps the turn's
context built on them: a later turn that hits those blocks in P's cache, or
pulls them from D, is served wrong KV too and is counted the same way (its
tokens from the first wrong block on are wrong-prefix tokens, not reuse).
"""

from __future__ import annotations

import heapq
import random
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import cast

from kvplane.bench.sim.block_chain import BlockChain, BlockIds, NamedBlocks
from kvplane.bench.sim.cluster import ClusterSpec, DecodeState, PrefillState, SimHandle
from kvplane.bench.sim.costs import SimCosts
from kvplane.bench.sim.fleet import Conversation, Fleet
from kvplane.bench.sim.results import Recorder, SimResult, summarize
from kvplane.bench.sim.retention import Retention
from kvplane.bench.sim.routers import RouteChoice, Router, TurnOutcome
from kvplane.bench.workloads.turns import Turn
from kvplane.connector.node_agent.settings import DEFAULT_DEMAND_REFRESH_S

(
    _DONE,
    _EXPIRE,
    _TICK,
    _DEMAND,
    _READ_DONE,
    _PREFILL_DONE,
    _AT_PREFILL,
    _FOLLOW_UP,
    _SPILL_DONE,
    _LOCAL_PREFILL_DONE,
) = range(10)

# Release reasons the fleet itself produces (the control plane's come from ReleaseReason).
ENGINE_TTL = "engine_ttl"
ENGINE_PRESSURE = "engine_pressure"
SUPERSEDED = "superseded"
# D's host tier dropped a spilled handle to make room for a newer one.
HOST_FULL = "host_full"
# Prompt tokens per step of a prefill D runs itself, beside its decodes (vLLM's
# max_num_batched_tokens for an online server).
LOCAL_PREFILL_CHUNK_TOKENS = 8192
# Reasons that free a handle on any tier: never a spill.
_NEVER_SPILLED = ("", SUPERSEDED, ENGINE_TTL, ENGINE_PRESSURE, HOST_FULL)


@dataclass(frozen=True, slots=True)
class SimConfig:
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    costs: SimCosts = field(default_factory=SimCosts)
    # Tokens per digest block (vLLM's block size): the grain at which a prefix is proven.
    digest_block_size: int = 16
    load_report_interval_s: float = 0.5
    series_interval_s: float = 10.0
    epoch_unix_ms: int = 1_750_000_000_000
    # What D does when a turn's KV does not fit: "wait" for pinned retained KV to be freed
    # (vLLM), or "evict" retained handles (the what-if; see ENGINE_MODELS).
    pressure: str = "wait"
    # A client that sends a conversation's next turn only once the previous answer is done (as
    # the live comparison's does): a turn that arrives earlier is held until then, and its TTFT
    # counts from then. False: every turn arrives when the workload says (a trace's clients).
    closed_loop: bool = False
    # Closed loop: the client's pause between an answer and the held turn after it.
    think_s: float = 0.0
    # How much each answer's decode time varies from turn to turn, as a share of it (the standard
    # deviation of a normal draw, cut at three), and the seed of those draws. 0: every answer
    # takes exactly the modelled time.
    decode_spread: float = 0.0
    decode_spread_seed: int = 0
    # Seconds from a turn's arrival to its P leg reaching P: the front's own hop before P starts
    # (kvplane's gateway: its Route call). The route is decided on arrival.
    control_path_s: float = 0.0

    def __post_init__(self) -> None:
        if self.pressure not in ("evict", "wait"):
            raise ValueError("pressure must be 'evict' or 'wait'")
        if self.control_path_s < 0:
            raise ValueError("control_path_s must be >= 0")
        if self.think_s < 0:
            raise ValueError("think_s must be >= 0")
        if not 0 <= self.decode_spread < 1 / 3:
            raise ValueError("decode_spread must be in [0, 1/3)")


# The engine models by their user-facing names: `pressure` for each.
# "tiered" is "pinned" with host memory beside each D's accelerators (`ClusterSpec.decode_host_bytes`).
ENGINE_MODELS: dict[str, str] = {"pinned": "wait", "evicting": "evict", "tiered": "wait"}


class _InFlight:
    """A turn past routing: its prefill on P, and D's reservation once admitted."""

    __slots__ = (
        "at_prefill_s",
        "cached",
        "chain",
        "choice",
        "compute",
        "computed",
        "conversation",
        "decision",
        "decode",
        "estimate_s",
        "estimate_tokens",
        "first_s",
        "outcome",
        "poisoned_from",
        "prefill",
        "prompt",
        "pulled",
        "reserved",
        "stalled_s",
        "transfer",
        "turn",
    )

    def __init__(
        self,
        turn: Turn,
        conversation: Conversation,
        choice: RouteChoice,
        prompt: BlockChain,
        reserved: int,
    ) -> None:
        self.turn = turn
        self.conversation = conversation
        self.choice = choice
        self.prefill: PrefillState = choice.prefill
        self.decode: DecodeState = choice.decode
        self.decision = choice.decision
        self.prompt = prompt
        self.reserved = reserved
        self.chain = conversation.chain
        # Set when P's scheduler takes the turn: tokens P held, pulled and computes, and seconds.
        self.cached = 0
        self.pulled = 0
        self.computed = 0
        self.transfer = 0.0
        self.compute = 0.0
        # The first block of the prompt (and so of its context) whose KV is wrong, if any.
        self.poisoned_from: int | None = None
        # P's load as counted at routing (a guess from P's cache then), corrected when taken.
        self.estimate_tokens = 0
        self.estimate_s = 0.0
        # P's report of the turn, for routing once the turn is over.
        self.outcome: TurnOutcome | None = None
        # D's `stalled_s` when the turn's decode started, or last caught up with it.
        self.stalled_s = 0.0
        # When the turn's first token came, in simulated seconds.
        self.first_s = 0.0
        # When the turn reached P (its P leg's start, as the gateway times it).
        self.at_prefill_s = 0.0


RouterFactory = Callable[[Fleet], Router]
RetentionFactory = Callable[[Fleet], Retention]


class Simulator:
    def __init__(self, config: SimConfig, router: RouterFactory, retention: RetentionFactory) -> None:
        self.config = config
        self.fleet = Fleet(
            config.cluster,
            config.costs,
            config.epoch_unix_ms,
            config.load_report_interval_s,
            block_tokens=config.digest_block_size,
        )
        self.router = router(self.fleet)
        self.retention = retention(self.fleet)
        self.rec = Recorder()
        self.rec.series_interval_s = config.series_interval_s
        self._heap: list[tuple[float, int, int, object]] = []
        self._seq = 0
        self._ids = BlockIds()
        self._conversations: dict[str, Conversation] = {}
        self._named = NamedBlocks()
        self._handles: dict[int, SimHandle] = {}
        self._next_handle = 1
        self._contacted: set[tuple[int, int]] = set()
        # Decode nodes whose KV demand is on its way to the control plane (node index).
        self._demand_due: set[int] = set()
        self._now = 0.0
        self._block_bytes = config.digest_block_size * config.costs.kv_bytes_per_token
        self._decode_rng = random.Random(config.decode_spread_seed)

    def _push(self, t: float, kind: int, payload: object) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, kind, payload))

    def run(self, turns: Iterable[Turn], name: str = "") -> SimResult:
        started = time.perf_counter()
        arrivals = iter(turns)
        upcoming = next(arrivals, None)
        heap = self._heap
        interval = self.retention.interval_s
        if interval > 0:
            self._push(interval, _TICK, None)
        while True:
            if heap and (upcoming is None or heap[0][0] <= upcoming.arrival_s):
                t, _, kind, payload = heapq.heappop(heap)
                self._now = t
                if kind == _DONE:
                    self._finish(t, payload)  # type: ignore[arg-type]
                elif kind == _EXPIRE:
                    self._drop(payload, ENGINE_TTL, t)  # type: ignore[arg-type]
                elif kind == _DEMAND:
                    self._answer_demand(payload, t)  # type: ignore[arg-type]
                elif kind == _READ_DONE:
                    self._read_done(payload, t)  # type: ignore[arg-type]
                elif kind == _PREFILL_DONE:
                    self._prefill_done(payload, t)  # type: ignore[arg-type]
                elif kind == _AT_PREFILL:
                    self._reach_prefill(payload, t)  # type: ignore[arg-type]
                elif kind == _FOLLOW_UP:
                    self._arrive(replace(cast(Turn, payload), arrival_s=t), held=True)
                elif kind == _SPILL_DONE:
                    self._spill_done(payload, t)  # type: ignore[arg-type]
                elif kind == _LOCAL_PREFILL_DONE:
                    self._local_prefill_done(payload, t)  # type: ignore[arg-type]
                else:
                    self._tick(t, upcoming is not None)
            elif upcoming is not None:
                self._now = upcoming.arrival_s
                self._arrive(upcoming)
                upcoming = next(arrivals, None)
            else:
                break
        self.rec.retained_change(self._now, 0)
        return summarize(name, self.rec, self._now, time.perf_counter() - started)

    # -- events -------------------------------------------------------------------------------

    def _arrive(self, turn: Turn, *, held: bool = False) -> None:
        """A turn reaches the front; `held`: a closed loop's turn sent now, after the answer before it."""
        now = turn.arrival_s
        rec = self.rec
        costs = self.config.costs
        block = self.config.digest_block_size
        conversation = self._conversations.get(turn.conversation)
        if conversation is None:
            conversation = Conversation()
            self._conversations[turn.conversation] = conversation
        if self.config.closed_loop and not held:
            if conversation.in_flight:
                conversation.follow_ups.append(turn)  # sent once the answer before it is done
                return
            conversation.in_flight = True
        shared = min(turn.reused_prefix_tokens, turn.previous_context_tokens) if turn.turn_index else 0
        base = conversation.chain.prefix(shared // block)
        named = self._named.prefix(turn.block_ids, turn.block_id_tokens // block)
        if len(named) > len(base):
            base = named  # a prefix other conversations sent too (a system prompt, a document)
        prompt = base.extended(turn.prompt_tokens // block - len(base), self._ids)
        self._named.sent(turn.block_ids, prompt)
        rec.reusable_tokens += min(shared, turn.prompt_tokens - 1) // block * block if shared else 0

        choice = self.router.route(turn, conversation, prompt, now)
        p = choice.prefill
        handle = choice.pull
        if handle is not None and handle.alive:
            handle.checked_out = True
            self.retention.on_gone(handle)
        rec.prompt_total += turn.prompt_tokens
        need = costs.kv_bytes(turn.context_tokens)
        conversation.chain = prompt.extended(turn.context_tokens // block - len(prompt), self._ids)
        if not choice.local_prefill:
            conversation.last_prefill = p.node.node_id
        conversation.last_prompt = prompt
        flight = _InFlight(turn, conversation, choice, prompt, need)
        delay = self.config.control_path_s
        if delay > 0:
            self._push(now + delay, _AT_PREFILL, flight)  # the front's hop: Route, then the P leg
        else:
            self._reach_prefill(flight, now)

    # -- the prefill node's scheduler -------------------------------------------------------------

    def _reach_prefill(self, flight: _InFlight, now: float) -> None:
        """The front's hop is over: the P leg reaches P (or D, where D prefills the turn itself)."""
        if flight.choice.local_prefill:
            self._prefill_on_decode(flight, now)
        else:
            self._enqueue(flight.prefill, flight, now)

    def _prefill_on_decode(self, flight: _InFlight, now: float) -> None:
        """D prefills the turn itself (conditional disaggregation, kvplane's prefill_on_decode),
        after the prefills it took before: from the conversation's handle it holds (kvplane), else
        from its own prefix cache, with no hand-off from P."""
        d = flight.decode
        costs = self.config.costs
        tokens = flight.turn.prompt_tokens
        block = self.config.digest_block_size
        held = flight.choice.local_handle
        if held is not None and held.alive and held.decode is d:
            # The handle's blocks are D's still: the verified prefix they hold is not computed.
            cached = min(flight.choice.pulled_tokens // block * block, tokens - 1)
        elif d.prefix_cache is not None:
            cached = min(d.prefix_cache.hit_blocks(flight.prompt) * block, tokens - 1)
            d.prefix_cache.insert(flight.prompt)
            _publish_events(d, now)
        else:
            cached = 0
        flight.cached = cached
        flight.computed = tokens - cached
        compute = costs.prefill_s(flight.computed) + costs.pulled_compute_s(cached)
        if costs.local_chunk_decode_step:
            # Its chunks share D's steps with the decodes running there: one decode step each.
            steps = -(-flight.computed // LOCAL_PREFILL_CHUNK_TOKENS)
            compute += steps * costs.decode_step_s(d.running)
        flight.compute = max(0.0, compute - costs.handoff_s(tokens))
        self.rec.decisions[flight.decision] += 1
        self.rec.cached_tokens += cached
        start = max(now, d.local_free_at)
        d.local_free_at = start + flight.compute
        # D's running decodes wait for the prefill's steps: each finishes that much later.
        d.stalled_s += flight.compute
        self._push(d.local_free_at, _LOCAL_PREFILL_DONE, flight)

    def _local_prefill_done(self, flight: _InFlight, now: float) -> None:
        flight.outcome = TurnOutcome(0, 0.0, flight.compute, now - flight.turn.arrival_s, flight.cached)
        self._to_decode(flight, now)

    def _enqueue(self, p: PrefillState, flight: _InFlight, now: float) -> None:
        """The turn joins P's waiting queue; P's load counts it at once (a guess at its compute)."""
        costs = self.config.costs
        tokens = flight.turn.prompt_tokens
        block = self.config.digest_block_size
        held = min(p.cache.hit_blocks(flight.prompt) * block, tokens - 1)
        if flight.choice.pull is not None:
            held = max(held, min(flight.choice.pulled_tokens, tokens - 1))
        flight.estimate_tokens = tokens - held
        flight.estimate_s = costs.prefill_s(tokens - held) + costs.pulled_compute_s(held)
        flight.at_prefill_s = now
        p.changing(now)
        p.jobs += 1
        p.queued_tokens += flight.estimate_tokens
        p.backlog_s += flight.estimate_s
        p.waiting.append(flight)
        self._schedule(p, now)

    def _schedule(self, p: PrefillState, now: float) -> None:
        """P's scheduler step: while P is free, a landed read first, else the next waiting turn."""
        while not p.busy:
            if p.ready:
                self._compute(p, p.ready.popleft(), now)
            elif p.waiting:
                flight = p.waiting.popleft()
                if self._take(p, flight, now):
                    self._compute(p, flight, now)
            else:
                return

    def _take(self, p: PrefillState, flight: _InFlight, now: float) -> bool:
        """P takes the turn: its cache lookup, then its pull starts. True: compute it now."""
        rec = self.rec
        costs = self.config.costs
        block = self.config.digest_block_size
        turn = flight.turn
        choice = flight.choice
        handle = choice.pull
        # P's own prefix cache first; at least the last token is always computed.
        hit, poisoned_hit = p.cache.hit(flight.prompt)
        cached = min(hit * block, turn.prompt_tokens - 1)
        # The first block whose KV is wrong: a poisoned cache hit, then what the pull imports.
        bad = poisoned_hit if poisoned_hit is not None and poisoned_hit * block < cached else None
        pulled = 0
        source = choice.source
        if source is not None and source.host_cache is not None:
            # A peer D's host tier, read by block hash: only what it still holds, beyond P's hit.
            held = min(source.host_cache.hit_blocks(flight.prompt) * block, turn.prompt_tokens - 1)
            pulled = max(0, held - cached)
            rec.host_pulled_tokens += pulled
        elif handle is not None and choice.pulled_tokens > 0:
            if handle.alive:
                # vLLM's P reads only what it lacks: remote_num_tokens minus its local hit.
                pulled = max(0, min(choice.pulled_tokens, turn.prompt_tokens - 1) - cached)
                rec.consumed += 1
                if pulled and handle.tier == "host":
                    rec.host_pulled_tokens += pulled
                if pulled:
                    if not choice.prefix_ok:
                        bad_pull: int | None = cached // block  # none of it is this prompt's KV
                    elif handle.poisoned_from is not None and handle.poisoned_from * block < cached + pulled:
                        bad_pull = max(cached // block, handle.poisoned_from)
                    else:
                        bad_pull = None
                    if bad_pull is not None and (bad is None or bad_pull < bad):
                        bad = bad_pull
            else:
                flight.decision = "pull_failed"
        # Tokens from the first wrong block on are wrong KV, never reuse; the turn's output is wrong.
        first_bad = bad * block if bad is not None else turn.prompt_tokens
        wrong_cached = max(0, cached - first_bad)
        wrong_pulled = pulled - min(pulled, max(0, first_bad - cached))
        rec.pulled_correct += pulled - wrong_pulled
        rec.wrong_prefix_tokens += wrong_cached + wrong_pulled
        if bad is not None:
            rec.wrong_prefix_turns += 1
        flight.poisoned_from = bad
        rec.decisions[flight.decision] += 1
        rec.cached_tokens += cached - wrong_cached
        flight.cached = cached
        flight.pulled = pulled
        flight.computed = turn.prompt_tokens - cached - pulled
        flight.compute = costs.prefill_s(flight.computed) + costs.pulled_compute_s(cached + pulled)
        decode_cache = flight.decode.prefix_cache
        if decode_cache is not None:
            # D reads from P only the blocks its own prefix cache lacks.
            held = min(decode_cache.hit_blocks(flight.prompt) * block, turn.prompt_tokens - 1)
            flight.compute = max(0.0, flight.compute - costs.handoff_s(held))
        p.changing(now)
        p.queued_tokens += flight.computed - flight.estimate_tokens
        p.backlog_s += flight.compute - flight.estimate_s
        flight.estimate_s = flight.compute
        if not pulled:
            if handle is not None and handle.alive:
                self._drop(handle, "", now)  # nothing to read: P tells D to free the blocks
            return True
        holder = handle.decode if handle is not None else source
        assert holder is not None
        pair = (p.index, holder.index)
        first = pair not in self._contacted
        self._contacted.add(pair)
        flight.transfer = costs.transfer_s(pulled, first)
        # WAITING_FOR_REMOTE_KVS: P goes on with other turns while the read is in flight.
        p.reading += 1
        if handle is not None:
            handle.reading = True
        self._push(now + flight.transfer, _READ_DONE, flight)
        return False

    def _read_done(self, flight: _InFlight, now: float) -> None:
        """The read landed: D frees the handle's blocks; the turn is scheduled before new ones."""
        p = flight.prefill
        p.reading -= 1
        handle = flight.choice.pull
        if handle is not None:
            self._drop(handle, "", now)
        p.ready.append(flight)
        self._schedule(p, now)

    def _compute(self, p: PrefillState, flight: _InFlight, now: float) -> None:
        p.changing(now)
        p.busy = True
        p.free_at = now + flight.compute
        p.run = (flight.computed, now, p.free_at)
        p.backlog_s -= flight.estimate_s
        p.cache.insert(flight.prompt, flight.poisoned_from)
        if p.feed is not None and p.cache.journal:
            # Its KV events: what it stored, and what that evicted.
            p.feed.publish(now, p.cache.journal)
            p.cache.journal.clear()
        self._push(p.free_at, _PREFILL_DONE, flight)

    def _prefill_done(self, flight: _InFlight, now: float) -> None:
        p = flight.prefill
        p.changing(now)
        p.busy = False
        p.jobs -= 1
        p.queued_tokens -= flight.computed
        p.served += 1
        # What the gateway reports: the P leg as it timed it (P's queue, its pull and its prefill),
        # whatever D's admission adds later. Routing hears it only when the turn is over
        # (`_finish`), as the gateway reports a turn after D's last token.
        leg = now - flight.at_prefill_s
        flight.outcome = TurnOutcome(
            flight.pulled,
            flight.transfer,
            leg,
            now - flight.turn.arrival_s,
            flight.cached,
            queued_s=max(0.0, leg - flight.transfer - flight.compute),
        )
        self._to_decode(flight, now)
        self._schedule(p, now)

    # -- the decode node ---------------------------------------------------------------------------

    def _to_decode(self, flight: _InFlight, now: float) -> None:
        """P has answered: the turn's D leg is sent now, and D admits it or it waits for memory.

        As the gateway and vLLM's proxies do, D hears of a turn only when P is done, so D's
        memory is taken (or waited for) from then, not from routing.
        """
        d = flight.decode
        need = flight.reserved
        if self.config.pressure == "evict":
            if d.free < need:
                self._make_room(d, need, now)
                if d.free < need:
                    self.rec.overcommitted_turns += 1
            self._start(flight, now)
        elif d.waiting or d.free < need:
            self._move_copied(d, sum(f.reserved for f in d.waiting) + need - d.free - d.spilling, now)
            if d.waiting or d.free < need:
                self.rec.waited_turns += 1
                d.waiting.append(flight)
                self._admit(d, now)
                self._signal_demand(d, now)
            else:
                self._start(flight, now)
        else:
            self._start(flight, now)

    def _start(self, flight: _InFlight, now: float) -> None:
        """D admits the turn (P is done, or D prefilled it): its decode starts now."""
        d = flight.decode
        d.reserved += flight.reserved
        d.running += 1
        d.fit_prefix_cache(self._block_bytes)
        _publish_events(d, now)
        self._first_token(flight, now)

    def _first_token(self, flight: _InFlight, now: float) -> None:
        turn = flight.turn
        rec = self.rec
        costs = self.config.costs
        first = start = now
        if not flight.choice.local_prefill:
            # Through P, D reads the prompt's KV (what the prefill curve leaves out of the
            # hand-off), then makes the first token in a decode step; a prefill on D made it with
            # its last chunk (`_prefill_on_decode` charges that).
            start += costs.handoff_fixed_s
            first = start + costs.decode_step_s(flight.decode.running)
        rec.ttft_s.append(first - turn.arrival_s)
        flight.first_s = first
        rec.prompt_tokens.append(turn.prompt_tokens)
        rec.pulled_tokens.append(flight.pulled)
        flight.stalled_s = flight.decode.stalled_s
        done = start + costs.decode_s(turn.output_tokens, flight.decode.running)
        # The answer's variation from the modelled time falls on the tokens after the first.
        self._push(first + (done - first) * self._spread(), _DONE, flight)

    def _spread(self) -> float:
        """This answer's decode time as a multiple of the modelled one (`SimConfig.decode_spread`)."""
        sd = self.config.decode_spread
        if sd == 0:
            return 1.0
        return 1.0 + max(-3 * sd, min(3 * sd, self._decode_rng.gauss(0.0, sd)))

    def _admit(self, d: DecodeState, now: float) -> None:
        """Admits waiting turns, in order, while their KV fits (or D's accelerators hold nothing:
        handles whose blocks are all in host memory take none of them)."""
        waiting = d.waiting
        while waiting and (d.free >= waiting[0].reserved or (d.running == 0 and d.retained == 0)):
            head = waiting.popleft()
            if d.free < head.reserved:
                self.rec.overcommitted_turns += 1
            self._start(head, now)

    def _finish(self, now: float, flight: _InFlight) -> None:
        stalled = flight.decode.stalled_s - flight.stalled_s
        if stalled > 0:
            # D prefilled turns of its own while this one decoded: its last token comes later.
            flight.stalled_s = flight.decode.stalled_s
            self._push(now + stalled, _DONE, flight)
            return
        if flight.turn.output_tokens > 1:
            self.rec.tpot_s.append((now - flight.first_s) / (flight.turn.output_tokens - 1))
        if flight.outcome is not None:
            self.router.observe(flight.turn, flight.choice, flight.outcome)
        self._next_turn(flight.conversation, now)
        d = flight.decode
        d.reserved -= flight.reserved
        d.running -= 1
        # D's prefix cache holds the turn's blocks (prompt and output); pinned, if D keeps them.
        keeps = self.config.cluster.engine_ttl_s > 0 and flight.choice.keep_decode_kv
        if d.prefix_cache is not None:
            d.fit_prefix_cache(self._block_bytes)
            d.prefix_cache.insert(flight.chain, flight.poisoned_from, pin=keeps)
            _publish_events(d, now)
        if d.host_cache is not None:
            # D offloads the turn's KV (prompt and output) to its host tier as the turn ends.
            d.host_cache.insert(flight.chain, flight.poisoned_from)
        if self.config.cluster.engine_ttl_s <= 0:
            if d.waiting:
                self._admit(d, now)
            return  # D does not retain finished turns (no bidirectional transfer)
        turn = flight.turn
        conversation = flight.conversation
        previous = conversation.handle
        keep = flight.choice.keep_decode_kv
        if previous is not None and previous.alive and (self.retention.releases_superseded or not keep):
            self._drop(previous, SUPERSEDED, now)
        if not keep:
            # kvplane's skip_decode_retention: D frees the turn's KV at once, publishes nothing.
            conversation.handle = None
            if d.waiting:
                self._admit(d, now)
            return
        handle = SimHandle(
            self._next_handle,
            turn.tenant,
            turn.conversation,
            d,
            turn.context_tokens,
            flight.reserved,
            flight.chain,
            now,
            now + self.config.cluster.engine_ttl_s,
        )
        self._next_handle += 1
        handle.poisoned_from = flight.poisoned_from
        d.handles[handle.handle_id] = handle
        d.retained += handle.bytes
        self._handles[handle.handle_id] = handle
        self.rec.retained_change(now, handle.bytes)
        conversation.handle = handle
        if handle.expiry_s != float("inf"):
            self._push(handle.expiry_s, _EXPIRE, handle)
        self.retention.on_publish(handle)
        cluster = self.config.cluster
        if cluster.decode_write_through and d.host_cache is None:
            self._spill(handle, now)  # the what-if: copied to host memory as it is published
        elif (
            cluster.decode_copy_ahead
            and self.retention.spills
            and d.host_cache is None
            and 0 < handle.bytes <= d.host_capacity
            and self._host_room(d, handle.bytes, now)
        ):
            d.host_copies += handle.bytes
            d.copies[handle.handle_id] = handle
            handle.copied_s = now + self.config.costs.spill_s(handle.bytes)
        self.router.on_publish(conversation, handle, now)

    def _next_turn(self, conversation: Conversation, now: float) -> None:
        """Closed loop: the conversation's next turn, held for this answer, is sent after the
        client's pause (`SimConfig.think_s`)."""
        if not self.config.closed_loop:
            return
        if conversation.follow_ups:
            # Still in flight through the pause: a turn that comes meanwhile waits its place.
            self._push(now + self.config.think_s, _FOLLOW_UP, conversation.follow_ups.popleft())
        else:
            conversation.in_flight = False

    def _tick(self, now: float, arrivals_left: bool) -> None:
        for handle_id, reason in self.retention.evaluate(now):
            handle = self._handles.get(handle_id)
            if handle is not None:
                self._drop(handle, reason, now)
        # Handles in a host tier are past the control plane's releases: they do not keep time going.
        on_accelerators = len(self._handles) > sum(len(d.host_handles) for d in self.fleet.decode)
        if arrivals_left or on_accelerators or len(self._heap) > 0:
            self._push(now + self.retention.interval_s, _TICK, None)

    def _signal_demand(self, d: DecodeState, now: float) -> None:
        """Turns wait on D for KV: the control plane answers after its latency (retention.py)."""
        latency = self.retention.demand_latency_s
        if d.waiting and latency is not None and d.index not in self._demand_due:
            self._demand_due.add(d.index)
            self._push(now + latency, _DEMAND, d)

    def _answer_demand(self, d: DecodeState, now: float) -> None:
        self._demand_due.discard(d.index)
        for handle_id, reason in self.retention.answer_demand(d, now):
            handle = self._handles.get(handle_id)
            if handle is not None:
                self._drop(handle, reason, now)
        if d.waiting:
            # The demand lasts: D's agent repeats it, and the control plane answers it again.
            self._demand_due.add(d.index)
            self._push(now + DEFAULT_DEMAND_REFRESH_S, _DEMAND, d)

    # -- handles --------------------------------------------------------------------------------

    def _make_room(self, d: DecodeState, need: int, now: float) -> None:
        """D frees its oldest retained handles, except those being read, until `need` bytes fit."""
        victims = []
        short = need - d.free
        for handle in d.handles.values():
            if short <= 0:
                break
            if not handle.reading and handle.tier == "gpu":
                victims.append(handle)
                short -= handle.bytes
        for handle in victims:
            self._drop(handle, ENGINE_PRESSURE, now)

    def _drop(self, handle: SimHandle, reason: str, now: float) -> None:
        """The handle's blocks are freed: read (no reason), released or expired; or, where D has a
        host tier and the control plane released it, spilled there."""
        if not handle.alive or (handle.reading and reason):
            return  # D keeps blocks being read until P is done with them
        if handle.checked_out and reason not in ("", ENGINE_TTL, ENGINE_PRESSURE):
            return  # a checked-out handle is fenced from the control plane's releases
        d = handle.decode
        if reason == ENGINE_TTL and (
            handle.tier == "spilling" or (handle.tier == "host" and now < handle.expiry_s)
        ):
            return  # D's TTL ends accelerator blocks held for a read; a copy in host memory lives on
        if reason not in _NEVER_SPILLED and handle.tier == "gpu" and self._spill(handle, now):
            return
        handle.alive = False
        del d.handles[handle.handle_id]
        self._give_back_copy(handle)
        if handle.tier != "host":
            d.retained -= handle.bytes  # its accelerator blocks, freed now
            self.rec.retained_change(now, -handle.bytes)
            self._unpin(d, handle.chain, now)
        if handle.tier != "gpu":
            d.host_retained -= handle.bytes
            del d.host_handles[handle.handle_id]
        if handle.tier == "spilling":
            d.spilling -= handle.bytes
        del self._handles[handle.handle_id]
        self.retention.on_gone(handle)
        if reason:
            self.rec.releases[reason] += 1
        if d.waiting:
            self._admit(d, now)

    def _unpin(self, d: DecodeState, chain: BlockChain, now: float) -> None:
        """A handle's accelerator blocks are freed (released, read, or moved to host memory): vLLM
        leaves them in D's prefix cache, the most recently freed evicted last."""
        if d.prefix_cache is not None:
            d.fit_prefix_cache(self._block_bytes)
            d.prefix_cache.unpin(chain)
            _publish_events(d, now)

    def _spill(self, handle: SimHandle, now: float) -> bool:
        """Copies a handle to D's host memory (making room there by dropping entries not being
        read, in the control plane's order); its accelerator blocks are freed when the copy lands
        (`_spill_done`): at once for a copy ahead that is whole, when it is for one under way.
        False (the caller keeps or frees it) where D has no host memory for this control plane,
        or no room can be made."""
        d = handle.decode
        if d.host_capacity <= 0 or not self.retention.spills:
            return False
        if handle.handle_id in d.copies:
            # Its copy ahead holds its room already: it becomes the handle's.
            d.host_copies -= handle.bytes
            del d.copies[handle.handle_id]
        elif not self._host_room(d, handle.bytes, now):
            return False
        handle.tier = "spilling"
        d.host_retained += handle.bytes
        d.host_handles[handle.handle_id] = handle
        d.spilling += handle.bytes
        # The control plane's view of D's accelerators no longer holds it.
        self.retention.on_gone(handle)
        self.rec.spilled_handles += 1
        landed = min(handle.copied_s, now + self.config.costs.spill_s(handle.bytes))
        if landed <= now:
            self._spill_done(handle, now)
        else:
            self._push(landed, _SPILL_DONE, handle)
        return True

    def _move_copied(self, d: DecodeState, wanted: int, now: float) -> None:
        """D, short of `wanted` bytes for its turns, moves the handles whose copies ahead are
        whole to host memory at once, in the control plane's order, until that much is free."""
        if wanted <= 0 or not self.config.cluster.decode_copy_ahead:
            return
        copied = [
            h
            for h in d.handles.values()
            if h.tier == "gpu" and h.copied_s <= now and not h.reading and not h.checked_out
        ]
        for handle in self.retention.device_spill_order(copied, now):
            if wanted <= 0:
                break
            if self._spill(handle, now):
                wanted -= handle.bytes

    def _give_back_copy(self, handle: SimHandle) -> None:
        """The handle's copy ahead, if it has one, frees its host memory (the handle lives on
        where it is, or not at all)."""
        d = handle.decode
        if d.copies.pop(handle.handle_id, None) is not None:
            d.host_copies -= handle.bytes
            handle.copied_s = float("inf")

    def _host_room(self, d: DecodeState, nbytes: int, now: float) -> bool:
        """Makes `nbytes` free in D's host memory: handles there dropped in the control plane's
        order (kvplane: least expected reuse per byte first, as its leader's spill order tells a
        live D), then older copies ahead given back; False (nothing dropped) if it cannot."""
        short = nbytes - (d.host_capacity - d.host_retained - d.host_copies)
        if short <= 0:
            return True
        victims = []
        for old in self.retention.host_drop_order(d.host_handles.values(), now):
            if short <= 0:
                break
            if not old.reading and not old.checked_out:
                victims.append(old)
                short -= old.bytes
        copies = []
        for copied in d.copies.values():
            if short <= 0:
                break
            copies.append(copied)
            short -= copied.bytes
        if short > 0:
            return False
        for copied in copies:
            self._give_back_copy(copied)
        for old in victims:
            self._drop(old, HOST_FULL, now)
        return True

    def _spill_done(self, handle: SimHandle, now: float) -> None:
        """The copy is whole: D frees the handle's accelerator blocks; it lives on in host memory."""
        if not handle.alive or handle.tier != "spilling":
            return
        d = handle.decode
        handle.tier = "host"
        d.retained -= handle.bytes
        d.spilling -= handle.bytes
        self.rec.retained_change(now, -handle.bytes)
        self._unpin(d, handle.chain, now)
        # Offered for longer than D's TTL would have kept it (its handle, as routing sees it, too).
        expiry = handle.published_s + self.config.cluster.decode_host_ttl_s
        if expiry > handle.expiry_s:
            handle.expiry_s = expiry
            handle.cache_handle = None
            self._push(expiry, _EXPIRE, handle)
        if d.waiting:
            self._admit(d, now)


def _publish_events(d: DecodeState, now: float) -> None:
    """D's KV events: what its prefix cache stored and evicted, to the router that reads them."""
    cache = d.prefix_cache
    if d.feed is not None and cache is not None and cache.journal:
        d.feed.publish(now, cache.journal)
        cache.journal.clear()
