"""Current loads: work routed since a node's last report is added to it until a report covers it."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest

from kvplane.services.common.model.nodes import NodeRole
from kvplane.services.routing.policy import CostModel, NodeState, Prompt, RoutingPolicy, load_policy
from kvplane.services.routing.settings import RoutingSection
from kvplane.services.routing.state.inflight import InFlightLedger, RoutedWork, routed_work, turn_work
from tests.unit.routing_policy_fixtures import NOW, mk_node, snap, state

P0 = mk_node("p0", NodeRole.PREFILL)
D0 = mk_node("d0")


@pytest.fixture(scope="module")
def policy() -> RoutingPolicy:
    return RoutingPolicy(load_policy())


def work(
    route_id: str, tokens: int, *, visible: int = NOW + 100, routed: int = NOW
) -> tuple[RoutedWork, ...]:
    return turn_work(
        route_id,
        routed_unix_ms=routed,
        prefill_node_id="p0",
        prefill_tokens=tokens,
        prefill_visible_unix_ms=visible,
        decode_node_id="d0",
        decode_kv_blocks=tokens // 16,
        decode_visible_unix_ms=visible + 500,
    )


def loads(ledger: InFlightLedger, states: list[NodeState], now: int) -> dict[str, NodeState]:
    return {s.node.node_id: s for s in ledger.current(states, now)}


def fleet(reported_ms: int = NOW) -> list[NodeState]:
    return [
        state(P0, queued_prefill_tokens=1000, reported_unix_ms=reported_ms),
        state(
            D0,
            free_kv_blocks=10_000,
            total_kv_blocks=10_000,
            running_requests=2,
            reported_unix_ms=reported_ms,
        ),
    ]


def test_routed_work_is_added_to_the_last_report_of_each_leg() -> None:
    ledger = InFlightLedger()
    ledger.add(*work("r1", 4000))
    now = loads(ledger, fleet(), NOW + 50)
    p, d = now["p0"].load, now["d0"].load
    assert p is not None and d is not None
    assert p.queued_prefill_tokens == 5000 and p.queued_requests == 1
    assert d.free_kv_blocks == 10_000 - 250 and d.running_requests == 3


def test_a_report_taken_after_the_work_became_visible_covers_it() -> None:
    ledger = InFlightLedger()
    ledger.add(*work("r1", 4000))
    # P's report now shows the work; D's not yet (the turn reaches D after P is done).
    now = loads(ledger, fleet(reported_ms=NOW + 200), NOW + 250)
    p, d = now["p0"].load, now["d0"].load
    assert p is not None and d is not None
    assert p.queued_prefill_tokens == 1000
    assert d.running_requests == 3
    now = loads(ledger, fleet(reported_ms=NOW + 700), NOW + 750)
    d = now["d0"].load
    assert d is not None and d.running_requests == 2
    assert len(ledger) == 0


def test_a_finished_turn_leaves_both_nodes() -> None:
    ledger = InFlightLedger()
    ledger.add(*work("r1", 4000))
    ledger.add(*work("r2", 100))
    ledger.finished("r1")
    p = loads(ledger, fleet(), NOW + 50)["p0"].load
    assert p is not None and p.queued_prefill_tokens == 1100


def test_work_older_than_the_age_limit_is_dropped_even_without_a_report() -> None:
    ledger = InFlightLedger(max_age_ms=5_000)
    ledger.add(*work("r1", 4000))
    p = loads(ledger, fleet(reported_ms=NOW - 1), NOW + 6_000)["p0"].load
    assert p is not None and p.queued_prefill_tokens == 1000


def test_decode_work_ageing_out_a_turn_at_a_time_is_shed_without_refolding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # D's share of each turn becomes visible only once P is expected to be done; when that
    # estimate runs far ahead, the work leaves by age, one turn per route. Each route must then
    # take the aged turn out of D's fold, not fold every turn still pending again.
    ledger = InFlightLedger(max_age_ms=1_000)
    refolds: Counter[str] = Counter()
    refold = InFlightLedger._refold

    def counting(self: InFlightLedger, node_id: str, *args: object) -> object:
        refolds[node_id] += 1
        return refold(self, node_id, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(InFlightLedger, "_refold", counting)
    d_state = [state(D0, free_kv_blocks=10**6, total_kv_blocks=10**6, reported_unix_ms=NOW)]
    routed: dict[str, int] = {}
    for i in range(3_000):
        now = NOW + i
        # Routes that ran together are recorded out of order (each after its own check-out).
        routed[f"r{i}"] = now - 7 * (i % 3)
        ledger.add(*work(f"r{i}", 160, visible=now + 100, routed=routed[f"r{i}"])[1:])
        d = loads(ledger, d_state, now)["d0"].load
        assert d is not None
        # The turns routed in the last second, and only those, hold blocks on D.
        live = sum(1 for t in routed.values() if t >= now - 1_000)
        assert d.free_kv_blocks == 10**6 - 10 * live, i
    assert refolds["d0"] <= 2
    # Turns leaving D one at a time are taken out of the fold too.
    for i in range(2_000, 3_000):
        ledger.finished(f"r{i}")
        del routed[f"r{i}"]
        d = loads(ledger, d_state, NOW + 2_999)["d0"].load
        live = sum(1 for t in routed.values() if t >= NOW + 1_999)
        assert d is not None and d.free_kv_blocks == 10**6 - 10 * live, i
    assert len(ledger) == live
    assert refolds["d0"] <= 2


def test_a_node_without_a_report_stays_unknown() -> None:
    ledger = InFlightLedger()
    ledger.add(*work("r1", 4000))
    assert ledger.current([NodeState(P0)], NOW)[0].load is None


def test_a_node_serving_both_legs_gets_one_item_with_both() -> None:
    items = turn_work(
        "r",
        routed_unix_ms=NOW,
        prefill_node_id="b0",
        prefill_tokens=100,
        prefill_visible_unix_ms=NOW + 100,
        decode_node_id="b0",
        decode_kv_blocks=7,
        decode_visible_unix_ms=NOW + 900,
    )
    assert len(items) == 1 and items[0].prefill_tokens == 100 and items[0].kv_blocks == 7


def test_the_ledger_keeps_at_most_its_limit_of_routes() -> None:
    ledger = InFlightLedger(limit=3)
    for i in range(10):
        ledger.add(*work(f"r{i}", 10))
    assert len(ledger) == 3
    p = loads(ledger, fleet(), NOW + 50)["p0"].load
    assert p is not None and p.queued_prefill_tokens == 1030


def burst(policy: RoutingPolicy, ledger: InFlightLedger | None, turns: int) -> Counter[str]:
    """`turns` turns of 4k tokens arriving together, between two load reports."""
    reported = [
        state(mk_node("p0", NodeRole.PREFILL), queued_prefill_tokens=0),
        *(state(mk_node(f"p{i}", NodeRole.PREFILL), queued_prefill_tokens=1000) for i in (1, 2, 3)),
        state(D0, free_kv_blocks=100_000, total_kv_blocks=100_000),
    ]
    picked: Counter[str] = Counter()
    for i in range(turns):
        nodes = ledger.current(reported, NOW) if ledger is not None else tuple(reported)
        plan = policy.route(snap(nodes, conversation=f"c{i}", prompt=Prompt(4000)))
        picked[plan.prefill.node_id] += 1
        if ledger is not None:
            ledger.add(
                *turn_work(
                    f"r{i}",
                    routed_unix_ms=NOW,
                    prefill_node_id=plan.prefill.node_id,
                    prefill_tokens=4000,
                    prefill_visible_unix_ms=NOW + 100,
                    decode_node_id=plan.decode.node_id,
                    decode_kv_blocks=250,
                    decode_visible_unix_ms=NOW + 600,
                )
            )
    return picked


def test_a_burst_of_turns_arriving_together_spreads_over_prefill_nodes(policy: RoutingPolicy) -> None:
    # By the reports alone, p0 looks idle and takes every turn of the burst.
    assert burst(policy, None, 8) == {"p0": 8}
    spread = burst(policy, InFlightLedger(), 8)
    assert set(spread) == {"p0", "p1", "p2", "p3"} and max(spread.values()) == 2, spread


def test_replicas_that_cannot_see_each_others_routes_break_ties_differently(policy: RoutingPolicy) -> None:
    nodes = [state(mk_node(f"p{i}", NodeRole.PREFILL), queued_prefill_tokens=0) for i in range(4)]
    nodes.append(state(D0, free_kv_blocks=100_000, total_kv_blocks=100_000))
    turn = {"conversation": "same", "prompt": Prompt(4000)}
    unsalted = {policy.route(snap(nodes, **turn)).prefill.node_id for _ in range(8)}
    salted = {policy.route(snap(nodes, tie_salt=f"replica-{r}", **turn)).prefill.node_id for r in range(8)}
    assert len(unsalted) == 1
    assert len(salted) > 1, salted


RATE = 0.032  # ms per prompt token


def test_a_reported_queue_drains_at_the_prefill_rate_since_the_report() -> None:
    ledger = InFlightLedger()
    reported = [state(P0, queued_prefill_tokens=10_000, reported_unix_ms=NOW)]
    p = ledger.current(reported, NOW + 160, prefill_ms_per_token=RATE)[0].load
    assert p is not None and p.queued_prefill_tokens == 5_000
    # Long after the report, the queue it showed is done.
    p = ledger.current(reported, NOW + 1_000, prefill_ms_per_token=RATE)[0].load
    assert p is not None and p.queued_prefill_tokens == 0 and p.reported_unix_ms == NOW


def test_routed_work_queues_behind_the_reported_queue_as_on_a_fifo_node() -> None:
    ledger = InFlightLedger()
    # An idle node at the report; 4,000 tokens routed 300 ms later start only then.
    ledger.add(*work("r1", 4000, visible=NOW + 400, routed=NOW + 300))
    reported = [state(P0, queued_prefill_tokens=0, reported_unix_ms=NOW)]
    p = ledger.current(reported, NOW + 310, prefill_ms_per_token=RATE)[0].load
    assert p is not None and p.queued_prefill_tokens == round((4000 * RATE - 10) / RATE)


def test_a_report_stamped_the_same_millisecond_as_the_route_does_not_cover_it() -> None:
    # Turns of a burst arrive in one millisecond; the report read for the first was taken before
    # any of them was routed, whatever its stamp says.
    ledger = InFlightLedger()
    ledger.add(*work("r1", 4000, visible=NOW, routed=NOW))
    p = loads(ledger, fleet(reported_ms=NOW), NOW)["p0"].load
    assert p is not None and p.queued_prefill_tokens == 5000


AFFINE = CostModel(prefill_fixed_ms=100.0, recompute_ms_per_token=0.03, reused_ms_per_token=0.0)
P1 = mk_node("p1", NodeRole.PREFILL)


def small_turns(ledger: InFlightLedger, n: int, tokens: int, costs: CostModel) -> None:
    for i in range(n):
        ledger.add(
            *turn_work(
                f"s{i}",
                routed_unix_ms=NOW,
                prefill_node_id="p0",
                prefill_tokens=tokens,
                prefill_visible_unix_ms=NOW + 100,
                decode_node_id="d0",
                decode_kv_blocks=1,
                decode_visible_unix_ms=NOW + 600,
                prefill_ms=costs.prefill_ms(tokens),
            )
        )


def test_a_burst_of_small_turns_queues_each_ones_fixed_cost() -> None:
    ledger = InFlightLedger()
    small_turns(ledger, 10, 20, AFFINE)
    p = ledger.current([state(P0, queued_prefill_tokens=0)], NOW, costs=AFFINE)[0]
    assert p.queued_prefill_ms == pytest.approx(10 * (100.0 + 20 * 0.03))
    assert p.load is not None and p.load.queued_prefill_tokens == 200
    assert AFFINE.queue_ms(p) == p.queued_prefill_ms


def test_a_node_with_a_burst_of_small_turns_is_busier_than_one_with_a_single_long_turn(
    policy: RoutingPolicy,
) -> None:
    reported = [
        state(P0, queued_prefill_tokens=0),
        # One 4,000-token turn waits on p1.
        state(P1, queued_prefill_tokens=4000, queued_requests=1),
        state(D0, free_kv_blocks=100_000, total_kv_blocks=100_000),
    ]
    turn = snap(reported, prompt=Prompt(1000))
    # Priced by tokens only, ten 20-token turns look like 6 ms of work: p0 looks the idler.
    by_tokens = InFlightLedger()
    small_turns(by_tokens, 10, 20, CostModel(prefill_fixed_ms=0.0, recompute_ms_per_token=0.03))
    rate_only = replace(turn, nodes=by_tokens.current(reported, NOW, prefill_ms_per_token=0.03))
    assert policy.route(rate_only, AFFINE).prefill.node_id == "p0"
    # Each of them costs its fixed part too: a second of work, against p1's 220 ms.
    affine = InFlightLedger()
    small_turns(affine, 10, 20, AFFINE)
    current = replace(turn, nodes=affine.current(reported, NOW, costs=AFFINE))
    assert policy.route(current, AFFINE).prefill.node_id == "p1"


def test_a_reported_queue_of_requests_drains_in_time_since_the_report() -> None:
    ledger = InFlightLedger()
    # Two waiting requests, 1,000 tokens: 2 x 100 ms + 30 ms of work at the report.
    reported = [state(P0, queued_prefill_tokens=1000, queued_requests=2, reported_unix_ms=NOW)]
    p = ledger.current(reported, NOW + 115, costs=AFFINE)[0]
    assert p.queued_prefill_ms == pytest.approx(115.0)
    assert p.load is not None and p.load.queued_prefill_tokens == 500
    done = ledger.current(reported, NOW + 1_000, costs=AFFINE)[0]
    assert done.queued_prefill_ms == 0.0 and AFFINE.queue_ms(done) == 0.0


def test_a_routed_turn_is_priced_with_one_fixed_cost_and_its_reused_tokens(policy: RoutingPolicy) -> None:
    costs = replace(AFFINE, reused_ms_per_token=0.01)
    reported = [
        state(P0, queued_prefill_tokens=0),
        state(D0, free_kv_blocks=100_000, total_kv_blocks=100_000),
    ]
    turn = snap(reported, prompt=Prompt(3000), prefill_cached_tokens={"p0": 2000})
    plan = policy.route(turn, costs)
    items = routed_work("r", turn, plan, costs, pulled=False, send_delay_ms=0, decode_after_prefill=True)
    on_p = next(item for item in items if item.node_id == "p0")
    assert on_p.prefill_tokens == 1000
    assert on_p.prefill_ms == pytest.approx(100.0 + 1000 * 0.03 + 2000 * 0.01)
    # D sees the turn once P is expected to be done with it.
    on_d = next(item for item in items if item.node_id == "d0")
    assert on_d.visible_unix_ms == NOW + int(on_p.prefill_ms)


@pytest.mark.parametrize("seed", range(8))
def test_the_kept_fold_answers_as_a_fresh_ledger_would(seed: int) -> None:
    # One ledger lives through a random history of routes, finished turns, reports, price changes
    # and passing time; at every step it must answer exactly as a new ledger given the same
    # unfinished work does (the new one folds everything from scratch, the kept one extends its
    # fold as work is routed).
    rnd = random.Random(seed)
    nodes = [mk_node(f"p{i}", NodeRole.PREFILL) for i in range(2)] + [mk_node(f"d{i}") for i in range(2)]
    reported = {n.node_id: NOW for n in nodes}
    queued = {n.node_id: 0 for n in nodes}
    kept = InFlightLedger(max_age_ms=5_000)
    unfinished: dict[str, tuple[RoutedWork, ...]] = {}
    costs = CostModel()
    now = NOW
    for step in range(400):
        now += rnd.choice((0, 1, 3, 20, 150))
        action = rnd.random()
        if action < 0.5:
            p, d = rnd.choice(nodes[:2]).node_id, rnd.choice(nodes[2:] + nodes[:1]).node_id
            tokens = rnd.randrange(1, 5000)
            items = turn_work(
                f"r{step}",
                # Routes that ran together are recorded out of order (each after its own check-out).
                routed_unix_ms=now - rnd.choice((0, 0, 2, 30)),
                prefill_node_id=p,
                prefill_tokens=tokens,
                prefill_visible_unix_ms=now + rnd.choice((0, 1, 40)),
                decode_node_id=d,
                decode_kv_blocks=tokens // 16,
                decode_visible_unix_ms=now + rnd.choice((0, 200)),
                prefill_ms=rnd.choice((0.0, costs.prefill_ms(tokens))),
            )
            kept.add(*items)
            unfinished[f"r{step}"] = items
        elif action < 0.65 and unfinished:
            route_id = rnd.choice(sorted(unfinished))
            kept.finished(route_id)
            del unfinished[route_id]
        elif action < 0.85:
            # From step 150 on p1 and d1 report no more: their work ages out instead.
            node = rnd.choice(nodes if step < 150 else [nodes[0], nodes[2]]).node_id
            reported[node] = max(reported[node], now - rnd.choice((0, 1, 10)))
            queued[node] = rnd.choice((0, 0, 300, 4000))
        elif action < 0.9:
            costs = replace(costs, recompute_ms_per_token=rnd.choice((0.01, 0.0282, 0.05)))
        states = [
            state(
                n,
                queued_prefill_tokens=queued[n.node_id],
                reported_unix_ms=reported[n.node_id],
                # Room enough that every block of routed work shows in the answer.
                free_kv_blocks=10**6,
                total_kv_blocks=10**6,
            )
            for n in nodes
        ]
        fresh = InFlightLedger(max_age_ms=5_000)
        for items in unfinished.values():
            fresh.add(*items)
        assert kept.current(states, now, costs=costs) == fresh.current(states, now, costs=costs), step


def _covered_run(ledger: InFlightLedger, route_id: str) -> None:
    """Routes `route_id` and lets D's report taken at NOW + 700 show its request running."""
    ledger.add(*work(route_id, 4000))
    d = loads(ledger, fleet(reported_ms=NOW + 700), NOW + 750)["d0"].load
    assert d is not None and d.running_requests == 2  # the report's 2 now include it


def test_a_request_that_ended_after_d_reported_it_running_is_taken_out_until_a_later_report() -> None:
    ledger = InFlightLedger()
    _covered_run(ledger, "r1")
    ledger.finished("r1", decode_node_id="d0", ended_unix_ms=NOW + 900)
    # D's report of NOW + 700 still counts the answer that ended at NOW + 900.
    d = loads(ledger, fleet(reported_ms=NOW + 700), NOW + 950)["d0"].load
    assert d is not None and d.running_requests == 1
    # A report taken after the end does not count it: nothing more is taken out, and the
    # departure is forgotten.
    d = loads(ledger, fleet(reported_ms=NOW + 1000), NOW + 1050)["d0"].load
    assert d is not None and d.running_requests == 2
    d = loads(ledger, fleet(reported_ms=NOW + 700), NOW + 1100)["d0"].load
    assert d is not None and d.running_requests == 2


def test_a_request_no_report_had_shown_running_is_not_taken_out_twice() -> None:
    ledger = InFlightLedger()
    ledger.add(*work("r1", 4000))
    # Finished before any report showed it: leaving the ledger is all it takes.
    ledger.finished("r1", decode_node_id="d0", ended_unix_ms=NOW + 900)
    d = loads(ledger, fleet(reported_ms=NOW + 50), NOW + 950)["d0"].load
    assert d is not None and d.running_requests == 2


def test_a_finish_without_its_time_takes_nothing_out_and_the_count_never_goes_below_zero() -> None:
    ledger = InFlightLedger()
    _covered_run(ledger, "r1")
    ledger.finished("r1")
    d = loads(ledger, fleet(reported_ms=NOW + 700), NOW + 950)["d0"].load
    assert d is not None and d.running_requests == 2
    for route_id in ("r2", "r3", "r4"):
        _covered_run(ledger, route_id)
    # Three answers ended after a report that counted two running (a report can be wrong).
    for route_id in ("r2", "r3", "r4"):
        ledger.finished(route_id, decode_node_id="d0", ended_unix_ms=NOW + 900)
    d = loads(ledger, fleet(reported_ms=NOW + 700), NOW + 950)["d0"].load
    assert d is not None and d.running_requests == 0


def test_a_departure_older_than_the_age_limit_is_forgotten() -> None:
    ledger = InFlightLedger(max_age_ms=5_000)
    _covered_run(ledger, "r1")
    ledger.finished("r1", decode_node_id="d0", ended_unix_ms=NOW + 900)
    d = loads(ledger, fleet(reported_ms=NOW + 700), NOW + 6_000)["d0"].load
    assert d is not None and d.running_requests == 2


def test_departures_from_a_node_no_route_asks_about_are_swept_once_aged() -> None:
    ledger = InFlightLedger(max_age_ms=5_000)
    ledger.finished("gone-1", decode_node_id="d-gone", ended_unix_ms=NOW)
    # A thousand more finishes on other nodes, well after the age limit.
    for i in range(1100):
        ledger.finished(f"r{i}", decode_node_id="d0", ended_unix_ms=NOW + 60_000 + i)
    assert ledger.departures("d-gone") == 0
    assert ledger.departures("d0") > 0


def test_a_report_taken_once_the_request_reached_p_counts_the_turn_once(policy: RoutingPolicy) -> None:
    # Routing's default hop allowance: P's engine streams a report when a request arrives, a few
    # milliseconds after its route; from then on the report counts the turn and the ledger must not.
    delay = RoutingSection().send_delay_ms
    costs = replace(AFFINE, reused_ms_per_token=0.0)
    idle = [state(P0, reported_unix_ms=NOW), state(D0, free_kv_blocks=100_000, total_kv_blocks=100_000)]
    turn = snap(idle, prompt=Prompt(1000))
    plan = policy.route(turn, costs)
    ledger = InFlightLedger()
    ledger.add(
        *routed_work("r", turn, plan, costs, pulled=False, send_delay_ms=delay, decode_after_prefill=True)
    )
    alone = costs.prefill_ms(1000, 0)
    arrived = NOW + 40  # the request reached P 40 ms after its route, and P reported it
    report = [state(P0, queued_prefill_tokens=1000, queued_requests=1, reported_unix_ms=arrived)]
    p = ledger.current(report, arrived, costs=costs)[0]
    assert p.queued_prefill_ms == pytest.approx(alone)
