"""Who picks P and D and decides pull or recompute, for each baseline.

`PolicyRouter` is kvplane: it builds the routing service's frozen
`RouteSnapshot` from the simulated fleet and calls the very
`RoutingPolicy.route` the service calls, then feeds each finished turn back
through `CostModel.observe`, as ReportTurn does. The others are the
baselines: round-robin with no reuse, vLLM's example proxy (round-robin and
a fixed-lifetime, single-use handle per conversation, with or without a
prefix check), precise prefix-cache-aware routing to P (no D->P reuse), vllm-router's
cache-aware policy (its own record of what it routed; no D->P reuse), and
an oracle that knows the prefix and never lacks memory.

What each router may read of the fleet is listed in `fleet.py`.
"""

from __future__ import annotations

import random
from collections.abc import Coroutine, Hashable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from kvplane.bench.sim.block_chain import BlockChain, handle_digests
from kvplane.bench.sim.cache_events import CacheEventFeed
from kvplane.bench.sim.cluster import DecodeState, PrefillState, SimHandle
from kvplane.bench.sim.fleet import Conversation, Fleet
from kvplane.bench.sim.prefix_cache import PrefixCache
from kvplane.bench.workloads.turns import Turn
from kvplane.services.common.model.errors import HandleNotRetained
from kvplane.services.common.model.handles import CacheHandle, VllmHandle
from kvplane.services.common.model.nodes import Node
from kvplane.services.common.model.suspects import NodeSuspect
from kvplane.services.common.store.records import CheckOut, HandleRecord
from kvplane.services.routing.policy import CostModel, Decision, NodeState, Prompt, RoutingPolicy
from kvplane.services.routing.router import Router as KvplaneRouter
from kvplane.services.routing.router import TurnReport, TurnRequest
from kvplane.services.routing.settings import RoutingSection
from kvplane.services.routing.state.inflight import InFlightLedger, RoutedWork

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class RouteChoice:
    """A router's answer. `pull` is the handle to read, `pulled_tokens` how much of it."""

    prefill: PrefillState
    decode: DecodeState
    decision: str
    pull: SimHandle | None = None
    # 0 with a `pull`: nothing to read, P only tells D to free the handle's blocks.
    pulled_tokens: int = 0
    # False when the pull imports KV computed for other tokens (no prefix check).
    prefix_ok: bool = True
    # kvplane's route id: its `Router` keeps the rest for the turn's report.
    route_id: str = ""
    # False: D keeps nothing of this turn for the next (kvplane's skip_decode_retention).
    keep_decode_kv: bool = True
    # A decode node whose host tier P reads the prompt's blocks from, by hash (llm-d's P2P path).
    source: DecodeState | None = None
    # D prefills the turn itself; `prefill` is sent nothing (conditional disaggregation, and
    # kvplane's prefill_on_decode).
    local_prefill: bool = False
    # With `local_prefill`: the conversation's handle on that D, whose blocks D's prefill reads
    # (kvplane), `pulled_tokens` of them (routing's verified prefix); None: D's own prefix cache
    # (the baselines').
    local_handle: SimHandle | None = None


@dataclass(frozen=True, slots=True)
class TurnOutcome:
    """A finished prefill, as ReportTurn would describe it (seconds, tokens)."""

    pulled_tokens: int
    transfer_s: float
    # The P leg as the gateway times it: P's wait, its pull and its compute.
    prefill_s: float
    ttft_s: float
    # Prompt tokens P found in its own prefix cache (neither pulled nor computed).
    cached_tokens: int = 0
    # The wait on P for its compute, its pull left out, as P measures it (kvplane_queued_ms).
    queued_s: float = 0.0


class Router(Protocol):
    def route(
        self, turn: Turn, conversation: Conversation, prompt: BlockChain, now: float
    ) -> RouteChoice: ...

    def observe(self, turn: Turn, choice: RouteChoice, outcome: TurnOutcome) -> None: ...

    def on_publish(self, conversation: Conversation, handle: SimHandle, now: float) -> None: ...


class _RoundRobin:
    """Round-robin over P and D, from nodes the seed picks: a proxy's counters start wherever its
    process found them, so runs with other seeds spread the same turns over other nodes."""

    def __init__(self, fleet: Fleet, seed: int = 0) -> None:
        self.fleet = fleet
        rng = random.Random(seed)
        self._p = rng.randrange(len(fleet.prefill))
        self._d = rng.randrange(len(fleet.decode))

    def next_pair(self) -> tuple[PrefillState, DecodeState]:
        p = self.fleet.prefill[self._p % len(self.fleet.prefill)]
        d = self.fleet.decode[self._d % len(self.fleet.decode)]
        self._p += 1
        self._d += 1
        return p, d


class NoReuseRouter:
    """Round-robin P and D; every turn recomputes its whole prompt."""

    def __init__(self, fleet: Fleet, seed: int = 0) -> None:
        self._rr = _RoundRobin(fleet, seed)

    def route(self, turn: Turn, conversation: Conversation, prompt: BlockChain, now: float) -> RouteChoice:
        p, d = self._rr.next_pair()
        return RouteChoice(p, d, "recompute_disabled")

    def observe(self, turn: Turn, choice: RouteChoice, outcome: TurnOutcome) -> None:
        return None

    def on_publish(self, conversation: Conversation, handle: SimHandle, now: float) -> None:
        return None


class ExampleProxyRouter:
    """vLLM's example proxy: round-robin nodes and one handle per conversation in a dict.

    The entry is used once and forgotten after `cache_ttl_s`. Nothing
    releases a superseded handle, and a handle D already freed fails its pull
    (P then recomputes, as `kv_load_failure_policy="recompute"` does).

    Unchecked (vLLM's example), it pulls whatever the entry holds: when the
    new prompt differs from the handle's tokens anywhere in the pulled range
    (an edited or cut history, a re-tokenized join), P pairs D's blocks with
    the wrong tokens and the turn's output comes from the wrong KV
    (`pull_wrong_prefix`; none of it counts as reuse). `checked=True` adds a
    token-exact comparison of the prompt with the handle's tokens and
    recomputes on a mismatch instead (`recompute_prefix_mismatch`), handing
    P the handle with nothing to read so that D frees its blocks then, as a
    proxy that drops an entry would, rather than at D's TTL.
    """

    def __init__(
        self, fleet: Fleet, cache_ttl_s: float = 450.0, *, checked: bool = False, seed: int = 0
    ) -> None:
        self._rr = _RoundRobin(fleet, seed)
        self.cache_ttl_s = cache_ttl_s
        self.checked = checked
        self._entries: dict[str, tuple[SimHandle, float]] = {}

    def route(self, turn: Turn, conversation: Conversation, prompt: BlockChain, now: float) -> RouteChoice:
        p, d = self._rr.next_pair()
        entry = self._entries.pop(turn.conversation, None)
        if entry is None or now - entry[1] > self.cache_ttl_s:
            return RouteChoice(p, d, "recompute_no_handle")
        handle = entry[0]
        if not handle.alive:
            return RouteChoice(p, d, "pull_failed")
        pulled = min(handle.tokens, turn.prompt_tokens - 1)
        # The prompt equals the handle's tokens on every pulled position, or the pull is wrong.
        prefix_ok = turn.reused_prefix_tokens >= pulled
        if prefix_ok:
            return RouteChoice(p, d, "pull", handle, pulled)
        if self.checked:
            # The handle is of no use: P is handed it with nothing to read, so D frees its blocks.
            return RouteChoice(p, d, "recompute_prefix_mismatch", handle, 0)
        return RouteChoice(p, d, "pull_wrong_prefix", handle, pulled, prefix_ok=False)

    def observe(self, turn: Turn, choice: RouteChoice, outcome: TurnOutcome) -> None:
        return None

    def on_publish(self, conversation: Conversation, handle: SimHandle, now: float) -> None:
        self._entries[handle.conversation] = (handle, now)


def _finish_estimate(
    p: PrefillState, fleet: Fleet, prompt: BlockChain, prompt_tokens: int, pull_tokens: int, now: float
) -> tuple[float, int]:
    """When P would finish this prompt (s), and its cache hit (tokens), from its real queue.

    Ground truth (P's exact queue): only the oracle may use it.
    """
    costs = fleet.costs
    cached = min(p.cache.hit_blocks(prompt) * fleet.block_tokens, prompt_tokens - 1)
    pulled = max(0, pull_tokens - cached)
    transfer = costs.transfer_s(pulled, False)
    compute = costs.prefill_s(prompt_tokens - cached - pulled) + costs.pulled_compute_s(cached + pulled)
    # The read starts when P's scheduler takes the turn, once the work ahead of it is taken.
    return p.finish_after_s(now) + transfer + compute, cached


class PrefixAffinityRouter:
    """Precise prefix-cache-aware routing to P, with current loads; D->P reuse only by P2P.

    What a platform team gets from llm-d-style scheduling: the engines
    publish KV-cache events, so the router knows each P's cached blocks, and
    it sends the turn to the P where it would finish first (queue plus the
    prefill of what that P does not hold). D is round-robin and retains
    nothing (run with D's TTL at 0).

    The queue is what a live router knows, kept as kvplane's router keeps
    it: each P's last load report (as stale as the fleet's reports are) plus
    the prefill work this router has sent it since (`InFlightLedger`),
    drained as a FIFO node computes it. Never P's real queue. Times come
    from the engine's published prefill timing (a fixed cost per request,
    and per computed and per reused token), as configuration: kvplane's cost
    model starts from the same figures and learns from there.

    `p2p_min_lead_tokens` (llm-d's P/D + P2P path, run with
    `ClusterSpec.decode_offload_all`): every D offloads each finished turn's
    KV to its host tier, whose blocks the engines publish as KV events too;
    once P is chosen, the D whose host tier holds the longest prefix of the
    prompt is named as the turn's KV source when it leads P's own cache by at
    least that many tokens, and P reads what it lacks from there by block
    hash (so never a wrong prefix).
    """

    def __init__(self, fleet: Fleet, seed: int = 0, p2p_min_lead_tokens: int | None = None) -> None:
        self.fleet = fleet
        self.p2p_min_lead_tokens = p2p_min_lead_tokens
        self._rr = _RoundRobin(fleet, seed)
        self._inflight = InFlightLedger()
        self._routes = 0
        timing = fleet.costs.timing
        self._costs = CostModel(
            prefill_fixed_ms=timing.prefill_base_s * 1000.0 / timing.speedup,
            recompute_ms_per_token=timing.prefill_per_token_s * 1000.0 / timing.speedup,
            reused_ms_per_token=fleet.costs.pulled_token_s * 1000.0,
        )

    def route(self, turn: Turn, conversation: Conversation, prompt: BlockChain, now: float) -> RouteChoice:
        fleet = self.fleet
        costs = self._costs
        now_ms = fleet.unix_ms(now)
        reports = self._inflight.current(
            [fleet.node_state(i, now) for i in range(len(fleet.prefill))], now_ms, costs=costs
        )
        best: tuple[float, float, int, PrefillState] | None = None
        for p, state in zip(fleet.prefill, reports, strict=True):
            # KV events: the cached blocks of each P are fair to read (see fleet.py).
            cached = min(p.cache.hit_blocks(prompt) * fleet.block_tokens, turn.prompt_tokens - 1)
            prefill_ms = costs.prefill_ms(turn.prompt_tokens - cached, cached)
            finish = costs.queue_ms(state) + prefill_ms
            if best is None or finish < best[0]:
                best = (finish, prefill_ms, cached, p)
        assert best is not None
        _, prefill_ms, cached, chosen = best
        source, held = self._p2p_source(prompt, turn.prompt_tokens, cached)
        if source is not None:
            prefill_ms = costs.prefill_ms(turn.prompt_tokens - held, held)
        self._routes += 1
        self._inflight.add(
            RoutedWork(
                str(self._routes),
                chosen.node.node_id,
                now_ms,
                now_ms,
                prefill_tokens=turn.prompt_tokens - max(cached, held),
                prefill_ms=prefill_ms,
                queued_requests=1,
            )
        )
        _, d = self._rr.next_pair()
        if source is not None:
            return RouteChoice(chosen, d, "p2p_pull", pulled_tokens=held, source=source)
        return RouteChoice(chosen, d, "prefill_cache_hit" if cached > 0 else "recompute_cold")

    def _p2p_source(
        self, prompt: BlockChain, prompt_tokens: int, cached: int
    ) -> tuple[DecodeState | None, int]:
        """The D whose host tier leads P's cache by the most, if by `p2p_min_lead_tokens`; its hit."""
        if self.p2p_min_lead_tokens is None:
            return None, 0
        best: DecodeState | None = None
        held = 0
        for d in self.fleet.decode:
            if d.host_cache is None:
                continue
            hit = min(d.host_cache.hit_blocks(prompt) * self.fleet.block_tokens, prompt_tokens - 1)
            if hit > held:
                best, held = d, hit
        if best is None or held - cached < self.p2p_min_lead_tokens:
            return None, 0
        return best, held

    def observe(self, turn: Turn, choice: RouteChoice, outcome: TurnOutcome) -> None:
        return None

    def on_publish(self, conversation: Conversation, handle: SimHandle, now: float) -> None:
        return None


class CacheAwarePicker:
    """vllm-router's `cache_aware` choice among the nodes of one role, as its defaults run it.

    Per node, an approximate tree of the prompts the router sent it (never the engine's cache):
    a turn goes to the node whose tree matches the longest prefix of its prompt when that match
    is over `cache_threshold` of the prompt, else to the node with the smallest tree; only when
    the router's in-flight requests are out of balance (the busiest node has more than
    `balance_abs` more than the idlest and more than `balance_rel` times as many) does it take
    the idlest node instead. The tree is kept in blocks; its budget is the router's character
    budget at `CHARS_PER_TOKEN`.
    """

    # vllm-router 0.1.17's defaults (`vllm-router --help`).
    CACHE_THRESHOLD = 0.3
    BALANCE_ABS = 64
    BALANCE_REL = 1.5
    MAX_TREE_CHARS = 33_554_432
    # Characters per token in the router's text tree: the usual 4 of English text.
    CHARS_PER_TOKEN = 4

    def __init__(self, nodes: int, block_tokens: int) -> None:
        budget = self.MAX_TREE_CHARS // (self.CHARS_PER_TOKEN * block_tokens)
        self.trees = [PrefixCache(budget) for _ in range(nodes)]
        self.in_flight = [0] * nodes

    def pick(self, prompt: BlockChain) -> tuple[int, str]:
        """The node's index, and why: "balance", "prefix_match" or "smallest_tree"."""
        load = self.in_flight
        busiest, idlest = max(load), min(load)
        if busiest - idlest > self.BALANCE_ABS and busiest > idlest * self.BALANCE_REL:
            chosen, why = load.index(idlest), "balance"
        else:
            hits = [tree.hit_blocks(prompt) for tree in self.trees]
            best = max(range(len(hits)), key=lambda i: (hits[i], -i))
            if len(prompt) and hits[best] / len(prompt) > self.CACHE_THRESHOLD:
                chosen, why = best, "prefix_match"
            else:
                sizes = [tree.used_blocks for tree in self.trees]
                chosen, why = sizes.index(min(sizes)), "smallest_tree"
        self.trees[chosen].insert(prompt)
        load[chosen] += 1
        return chosen, why

    def done(self, node: int) -> None:
        self.in_flight[node] -= 1


class CacheAwareRouter:
    """vllm-router in P/D mode with its default `cache_aware` policy, for P and for D alike.

    What vllm-router's users run (`vllm-router --vllm-pd-disaggregation --prefill ... --decode
    ...`): each role's node is picked by `CacheAwarePicker` from the router's own record of what it
    sent, so a conversation stays on the P that computed its history, whatever P's cache holds
    or how long P's queue is (until the in-flight requests are far out of balance). No D->P
    reuse; D keeps nothing.
    """

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self._p = CacheAwarePicker(len(fleet.prefill), fleet.block_tokens)
        self._d = CacheAwarePicker(len(fleet.decode), fleet.block_tokens)

    def route(self, turn: Turn, conversation: Conversation, prompt: BlockChain, now: float) -> RouteChoice:
        p, why = self._p.pick(prompt)
        d, _ = self._d.pick(prompt)
        return RouteChoice(self.fleet.prefill[p], self.fleet.decode[d], f"cache_aware_{why}")

    def observe(self, turn: Turn, choice: RouteChoice, outcome: TurnOutcome) -> None:
        self._p.done(choice.prefill.index)
        self._d.done(choice.decode.index)

    def on_publish(self, conversation: Conversation, handle: SimHandle, now: float) -> None:
        return None


class OracleRouter:
    """Every P cache hit and every verified whole-block prefix pulled; the P that finishes first.

    Run on a fleet with unlimited KV (D and P caches) and no TTL, it bounds
    what any policy can reuse. It is a bound, not a contender, so it reads
    the simulator's ground truth (each P's exact queue and cache, the
    conversation's real shared prefix), which no live router could know.
    """

    def __init__(self, fleet: Fleet, block_size: int, seed: int = 0) -> None:
        self.fleet = fleet
        self.block_size = block_size
        self._rr = _RoundRobin(fleet, seed)

    def route(self, turn: Turn, conversation: Conversation, prompt: BlockChain, now: float) -> RouteChoice:
        fleet = self.fleet
        handle = conversation.live_handle()
        pull = 0
        if handle is not None:
            shared = min(turn.reused_prefix_tokens, handle.tokens, turn.prompt_tokens - 1)
            pull = shared // self.block_size * self.block_size
        p = min(
            fleet.prefill,
            key=lambda s: (_finish_estimate(s, fleet, prompt, turn.prompt_tokens, pull, now)[0], s.index),
        )
        _, d = self._rr.next_pair()
        if handle is None:
            return RouteChoice(p, d, "recompute_no_handle")
        if pull <= 0:
            return RouteChoice(p, handle.decode, "recompute_nothing_shared")
        return RouteChoice(p, handle.decode, "pull", handle, pull)

    def observe(self, turn: Turn, choice: RouteChoice, outcome: TurnOutcome) -> None:
        return None

    def on_publish(self, conversation: Conversation, handle: SimHandle, now: float) -> None:
        return None


class _FeedViews:
    """Routing's engine views in the simulator: each prefill cache's journal, and each decode
    node's where it keeps a prefix cache, delivered by a `CacheEventFeed` (late, lossy); the
    prompt's block values stand for its block hashes."""

    def __init__(self, fleet: Fleet, lag_s: float, loss: float, seed: int) -> None:
        self.block_tokens = fleet.block_tokens
        self._feeds: dict[str, CacheEventFeed] = {}
        for i, p in enumerate(fleet.prefill):
            p.cache.journal = []
            p.feed = CacheEventFeed(lag_s, loss, random.Random(f"{seed}/{i}"))
            self._feeds[p.node.node_id] = p.feed
        for i, d in enumerate(fleet.decode):
            if d.prefix_cache is not None:
                d.prefix_cache.journal = []
                d.feed = CacheEventFeed(lag_s, loss, random.Random(f"{seed}/d{i}"))
                self._feeds[d.node.node_id] = d.feed

    def __len__(self) -> int:
        return len(self._feeds)

    def prefix_tokens(
        self,
        nodes: Iterable[tuple[str, str]],
        prompt: Prompt,
        cache_salt: str | None,
        now_s: float,
        conversation: Hashable | None = None,
    ) -> Mapping[str, int]:
        chain = prompt.block_digests
        if not isinstance(chain, BlockChain):
            return {}
        out: dict[str, int] = {}
        for node_id, _ in nodes:
            feed = self._feeds.get(node_id)
            if feed is not None:
                out[node_id] = min(
                    feed.hit_blocks(chain, now_s) * self.block_tokens, max(0, prompt.tokens - 1)
                )
        return out

    def forget_conversation(self, conversation: Hashable) -> None:
        return None


class _SimClock:
    """Simulated time: the turn being routed arrives `now` seconds into the run."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.now = 0.0

    def unix_ms(self) -> int:
        return self.fleet.unix_ms(self.now)

    def monotonic_s(self) -> float:
        return self.now


class _SingleUseCheckOut:
    """The store's check-out, in memory: each handle is handed out once."""

    def __init__(self) -> None:
        self._taken: set[str] = set()

    async def check_out(
        self, tenant: str, conversation: str, route_id: str, expected: HandleRecord, timeout_s: float
    ) -> CheckOut:
        handle = expected.handle
        if handle.handle_id in self._taken:
            raise HandleNotRetained(f"handle {handle.handle_id} was checked out already")
        self._taken.add(handle.handle_id)
        return CheckOut(handle, claim_id=route_id, revision=expected.mod_revision)


class _FleetCluster:
    """The simulated fleet as the routing service's view would show it, for one turn at a time.

    `candidates` > 0 shows only the conversation's holder and last prefill node plus that
    many other nodes of each role, drawn at random per turn (see `PolicyRouter`).
    """

    def __init__(self, fleet: Fleet, digest_block_size: int, candidates: int, seed: int) -> None:
        self.fleet = fleet
        self.digest_block_size = digest_block_size
        self.candidates = candidates
        self.model = fleet.spec.model
        self._rng = random.Random(seed)
        self.suspects: Mapping[str, NodeSuspect] = {}
        # The turn being routed: its conversation, that conversation's live handle, and when.
        self.conversation = Conversation()
        self.live: SimHandle | None = None
        self.now = 0.0

    @property
    def healthy(self) -> bool:
        return True

    def turn(self, conversation: Conversation, now: float) -> SimHandle | None:
        """Shows the fleet for a turn of `conversation` at `now`; its live handle, if any."""
        self.conversation = conversation
        self.live = conversation.live_handle()
        self.now = now
        return self.live

    def handle(self, tenant: str, conversation: str) -> HandleRecord | None:
        live = self.live
        return HandleRecord(self._cache_handle(live), live.handle_id, 0) if live is not None else None

    def node_states(self) -> tuple[NodeState, ...]:
        fleet = self.fleet
        now = self.now
        k = self.candidates
        n_p = len(fleet.prefill)
        n_d = len(fleet.decode)
        if k <= 0 or n_p + n_d <= 2 * k + 2:
            return fleet.node_states(now)
        rng = self._rng
        picked = set(rng.sample(range(n_p), min(k, n_p)))
        picked.update(n_p + i for i in rng.sample(range(n_d), min(k, n_d)))
        if self.live is not None:
            picked.add(n_p + self.live.decode.index)
        last = fleet.prefill_by_id.get(self.conversation.last_prefill)
        if last is not None:
            picked.add(last.index)
        # Only the nodes shown get a load report built: at 200 nodes that is most of the saving.
        return tuple(fleet.node_state(i, now) for i in sorted(picked))

    def node(self, node_id: str) -> Node | None:
        fleet = self.fleet
        found = fleet.prefill_by_id.get(node_id) or fleet.decode_by_id.get(node_id)
        return found.node if found is not None else None

    def newest_report_unix_ms(self) -> int:
        return self.fleet.unix_ms(self.now)

    async def await_handle(self, tenant: str, conversation: str, handle_id: str, wait_s: float) -> bool:
        # The simulated engines publish before the next turn is routed: nothing to wait for.
        return False

    def _cache_handle(self, handle: SimHandle) -> CacheHandle:
        cached = handle.cache_handle
        if cached is None:
            node = handle.decode.node
            fleet = self.fleet
            cached = CacheHandle(
                handle_id=str(handle.handle_id),
                tenant=handle.tenant,
                conversation=handle.conversation,
                holder_node_id=node.node_id,
                holder_incarnation=node.incarnation,
                vllm=VllmHandle(
                    remote_engine_id=node.engine_id,
                    remote_request_id=f"r{handle.handle_id}",
                    remote_block_ids=((),),
                    remote_num_tokens=handle.tokens,
                    remote_host=node.side_channel_host,
                    remote_port=node.side_channel_port,
                ),
                wall_expiry_unix_ms=fleet.unix_ms(handle.expiry_s),
                retained_bytes=handle.bytes,
                digests=handle_digests(handle.chain, self.digest_block_size),
                published_unix_ms=fleet.unix_ms(handle.published_s),
                model=self.model,
            )
            handle.cache_handle = cached
        return cached


def _settled(step: Coroutine[Any, Any, T]) -> T:
    """The result of a coroutine that never suspends: the Router over in-memory ports."""
    try:
        step.send(None)
    except StopIteration as done:
        result: T = done.value
        return result
    step.close()
    raise RuntimeError("the router waited on something in the simulator")


class PolicyRouter:
    """kvplane: the routing service's own `Router` (kvplane.services.routing.router), in process.

    The Router keeps what it keeps in the service, by the same code: the load
    reports plus the work it routed since, and its own record of the prompts it
    sent each prefill node, never the prefill nodes' real caches. Its ports are
    the fleet (`_FleetCluster`), an in-memory single-use check-out and simulated
    time; its settings are the service's (`RoutingSection`), with the simulated
    engines' delivery: a routed turn reaches P at once; the simulated D takes
    the turn once P is done, as the service's default `decode_after_prefill`
    expects of vLLM, so the work routed to a D counts there until then.

    `candidates` > 0 shows the policy only the conversation's holder and
    last prefill node plus that many other nodes of each role, drawn at
    random per turn: a sharded router's view, which keeps a route's cost
    flat in the fleet's size. 0 shows every node, as the service does.
    """

    def __init__(
        self,
        fleet: Fleet,
        policy: RoutingPolicy,
        digest_block_size: int,
        *,
        candidates: int = 0,
        seed: int = 0,
        events: tuple[float, float] | None = None,
        prefill_on_decode: bool = False,
    ) -> None:
        """`events`: (lag s, loss): prefill engines publish KV events that reach the Router that
        late, each lost with that probability, as routing's engine views (`cache_events`).
        `prefill_on_decode`: the front can run a turn on D alone (RouteRequest.prefill_on_decode_ok)."""
        self.fleet = fleet
        self.prefill_on_decode = prefill_on_decode
        self.digest_block_size = digest_block_size
        self.model = fleet.spec.model
        self.settings = RoutingSection(send_delay_ms=0)
        self._cluster = _FleetCluster(fleet, digest_block_size, candidates, seed)
        self._clock = _SimClock(fleet)
        self._routes = 0
        self.router = KvplaneRouter(
            policy,
            self.settings,
            self._cluster,
            _SingleUseCheckOut(),
            self._clock,
            new_route_id=self._route_id,
            engine_caches=_FeedViews(fleet, *events, seed) if events is not None else None,
        )

    @property
    def costs(self) -> CostModel:
        return self.router.costs

    def _route_id(self) -> str:
        self._routes += 1
        return str(self._routes)

    def route(self, turn: Turn, conversation: Conversation, prompt: BlockChain, now: float) -> RouteChoice:
        handle = self._cluster.turn(conversation, now)
        self._clock.now = now
        block = self.digest_block_size
        request = TurnRequest(
            turn.tenant,
            turn.conversation,
            self.model,
            Prompt(turn.prompt_tokens, block_digests=prompt, digest_block_size=block),
            # As the gateway passes the request's max_tokens: here the turn's own output.
            max_output_tokens=turn.output_tokens,
            prefill_on_decode_ok=self.prefill_on_decode,
        )
        outcome = _settled(self.router.route(request))
        d = self.fleet.decode_by_id[outcome.plan.decode.node_id]
        decision = outcome.decision.value
        keep = not outcome.skip_decode_retention
        if outcome.decision is Decision.PREFILL_ON_DECODE:
            # D prefills from the handle it holds; no prefill node is sent anything.
            return RouteChoice(
                self.fleet.prefill[0],
                d,
                decision,
                pulled_tokens=outcome.plan.verdict.reusable_tokens,
                route_id=outcome.route_id,
                keep_decode_kv=keep,
                local_prefill=True,
                local_handle=handle,
            )
        p = self.fleet.prefill_by_id[outcome.plan.prefill.node_id]
        if outcome.handle is not None and handle is not None:
            # The pull is offered up to the verified prefix; P reads what its cache lacks.
            pulled = outcome.plan.verdict.reusable_tokens
            return RouteChoice(p, d, decision, handle, pulled, route_id=outcome.route_id, keep_decode_kv=keep)
        return RouteChoice(p, d, decision, route_id=outcome.route_id, keep_decode_kv=keep)

    def observe(self, turn: Turn, choice: RouteChoice, outcome: TurnOutcome) -> None:
        report = TurnReport(
            success=True,
            prompt_tokens=turn.prompt_tokens,
            pulled_tokens=outcome.pulled_tokens,
            cached_tokens=outcome.cached_tokens,
            transfer_ms=outcome.transfer_s * 1000.0,
            prefill_ms=outcome.prefill_s * 1000.0,
            prefill_queued_ms=outcome.queued_s * 1000.0,
            ttft_ms=outcome.ttft_s * 1000.0,
        )
        # As ReportTurn in the service: the work leaves the ledger, the costs are learned.
        self.router.report(choice.route_id, turn.tenant, turn.conversation, report)

    def on_publish(self, conversation: Conversation, handle: SimHandle, now: float) -> None:
        return None
