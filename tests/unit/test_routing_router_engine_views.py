"""The Router with prefill engines' own views of their caches: fresh, they replace its record;
stale or missing, the record decides."""

from __future__ import annotations

from kvplane.services.common.model.block_hashes import BlockHasher
from kvplane.services.routing.policy import RoutingPolicy, load_policy
from kvplane.services.routing.router.router import Router
from kvplane.services.routing.settings import RoutingSection
from kvplane.services.routing.state.engine_caches import CacheUpdate, EngineCaches, HashConfig
from tests.unit.routing_policy_fixtures import history
from tests.unit.test_routing_router import HISTORY, FakeCheckOut, FakeClock, FakeCluster, fleet, turn

CONFIG = HashConfig(16, "sha256", "vllm-none-hash")


def router_with_views(stale_after_s: float = 2.0) -> tuple[Router, FakeClock, EngineCaches]:
    clock = FakeClock()
    caches = EngineCaches(stale_after_s=stale_after_s)
    ids = iter(f"route-{i}" for i in range(1000))
    router = Router(
        RoutingPolicy(load_policy()),
        RoutingSection(),
        FakeCluster(fleet()),
        FakeCheckOut(),
        clock,
        new_route_id=lambda: next(ids),
        engine_caches=caches,
    )
    return router, clock, caches


def view(caches: EngineCaches, node_id: str, ids: list[int], now_s: float) -> None:
    caches.apply(CacheUpdate(node_id, f"{node_id}-inc", CONFIG, True, ids), now_s)


async def test_a_fresh_engine_view_replaces_the_record_of_what_was_sent() -> None:
    router, clock, caches = router_with_views()
    prompt = history(HISTORY)
    first = await router.route(turn(prompt))
    home = first.plan.prefill.node_id
    other = "p1" if home == "p0" else "p0"
    # The record believes `home` holds the history; its engine evicted it, the other's holds it.
    view(caches, home, [], clock.monotonic)
    view(caches, other, BlockHasher(16).ids(prompt), clock.monotonic)
    clock.now_ms += 5_000
    nxt = await router.route(turn([*prompt, *history(200, seed=3)]))
    assert nxt.plan.prefill.node_id == other
    assert nxt.plan.verdict.cached_tokens >= HISTORY - 16


async def test_a_stale_engine_view_falls_back_to_the_record() -> None:
    router, clock, caches = router_with_views(stale_after_s=2.0)
    prompt = history(HISTORY)
    first = await router.route(turn(prompt))
    home = first.plan.prefill.node_id
    other = "p1" if home == "p0" else "p0"
    view(caches, home, [], clock.monotonic)
    view(caches, other, BlockHasher(16).ids(prompt), clock.monotonic)
    # The nodes' streams went quiet past the bound: what they said no longer counts.
    clock.monotonic += 2.5
    clock.now_ms += 5_000
    nxt = await router.route(turn([*prompt, *history(200, seed=3)]))
    assert nxt.plan.prefill.node_id == home


async def test_blocks_of_another_salt_are_not_the_prompt_s_prefix() -> None:
    router, clock, caches = router_with_views()
    prompt = history(HISTORY)
    view(caches, "p0", [], clock.monotonic)
    view(caches, "p1", BlockHasher(16).ids(prompt, "tenant-a"), clock.monotonic)
    salted = await router.route(turn(prompt, conversation="c1", cache_salt="tenant-a"))
    assert salted.plan.prefill.node_id == "p1"
    assert salted.plan.verdict.cached_tokens >= HISTORY - 16
    other = await router.route(turn(prompt, conversation="c2", cache_salt="tenant-b"))
    assert other.plan.verdict.cached_tokens == 0
