"""The simulator's kvplane router knows what the live routing service knows, kept by the same code."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest

from kvplane.bench.sim.block_chain import BlockChain, BlockIds
from kvplane.bench.sim.cluster import ClusterSpec
from kvplane.bench.sim.costs import SimCosts
from kvplane.bench.sim.fleet import Conversation, Fleet
from kvplane.bench.sim.routers import PolicyRouter, TurnOutcome
from kvplane.bench.workloads.turns import Turn
from kvplane.services.routing.policy import RoutingPolicy, load_policy
from kvplane.services.routing.router import Router

BLOCK = 16


def fleet(prefill: int = 4) -> Fleet:
    spec = ClusterSpec(prefill_nodes=prefill, decode_nodes=2, decode_kv_capacity_bytes=80 << 30)
    return Fleet(spec, SimCosts(), 1_750_000_000_000, report_interval_s=0.5)


def router(f: Fleet) -> PolicyRouter:
    return PolicyRouter(f, RoutingPolicy(load_policy()), BLOCK)


class _Untouchable:
    """Stands in for a prefill node's real cache: kvplane's router must never read it."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the policy router read the prefill cache's {name!r}")


def turn(conversation: str, prompt_tokens: int, arrival_s: float = 10.01) -> Turn:
    return Turn(arrival_s, conversation, 0, prompt_tokens, 200)


def test_a_burst_between_two_load_reports_spreads_over_prefill_nodes() -> None:
    f = fleet()
    r = router(f)
    ids = BlockIds()
    picked: Counter[str] = Counter()
    for i in range(8):
        conversation = Conversation()
        prompt = BlockChain().extended(4000 // BLOCK, ids)
        # Every turn arrives after the last report tick and before the next: the reports stay idle.
        choice = r.route(turn(f"c{i}", 4000), conversation, prompt, 10.01)
        picked[choice.prefill.node.node_id] += 1
    assert len(picked) == 4 and max(picked.values()) == 2, picked


def test_the_next_turn_goes_back_to_the_prefill_node_that_holds_its_prompt_without_reading_its_cache(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    f = fleet()
    for p in f.prefill:
        monkeypatch.setattr(p, "cache", _Untouchable(), raising=False)
    r = router(f)
    ids = BlockIds()
    conversation = Conversation()
    first = BlockChain().extended(6000 // BLOCK, ids)
    where = r.route(turn("c", 6000, 10.0), conversation, first, 10.0).prefill.node.node_id
    # Much later, the next turn extends the first prompt. Its node now reports a short queue,
    # so only the record of what it was sent can make it the cheapest.
    holder = f.prefill_by_id[where]
    holder.jobs += 1
    holder.busy = True
    holder.queued_tokens += 2000
    second = first.extended(300 // BLOCK, ids)
    again = r.route(turn("c", 6300, 100.0), conversation, second, 100.0)
    assert again.prefill.node.node_id == where


def test_the_simulator_routes_and_learns_through_the_routing_services_router() -> None:
    f = fleet()
    r = router(f)
    assert isinstance(r.router, Router)
    prior = r.costs.prefill_samples
    ids = BlockIds()
    t = turn("c", 4000)
    choice = r.route(t, Conversation(), BlockChain().extended(4000 // BLOCK, ids), 10.01)
    assert choice.route_id
    # P's report of the turn teaches the Router's cost model, once, as ReportTurn does.
    r.observe(t, choice, TurnOutcome(0, 0.0, 0.25, 0.3, 0))
    assert r.costs is r.router.costs and r.costs.prefill_samples == prior + 1
    r.observe(t, choice, TurnOutcome(0, 0.0, 0.25, 0.3, 0))
    assert r.costs.prefill_samples == prior + 1


def test_with_events_a_prefill_cache_the_router_never_sent_to_is_seen_after_the_lag() -> None:
    # Another router (or an earlier process) filled p2's cache with this conversation's history: the
    # record knows nothing of it; the engine's events tell the router, once they arrive.
    f = fleet()
    r = PolicyRouter(f, RoutingPolicy(load_policy()), BLOCK, events=(0.5, 0.0))
    ids = BlockIds()
    history = BlockChain().extended(8000 // BLOCK, ids)
    holder = f.prefill[2]
    holder.cache.insert(history)
    assert holder.feed is not None and holder.cache.journal
    holder.feed.publish(9.0, holder.cache.journal)
    holder.cache.journal.clear()
    prompt = history.extended(500 // BLOCK, ids)
    views = r.router.engine_caches
    assert views is not None
    nodes = [(p.node.node_id, p.node.incarnation) for p in f.prefill]
    from kvplane.services.routing.policy import Prompt

    early = views.prefix_tokens(nodes, Prompt(8500, block_digests=prompt), None, 9.4)
    late = views.prefix_tokens(nodes, Prompt(8500, block_digests=prompt), None, 9.5)
    assert early[holder.node.node_id] == 0
    assert late[holder.node.node_id] == 8000 and late[f.prefill[0].node.node_id] == 0
    # And the route follows the events to the node that holds the history.
    choice = r.route(turn("c", 8500, 10.0), Conversation(), prompt, 10.0)
    assert choice.prefill.node.node_id == holder.node.node_id


def test_a_turn_still_at_prefill_counts_on_its_decode_node_after_the_next_load_report() -> None:
    # As the routing service's default `decode_after_prefill` has it: D takes a turn once P is
    # done with it, so a load report D sends in between does not show it, and the work routed
    # to D counts there until then. Two 60,000-token turns, half a second apart, with a report
    # tick between them: both on one D would not fit its 100,000 tokens of KV.
    costs = SimCosts()
    spec = ClusterSpec(prefill_nodes=4, decode_nodes=2, decode_kv_capacity_bytes=costs.kv_bytes(100_000))
    f = Fleet(spec, costs, 1_750_000_000_000, report_interval_s=0.5)
    r = router(f)
    ids = BlockIds()
    picked = []
    for i, at in enumerate((10.01, 10.61)):
        prompt = BlockChain().extended(60_000 // BLOCK, ids)
        choice = r.route(Turn(at, f"c{i}", 0, 60_000, 200), Conversation(), prompt, at)
        picked.append(choice.decode.node.node_id)
    # The first turn's prefill outlasts the report tick at 10.5 s.
    assert costs.prefill_s(60_000) > 0.5
    assert picked[0] != picked[1], picked
