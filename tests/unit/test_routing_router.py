"""The Router on its own: no gRPC, no etcd. A fake cluster, check-out and clock stand in for the
watch-fed view, the store's fenced transaction and the system clock."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import pytest

import kvplane.services.routing.router as router_package
from kvplane.services.common.model.errors import HandleNotRetained, NotFound, StoreUnavailable
from kvplane.services.common.model.handles import KEY_REMOTE_KV_SOURCE, CacheHandle, KvTier
from kvplane.services.common.model.nodes import Node, NodeRole
from kvplane.services.common.model.suspects import NodeSuspect
from kvplane.services.common.store.records import CheckOut, HandleRecord, HandleReplaced
from kvplane.services.routing.policy import Decision, NodeState, Prompt, RoutingPolicy, load_policy
from kvplane.services.routing.policy.config import PolicyConfig
from kvplane.services.routing.policy.pull_decision import PullSettings, pull_could_pay
from kvplane.services.routing.router.ports import Clock, ClusterReader, HandleCheckOut
from kvplane.services.routing.router.router import NoRoute, Router
from kvplane.services.routing.router.turns import AwaitedHandle, TurnReport, TurnRequest
from kvplane.services.routing.settings import RoutingSection
from tests.unit.routing_policy_fixtures import MODEL, NOW, history, mk_handle, mk_load, mk_node

HISTORY = 4000


@dataclass
class FakeClock:
    now_ms: int = NOW
    monotonic: float = 100.0

    def unix_ms(self) -> int:
        return self.now_ms

    def monotonic_s(self) -> float:
        return self.monotonic


@dataclass
class FakeCluster:
    nodes: list[Node]
    handles: dict[tuple[str, str], HandleRecord] = field(default_factory=dict)
    suspects: Mapping[str, NodeSuspect] = field(default_factory=dict)
    healthy: bool = True
    # What a wait for a publish finds: the handle that lands meanwhile (None: nothing lands).
    lands: HandleRecord | None = None
    waits: list[float] = field(default_factory=list)
    # Reported load fields by node id (absent: idle).
    loads: dict[str, dict[str, int]] = field(default_factory=dict)

    def handle(self, tenant: str, conversation: str) -> HandleRecord | None:
        return self.handles.get((tenant, conversation))

    def node_states(self) -> tuple[NodeState, ...]:
        return tuple(NodeState(n, mk_load(n, **self.loads.get(n.node_id, {}))) for n in self.nodes)

    def node(self, node_id: str) -> Node | None:
        return next((n for n in self.nodes if n.node_id == node_id), None)

    def newest_report_unix_ms(self) -> int:
        return NOW

    async def await_handle(self, tenant: str, conversation: str, handle_id: str, wait_s: float) -> bool:
        self.waits.append(wait_s)
        if self.lands is None:
            return False
        self.handles[(tenant, conversation)] = self.lands
        return True


@dataclass
class FakeCheckOut:
    """Single use, as the store's: a handle is handed out once; `fails` makes every check-out fail."""

    fails: Exception | None = None
    calls: list[tuple[str, float]] = field(default_factory=list)
    taken: set[str] = field(default_factory=set)
    # Handles etcd has replaced, by id, with the one it retains now (a view behind etcd).
    replaced: dict[str, HandleRecord] = field(default_factory=dict)

    async def check_out(
        self, tenant: str, conversation: str, route_id: str, expected: HandleRecord, timeout_s: float
    ) -> CheckOut:
        self.calls.append((route_id, timeout_s))
        if self.fails is not None:
            raise self.fails
        if expected.handle.handle_id in self.replaced:
            raise HandleReplaced("replaced", self.replaced[expected.handle.handle_id])
        if expected.handle.handle_id in self.taken:
            raise HandleNotRetained("checked out already")
        self.taken.add(expected.handle.handle_id)
        return CheckOut(expected.handle, claim_id=route_id, revision=expected.mod_revision + 1)


def fleet() -> list[Node]:
    return [
        mk_node("p0", NodeRole.PREFILL),
        mk_node("p1", NodeRole.PREFILL),
        mk_node("d0", NodeRole.DECODE),
        mk_node("d1", NodeRole.DECODE),
    ]


def make_router(
    cluster: FakeCluster, checkout: FakeCheckOut | None = None, clock: FakeClock | None = None
) -> tuple[Router, FakeCheckOut, FakeClock]:
    checkout = checkout or FakeCheckOut()
    clock = clock or FakeClock()
    ids = iter(f"route-{i}" for i in range(1000))
    # The fakes stand in for the ports the service and the simulator implement.
    ports: tuple[ClusterReader, HandleCheckOut, Clock] = (cluster, checkout, clock)
    router = Router(
        RoutingPolicy(load_policy()),
        RoutingSection(),
        *ports,
        new_route_id=lambda: next(ids),
    )
    return router, checkout, clock


def held(cluster: FakeCluster, retained: list[int], conversation: str = "c") -> HandleRecord:
    """A handle of the conversation's history on d0, in the cluster's view."""
    handle: CacheHandle = replace(mk_handle(cluster.nodes[2], retained), conversation=conversation)
    record = HandleRecord(handle, mod_revision=7, lease=1)
    cluster.handles[("t", conversation)] = record
    return record


def turn(tokens: list[int], conversation: str = "c", **kw: object) -> TurnRequest:
    return TurnRequest("t", conversation, MODEL, Prompt(len(tokens), tokens), **kw)  # type: ignore[arg-type]


async def test_a_turn_whose_prefill_node_holds_the_history_is_routed_there() -> None:
    cluster = FakeCluster(fleet())
    router, _, clock = make_router(cluster)
    first = await router.route(turn(history(HISTORY)))
    # Both prefill nodes report the same idle load, and the first turn is long done: only the
    # record of what was sent tells them apart.
    for _ in range(3):
        clock.now_ms += 5_000
        nxt = await router.route(turn([*history(HISTORY), *history(200, seed=3)]))
        assert nxt.plan.prefill.node_id == first.plan.prefill.node_id
        assert nxt.plan.verdict.cached_tokens >= HISTORY - 16


async def test_a_conversation_without_a_handle_stays_on_the_decode_node_of_its_last_turn() -> None:
    # Nothing retained on D (P's cache holds the history): D's prefix cache still does, and
    # conversations that stay keep each D's admissions from piling up behind the other P's.
    cluster = FakeCluster(fleet())
    router, _, clock = make_router(cluster)
    first = {c: await router.route(turn(history(HISTORY, seed=i), c)) for i, c in enumerate(("a", "b"))}
    assert {o.plan.decode.node_id for o in first.values()} == {"d0", "d1"}
    for round_ in range(1, 4):
        clock.now_ms += 5_000
        for i, (c, outcome) in enumerate(first.items()):
            last = outcome.plan.decode.node_id
            # The last D reports a couple of requests more than the other: not enough to move.
            cluster.loads = {
                d: {"running_requests": 16 if d == last else 14, "total_kv_blocks": 16_384}
                | {"free_kv_blocks": 16_384 - 350 * (16 if d == last else 14)}
                for d in ("d0", "d1")
            }
            prompt = [*history(HISTORY, seed=i), *history(200 * round_, seed=50 + i)]
            assert (await router.route(turn(prompt, c))).plan.decode.node_id == last, c


async def test_a_pull_checks_the_handle_out_and_builds_the_prefill_params() -> None:
    cluster = FakeCluster(fleet())
    record = held(cluster, history(HISTORY))
    router, checkout, _ = make_router(cluster)
    outcome = await router.route(turn([*history(HISTORY), 1]))
    assert outcome.decision is Decision.PULL, outcome.reason
    assert outcome.handle == record.handle and outcome.reused_tokens == HISTORY
    assert checkout.calls == [(outcome.route_id, RoutingSection().checkout_timeout_s)]
    assert outcome.prefill_params["remote_engine_id"] == "e-d0"
    assert outcome.routed_unix_ms == NOW


async def test_a_pull_from_a_handle_in_vllm_cpu_tier_names_the_p2p_source_under_the_route_id() -> None:
    cluster = FakeCluster(fleet())
    record = held(cluster, history(HISTORY))
    source = {"remote_host": "10.0.0.5", "remote_port": 5700}
    vllm = replace(record.handle.vllm, remote_block_ids=(), extra={KEY_REMOTE_KV_SOURCE: source})
    cluster.handles[("t", "c")] = replace(record, handle=replace(record.handle, vllm=vllm, tier=KvTier.HOST))
    router, _, _ = make_router(cluster)
    outcome = await router.route(turn([*history(HISTORY), 1]))
    assert outcome.decision is Decision.PULL, outcome.reason
    params = outcome.prefill_params
    # No block of D's KV cache to read over NIXL; P's OffloadingConnector reads the copies by hash.
    assert params["remote_block_ids"] == [] and params["remote_num_tokens"] == HISTORY
    assert params[KEY_REMOTE_KV_SOURCE] == {**source, "kv_request_id": outcome.route_id}
    assert params["do_remote_decode"] is True and params["do_remote_prefill"] is False


async def test_a_turn_prefilled_on_its_holder_checks_nothing_out_and_leaves_the_prefill_record_alone() -> (
    None
):
    cluster = FakeCluster(fleet())
    router, checkout, clock = make_router(cluster)
    # The conversation's first turn went through P, and D kept its history.
    first = await router.route(turn(history(HISTORY - 200), "c"))
    assert first.decision is Decision.RECOMPUTE_NO_HANDLE
    home = first.plan.prefill.node_id
    record = held(cluster, history(HISTORY))
    costs = router.costs
    clock.now_ms += 1_000
    prompt = [*history(HISTORY), *history(150, seed=4)]
    outcome = await router.route(turn(prompt, "c", prefill_on_decode_ok=True))
    assert outcome.decision is Decision.PREFILL_ON_DECODE, outcome.reason
    assert outcome.plan.prefill.node_id == outcome.plan.decode.node_id == record.handle.holder_node_id
    # Nothing is read: no check-out, and D's params name no remote blocks, only whose turn it is.
    assert checkout.calls == [] and outcome.handle is None
    assert outcome.prefill_params == {
        "do_remote_prefill": False,
        "do_remote_decode": False,
        "kvplane_tenant": "t",
        "kvplane_conversation": "c",
    }
    assert outcome.reused_tokens == HISTORY
    # D keeps this turn (its publish supersedes the handle), and nothing is released for it.
    assert not outcome.skip_decode_retention and outcome.superseded is None
    # D's compute between its decode steps teaches the cost model nothing about P's.
    router.report(
        outcome.route_id,
        "t",
        "c",
        TurnReport(True, prompt_tokens=len(prompt), prefill_ms=900.0, ttft_ms=950.0),
    )
    assert router.costs == costs
    clock.now_ms += 1_000
    again = await router.route(turn([*prompt, *history(5000, seed=8)], "c"))
    # The prefill node that served the conversation is still its home, believed to hold what it
    # was sent: no prefill node was sent the turn D prefilled.
    assert again.plan.prefill.node_id == home
    assert HISTORY - 200 - 16 <= again.plan.verdict.cached_tokens <= HISTORY - 200


@pytest.mark.parametrize(
    ("failure", "reason"),
    [
        (HandleNotRetained("taken"), "another turn"),
        (NotFound("gone"), "another turn"),
        (StoreUnavailable("down"), "etcd unreachable"),
        (TimeoutError(), "etcd unreachable"),
    ],
)
async def test_a_failed_check_out_recomputes(failure: Exception, reason: str) -> None:
    cluster = FakeCluster(fleet())
    held(cluster, history(HISTORY))
    router, checkout, _ = make_router(cluster, FakeCheckOut(fails=failure))
    outcome = await router.route(turn([*history(HISTORY), 1]))
    assert outcome.decision is Decision.RECOMPUTE_CONTENDED and reason in outcome.reason
    assert outcome.handle is None and outcome.reused_tokens == 0
    assert outcome.prefill_params["remote_block_ids"] is None
    assert len(checkout.calls) == 1


async def test_a_check_out_that_finds_a_newer_handle_plans_again_on_it_and_pulls_it() -> None:
    # The view holds the handle of the turn before last; etcd holds the last turn's, published
    # while another replica carried that turn. The check-out's failure names it: one more plan,
    # one more check-out, and the turn pulls the history it would have recomputed.
    cluster = FakeCluster(fleet())
    stale = held(cluster, history(HISTORY))
    longer = [*history(HISTORY), *history(320, seed=5)]
    newer_handle = replace(mk_handle(cluster.nodes[2], longer), handle_id="h2")
    newer = HandleRecord(newer_handle, mod_revision=9, lease=1)
    router, checkout, _ = make_router(cluster, FakeCheckOut(replaced={stale.handle.handle_id: newer}))
    outcome = await router.route(turn([*longer, 1]))
    assert outcome.decision is Decision.PULL, outcome.reason
    assert outcome.handle == newer.handle and outcome.reused_tokens > HISTORY
    assert len(checkout.calls) == 2


async def test_a_newer_handle_that_does_not_cover_the_prompt_is_not_checked_out() -> None:
    # etcd's handle belongs to an edited history: planning again on it recomputes, and no second
    # check-out is tried.
    cluster = FakeCluster(fleet())
    stale = held(cluster, history(HISTORY))
    other = replace(mk_handle(cluster.nodes[2], history(HISTORY, seed=77)), handle_id="h2")
    router, checkout, _ = make_router(
        cluster, FakeCheckOut(replaced={stale.handle.handle_id: HandleRecord(other, 9, 1)})
    )
    outcome = await router.route(turn([*history(HISTORY), 1]))
    assert not outcome.decision.pulls and outcome.handle is None, outcome
    assert len(checkout.calls) == 1


async def test_the_second_check_out_of_the_same_handle_recomputes() -> None:
    cluster = FakeCluster(fleet())
    held(cluster, history(HISTORY))
    router, _, _ = make_router(cluster)
    prompt = [*history(HISTORY), 1]
    first = await router.route(turn(prompt))
    second = await router.route(turn(prompt))
    assert first.decision is Decision.PULL
    # Now P's prefix cache is believed to hold the history: no pull is worth it, or it loses the race.
    assert second.handle is None


async def test_no_check_out_without_a_live_view_or_time_left_in_the_deadline() -> None:
    cluster = FakeCluster(fleet(), healthy=False)
    held(cluster, history(HISTORY))
    router, checkout, _ = make_router(cluster)
    cut_off = await router.route(turn([*history(HISTORY), 1]))
    assert cut_off.decision is Decision.RECOMPUTE_CONTENDED and "etcd unreachable" in cut_off.reason
    cluster.healthy = True
    rushed = await router.route(turn([*history(HISTORY), 1], "other", time_budget_s=0.001))
    assert rushed.decision is not Decision.PULL
    held(cluster, history(HISTORY), "late")
    rushed = await router.route(turn([*history(HISTORY), 1], "late", time_budget_s=0.001))
    assert rushed.decision is Decision.RECOMPUTE_CONTENDED and "deadline" in rushed.reason
    assert checkout.calls == []


async def test_a_turn_awaiting_its_handle_waits_for_its_publish_within_the_budget() -> None:
    cluster = FakeCluster(fleet())
    handle = mk_handle(cluster.nodes[2], history(HISTORY))
    cluster.lands = HandleRecord(handle, mod_revision=3, lease=1)
    router, _, _ = make_router(cluster)
    outcome = await router.route(
        turn([*history(HISTORY), 1], time_budget_s=0.2, awaited=AwaitedHandle(handle.handle_id, HISTORY))
    )
    assert cluster.waits == [pytest.approx(0.1)]
    assert outcome.decision is Decision.PULL and outcome.handle == handle


async def test_a_report_of_its_route_teaches_the_cost_model_once() -> None:
    cluster = FakeCluster(fleet())
    router, _, _ = make_router(cluster)
    prior = router.costs
    outcome = await router.route(turn(history(HISTORY)))
    report = TurnReport(success=True, prompt_tokens=HISTORY, cached_tokens=0, prefill_ms=900.0)
    # Another conversation's report of the route teaches nothing.
    assert router.report(outcome.route_id, "t", "someone-else", report) is not None
    assert router.costs == prior
    again = await router.route(turn(history(HISTORY, seed=5), "c2"))
    record = router.report(again.route_id, "t", "c2", report)
    assert record is not None and record.prefill_node_id == again.plan.prefill.node_id
    assert router.costs.prefill_samples == prior.prefill_samples + 1
    assert router.costs.prefill_fixed_ms != prior.prefill_fixed_ms
    # Reported twice, or never routed here: no second lesson.
    learned = router.costs
    assert router.report(again.route_id, "t", "c2", report) is None
    assert router.report("unknown", "t", "c2", report) is None
    assert router.costs == learned


async def test_failed_and_suspect_nodes_are_left_out_unless_nothing_else_could_serve() -> None:
    cluster = FakeCluster(fleet())
    router, _, _ = make_router(cluster)
    outcome = await router.route(turn(history(100), failed_node_ids=frozenset({"p0", "d0"})))
    assert (outcome.plan.prefill.node_id, outcome.plan.decode.node_id) == ("p1", "d1")
    only = await router.route(turn(history(100), failed_node_ids=frozenset({"p0", "p1"})))
    assert only.plan.prefill.node_id in ("p0", "p1")


async def test_a_model_nobody_serves_is_not_found_and_no_node_is_no_route() -> None:
    router, _, _ = make_router(FakeCluster(fleet()))
    with pytest.raises(NotFound):
        await router.route(TurnRequest("t", "c", "other-model", Prompt(10)))
    empty, _, _ = make_router(FakeCluster([]))
    with pytest.raises(NoRoute):
        await empty.route(turn(history(10)))


async def test_time_comes_from_the_injected_clock() -> None:
    clock = FakeClock(now_ms=NOW + 60_000)
    router, _, _ = make_router(FakeCluster(fleet()), clock=clock)
    outcome = await router.route(turn(history(100)))
    assert outcome.routed_unix_ms == NOW + 60_000


def test_the_package_exports_the_router_its_ports_and_its_values() -> None:
    exported = {name: getattr(router_package, name) for name in router_package.__all__}
    assert exported["Router"] is Router and exported["NoRoute"] is NoRoute
    assert exported["TurnRequest"] is TurnRequest and exported["TurnReport"] is TurnReport
    assert {"Clock", "ClusterReader", "HandleCheckOut", "AwaitedHandle", "RouteOutcome"} <= exported.keys()


async def test_conversations_that_start_on_an_idle_fleet_split_evenly_across_the_prefill_nodes() -> None:
    # Every first turn finds both prefill nodes idle and holding nothing: equal costs. Each goes
    # to the node fewer conversations were last routed to, so 12 split 6 and 6 (a hash of the
    # conversation alone splits these 12 eight and four).
    cluster = FakeCluster(fleet())
    router, _, clock = make_router(cluster)
    served: Counter[str] = Counter()
    for i in range(12):
        outcome = await router.route(turn(history(HISTORY, seed=100 + i), f"c-{i}"))
        served[outcome.plan.prefill.node_id] += 1
        clock.now_ms += 60_000  # the turn is long done: no queue tells the nodes apart
    assert sorted(served.values()) == [6, 6]
    # A conversation that is forgotten no longer counts for its node.
    router.forget("t", "c-0")
    assert sum(router._book.homes(clock.monotonic_s(), ("t", "nobody")).values()) == 11


async def test_conversations_count_toward_a_prefill_nodes_load_only_while_active() -> None:
    cluster = FakeCluster(fleet())
    router, _, clock = make_router(cluster)
    for i in range(2):
        await router.route(turn(history(HISTORY, seed=100 + i), f"c-{i}"))
    assert sum(router._book.homes(clock.monotonic_s(), ("t", "nobody")).values()) == 2
    # A minute without a turn (routing.active_conversation_s): neither is load any more.
    clock.monotonic += 60.0
    clock.now_ms += 60_000
    outcome = await router.route(turn(history(HISTORY, seed=102), "c-2"))
    homes = router._book.homes(clock.monotonic_s(), ("t", "nobody"))
    assert dict(homes) == {outcome.plan.prefill.node_id: 1}


@dataclass
class FakeViews:
    """Engine views that show a fixed prefix per node, and record which nodes they were asked of."""

    held: dict[str, int]
    asked: list[list[str]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.held)

    def prefix_tokens(
        self, nodes: object, prompt: Prompt, cache_salt: str | None, now_s: float, conversation: object = None
    ) -> Mapping[str, int]:
        ids = [node_id for node_id, _ in nodes]  # type: ignore[attr-defined]
        self.asked.append(ids)
        return {i: min(self.held[i], prompt.tokens - 1) for i in ids if i in self.held}

    def forget_conversation(self, conversation: object) -> None:
        return None


def viewing_router(views: FakeViews, config: PolicyConfig | None = None) -> Router:
    """A router over `fleet()` whose engine views are `views`."""
    ids = iter(f"route-{i}" for i in range(10))
    return Router(
        RoutingPolicy(config or load_policy()),
        RoutingSection(),
        FakeCluster(fleet()),
        FakeCheckOut(),
        FakeClock(),
        new_route_id=lambda: next(ids),
        engine_caches=views,
    )


async def test_a_decode_node_whose_events_show_the_history_prefills_only_for_a_caller_that_can() -> None:
    views = FakeViews({"d1": HISTORY})
    router = viewing_router(views)
    prompt = [*history(HISTORY), *history(150, seed=4)]
    # No handle: the conversation's last one was released, its blocks still in d1's cache.
    through_p = await router.route(turn(prompt, "c"))
    assert through_p.decision is not Decision.PREFILL_ON_DECODE
    # Only prefill nodes' views are asked for a caller that cannot run a turn on D alone.
    assert views.asked == [["p0", "p1"]]
    on_d = await router.route(turn(prompt, "c2", prefill_on_decode_ok=True))
    assert on_d.decision is Decision.PREFILL_ON_DECODE, on_d.reason
    assert on_d.plan.prefill.node_id == on_d.plan.decode.node_id == "d1"
    assert views.asked[1:] == [["p0", "p1"], ["d0", "d1"]]
    assert on_d.reused_tokens == HISTORY and on_d.handle is None
    assert on_d.prefill_params["do_remote_prefill"] is False


def awaiting_d0s_handle() -> tuple[FakeCluster, Router, CacheHandle]:
    """A router whose p0, as its events show, holds conversation c's history but its last answer,
    a few tokens past the pull threshold; and d0's handle of the whole history, which lands in
    the view when a turn waits for it."""
    cluster = FakeCluster(fleet())
    handle = replace(mk_handle(cluster.nodes[2], history(HISTORY)), conversation="c")
    cluster.lands = HandleRecord(handle, mod_revision=3, lease=1)
    ids = iter(f"route-{i}" for i in range(10))
    router = Router(
        RoutingPolicy(load_policy()),
        RoutingSection(),
        cluster,
        FakeCheckOut(),
        FakeClock(),
        new_route_id=lambda: next(ids),
        engine_caches=FakeViews({"p0": HISTORY - PullSettings().threshold_tokens - 16}),
    )
    return cluster, router, handle


async def test_a_turn_its_decode_node_could_prefill_from_the_awaited_handle_waits_though_no_pull_pays() -> (
    None
):
    # p0's events show it holding the history but the last answer, too few tokens for a pull to
    # pay: through P, the turn would not use the handle. Its holder, idle, could prefill the
    # turn itself from it, and so the turn waits for its publish, for a caller that can send it
    # to D alone.
    cluster, router, handle = awaiting_d0s_handle()
    answer = PullSettings().threshold_tokens + 16
    assert not pull_could_pay(answer, cluster.nodes[2].kv_bytes_per_token, router.costs, PullSettings())
    prompt = [*history(HISTORY), *history(150, seed=4)]
    awaited = AwaitedHandle(handle.handle_id, HISTORY)
    through_p = await router.route(turn(prompt, "c", awaited=awaited))
    assert cluster.waits == [] and through_p.plan.prefill.node_id == "p0"
    on_d = await router.route(turn(prompt, "c", awaited=awaited, prefill_on_decode_ok=True))
    assert len(cluster.waits) == 1
    assert on_d.decision is Decision.PREFILL_ON_DECODE, on_d.reason
    assert on_d.plan.prefill.node_id == on_d.plan.decode.node_id == "d0"
    assert on_d.reused_tokens == HISTORY


async def test_a_decode_node_that_reported_idle_but_was_routed_a_turn_since_does_not_make_the_turn_wait() -> (
    None
):
    # As above, but both decode nodes were sent a turn after their last (idle) report: routing
    # counts them busy, no D would prefill a turn that spares P so little, and the turn goes on.
    cluster, router, handle = awaiting_d0s_handle()
    others = [await router.route(turn(history(2000, seed=20 + i), f"other-{i}")) for i in range(2)]
    assert {o.plan.decode.node_id for o in others} == {"d0", "d1"}
    prompt = [*history(HISTORY), *history(150, seed=4)]
    outcome = await router.route(
        turn(prompt, "c", awaited=AwaitedHandle(handle.handle_id, HISTORY), prefill_on_decode_ok=True)
    )
    assert cluster.waits == [] and outcome.decision is not Decision.PREFILL_ON_DECODE, outcome.reason


async def test_with_prefill_from_decode_caches_off_no_route_hashes_for_them() -> None:
    views = FakeViews({"d1": HISTORY})
    config = load_policy()
    off = replace(config, prefill_on_decode=replace(config.prefill_on_decode, from_decode_cache=False))
    router = viewing_router(views, off)
    prompt = [*history(HISTORY), *history(150, seed=4)]
    outcome = await router.route(turn(prompt, "c", prefill_on_decode_ok=True))
    assert outcome.decision is not Decision.PREFILL_ON_DECODE
    assert views.asked == [["p0", "p1"]]


@pytest.mark.parametrize("says_when", [True, False])
async def test_a_reported_end_takes_the_answer_out_of_ds_older_load_report(says_when: bool) -> None:
    # The conversation's first turn ran on d0 (its handle's holder); d0's last load report, taken
    # after the turn reached it, counts that answer and one other as running when its report
    # arrives.
    cluster = FakeCluster(fleet())
    router, _, clock = make_router(cluster)
    first = await router.route(turn(history(HISTORY - 200), "c"))
    holder = first.plan.decode.node_id
    handle = replace(mk_handle(first.plan.decode, history(HISTORY)), conversation="c")
    cluster.handles[("t", "c")] = HandleRecord(handle, mod_revision=7, lease=1)
    clock.now_ms += 1_000
    cluster.loads[holder] = {"running_requests": 2, "reported_unix_ms": clock.now_ms - 10}
    ended = clock.now_ms - 5 if says_when else None
    router.report(
        first.route_id, "t", "c", TurnReport(True, prompt_tokens=HISTORY - 200, ended_unix_ms=ended)
    )
    # Its next turn saves more on D than its prefill there holds up the one other answer, not
    # two: D prefills it itself only when the answer that ended is known to have.
    prompt = [*history(HISTORY), *history(150, seed=4)]
    outcome = await router.route(turn(prompt, "c", prefill_on_decode_ok=True))
    assert (outcome.decision is Decision.PREFILL_ON_DECODE) is says_when, outcome.reason


async def test_ps_own_measure_of_the_wait_is_what_the_cost_model_takes_off() -> None:
    """A report with P's measured wait teaches the leg less that wait; one without, the leg less
    the queue routing expected when it routed the turn."""
    from kvplane.services.routing.policy.cost_model import TurnObservation

    cluster = FakeCluster(fleet())
    router, _, _ = make_router(cluster)
    # Turns at once: the later ones are routed behind the earlier ones' prefills.
    outcomes = [await router.route(turn(history(HISTORY, seed=i), f"c{i}")) for i in range(4)]
    measured = TurnReport(
        success=True, prompt_tokens=HISTORY, cached_tokens=0, prefill_ms=900.0, prefill_queued_ms=12.5
    )
    for outcome, conversation, report in (
        (outcomes[3], "c3", measured),
        (outcomes[2], "c2", replace(measured, prefill_queued_ms=None)),
    ):
        before = router.costs
        record = router.report(outcome.route_id, "t", conversation, report)
        assert record is not None and record.queued_ms > 0
        wait = record.queued_ms if report.prefill_queued_ms is None else report.prefill_queued_ms
        leg = TurnObservation(
            prompt_tokens=HISTORY,
            cached_tokens=0,
            prefill_ms=900.0,
            kv_bytes_per_token=record.kv_bytes_per_token,
            first_contact=record.first_contact,
            queued_ms=wait,
            queued_measured=report.prefill_queued_ms is not None,
        )
        assert router.costs == before.observe(leg)
        # And not what the other wait would have taught.
        assert router.costs != before.observe(replace(leg, queued_ms=record.queued_ms + 12.5 - wait))
