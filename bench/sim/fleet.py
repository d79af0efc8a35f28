"""The simulated fleet as routers see it: node states, conversations, and load reports.

What a router may read, by what a live router could know:

- load reports: `Fleet.node_states` / `Fleet.node_state` (stale by up to
  `report_interval_s`, as the node agents' reports are), plus the router's
  own record of the work it routed since (`InFlightLedger`): kvplane's
  `PolicyRouter` and `PrefixAffinityRouter` both keep one;
- the conversation's retained handle: `Conversation.live_handle()` (the
  metadata service's record: published, not yet read, released or expired);
- what was routed before: `Conversation.last_prefill` and
  `Conversation.last_prompt`, the prefill node the previous turn went to and
  that turn's prompt blocks (a routing service records what it sends);
- a prefill node's cache contents, `PrefillState.cache`, only for a router
  that models engines publishing KV-cache events (vLLM's `kv_events_config`),
  as prefix-cache-aware routers subscribe to (`PrefixAffinityRouter`).
  kvplane's `PolicyRouter` does not read it: it knows only what it routed.
  Likewise `DecodeState.prefix_cache`, a decode node's own prefix cache, for
  the routers that model decode engines publishing their events
  (`DecodeCacheRouter`), and `DecodeState.host_cache` for `llm-d-p2p`;
- the number of turns waiting in the prefill nodes' queues, for
  `conditional-disagg` only: Dynamo's prefill workers take turns from one
  shared queue whose length its decode workers read.

Everything else (`DecodeState`'s other internals, the queued turns and reads
of `PrefillState`) is the simulator's ground truth. Only `OracleRouter`, a
bound rather than a contender, reads it. The proxies read nothing but their
own round-robin counters and the handles D published to them (whether D
still holds a handle is the outcome of the pull, not an input to the route).
"""

from __future__ import annotations

from collections import deque
from typing import Any

from kvplane.bench.sim.block_chain import BlockChain
from kvplane.bench.sim.cluster import (
    ENGINE_BLOCK_TOKENS,
    ClusterSpec,
    DecodeState,
    PrefillState,
    SimHandle,
    build_node,
)
from kvplane.bench.sim.costs import SimCosts
from kvplane.bench.sim.prefix_cache import PrefixCache
from kvplane.services.common.model.nodes import NodeRole
from kvplane.services.routing.policy import NodeState


class Conversation:
    """What the fleet remembers of one conversation between its turns."""

    __slots__ = ("chain", "follow_ups", "handle", "in_flight", "last_prefill", "last_prompt")

    def __init__(self) -> None:
        # Block chain of the latest turn's context (prompt, then answer).
        self.chain = BlockChain()
        # The latest turn's retained handle, if its decode node still holds it.
        self.handle: SimHandle | None = None
        # The prefill node of the latest turn ("" before the first) and that turn's prompt blocks.
        self.last_prefill = ""
        self.last_prompt = BlockChain()
        # Closed loop (`SimConfig.closed_loop`): a turn is in flight, and the turns held behind it.
        self.in_flight = False
        self.follow_ups: deque[Any] = deque()

    def live_handle(self) -> SimHandle | None:
        handle = self.handle
        return handle if handle is not None and handle.alive and not handle.checked_out else None


class Fleet:
    """Prefill and decode node states, and the load reports derived from them.

    Load reports are what the routing service sees: refreshed every
    `report_interval_s` (the node agent's `load_interval_s`), stale between.
    0 makes every report current at each route: a router that also counts
    the work it has just sent.
    """

    def __init__(
        self,
        spec: ClusterSpec,
        costs: SimCosts,
        epoch_unix_ms: int,
        report_interval_s: float = 0.5,
        block_tokens: int = ENGINE_BLOCK_TOKENS,
    ) -> None:
        self.spec = spec
        self.costs = costs
        self.epoch_unix_ms = epoch_unix_ms
        self.report_interval_s = report_interval_s
        kvb = costs.kv_bytes_per_token
        self.block_tokens = block_tokens
        cache_blocks = spec.prefill_cache_bytes // (block_tokens * kvb)
        self.prefill = [
            PrefillState(build_node(NodeRole.PREFILL, i, spec, kvb), i, cache_blocks, report_interval_s)
            for i in range(spec.prefill_nodes)
        ]
        self.decode = [
            DecodeState(
                build_node(NodeRole.DECODE, i, spec, kvb),
                i,
                spec.decode_kv_capacity_bytes,
                spec.decode_host_bytes,
            )
            for i in range(spec.decode_nodes)
        ]
        if spec.decode_offload_all:
            for d in self.decode:
                d.host_cache = PrefixCache(spec.decode_host_bytes // (block_tokens * kvb))
        if spec.decode_prefix_cache:
            for d in self.decode:
                d.prefix_cache = PrefixCache(spec.decode_kv_capacity_bytes // (block_tokens * kvb))
        self.prefill_by_id = {p.node.node_id: p for p in self.prefill}
        self.decode_by_id = {d.node.node_id: d for d in self.decode}
        self._states: tuple[NodeState, ...] = ()
        self._states_epoch = -1
        # One node's report at a time, for routers that look at a few nodes per turn.
        count = len(self.prefill) + len(self.decode)
        self._one: list[NodeState | None] = [None] * count
        self._one_epoch = [-1] * count

    def unix_ms(self, now: float) -> int:
        return self.epoch_unix_ms + int(now * 1000.0)

    def _epoch(self, now: float) -> tuple[int, float]:
        interval = self.report_interval_s
        if interval > 0:
            epoch = int(now / interval)
            return epoch, epoch * interval
        return -2 - int(now * 1e6), now  # always a new report

    def node_state(self, index: int, now: float) -> NodeState:
        """Node `index` (prefill nodes first, then decode) with its latest load report."""
        epoch, report_s = self._epoch(now)
        state = self._one[index]
        if state is None or self._one_epoch[index] != epoch or self.report_interval_s <= 0:
            state = self._report(index, report_s)
            self._one[index] = state
            self._one_epoch[index] = epoch
        return state

    def node_states(self, now: float) -> tuple[NodeState, ...]:
        """Every node with its latest load report, as of the last report tick."""
        epoch, report_s = self._epoch(now)
        if epoch != self._states_epoch or self.report_interval_s <= 0:
            self._states = tuple(
                self._report(i, report_s) for i in range(len(self.prefill) + len(self.decode))
            )
            self._states_epoch = epoch
        return self._states

    def _report(self, index: int, report_s: float) -> NodeState:
        """Node `index`'s load report of the tick at `report_s`."""
        report_ms = self.unix_ms(report_s)
        n_p = len(self.prefill)
        if index < n_p:
            p = self.prefill[index]
            return NodeState(p.node, p.load(report_s, report_ms))
        d = self.decode[index - n_p]
        return NodeState(d.node, d.load(report_ms, self.costs.kv_bytes_per_token))
