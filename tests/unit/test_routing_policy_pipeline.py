"""The composed policy: leg choice, fingerprint pools, determinism, configuration."""

from __future__ import annotations

import pytest

from kvplane.services.common.model.nodes import Fingerprint, NodeRole
from kvplane.services.routing.policy import (
    Decision,
    NoEligibleNodes,
    PolicyConfigError,
    Prompt,
    load_policy,
    policy_from_mapping,
    policy_from_yaml,
)
from kvplane.services.routing.policy.pipeline import RoutingPolicy, live_holder
from tests.unit.routing_policy_fixtures import NOW, history, mk_handle, mk_node, snap, state

FP8 = Fingerprint("m", "fp8_e4m3", "NHD")
H = history(4096)
PROMPT = Prompt(4100, [*H, 1, 2, 3, 4])


@pytest.fixture(scope="module")
def policy() -> RoutingPolicy:
    return RoutingPolicy(load_policy())


def test_holder_is_chosen_as_decode_when_it_has_room(policy: RoutingPolicy) -> None:
    d0, d1 = mk_node("d0"), mk_node("d1")
    nodes = [
        state(mk_node("p0", NodeRole.PREFILL)),
        state(d0, running_requests=30, free_kv_blocks=5000, total_kv_blocks=10_000),
        state(d1, running_requests=0, free_kv_blocks=10_000, total_kv_blocks=10_000),
    ]
    plan = policy.route(snap(nodes, handle=mk_handle(d0, H), prompt=PROMPT))
    assert plan.decode.node_id == "d0" and plan.decision is Decision.PULL
    full = [*nodes[:1], state(d0, free_kv_blocks=3, total_kv_blocks=10_000), nodes[2]]
    assert policy.route(snap(full, handle=mk_handle(d0, H), prompt=PROMPT)).decode.node_id == "d1"


def test_a_decode_node_whose_free_blocks_waiting_requests_need_is_not_taken_for_a_roomy_one(
    policy: RoutingPolicy,
) -> None:
    # d0 shows more free blocks, but requests waiting there for memory need most of them: they
    # are admitted before the new turn, which would wait behind them while d1 has room now.
    d0, d1 = mk_node("d0"), mk_node("d1")
    kv = {"total_kv_blocks": 16_384, "running_requests": 8}
    p0 = state(mk_node("p0", NodeRole.PREFILL))

    def decode(d0_waiting_blocks: int) -> str:
        nodes = [
            p0,
            state(d0, free_kv_blocks=12_000, waiting_kv_blocks=d0_waiting_blocks, **kv),
            state(d1, free_kv_blocks=4_000, **kv),
        ]
        return policy.route(snap(nodes, prompt=PROMPT)).decode.node_id

    assert decode(0) == "d0"
    assert decode(11_000) == "d1"


def test_without_a_handle_a_conversation_stays_on_its_last_decode_node_until_another_is_clearly_lighter(
    policy: RoutingPolicy,
) -> None:
    # D's prefix cache still holds the last turn's blocks, so staying reads only the new suffix
    # from P; a D that moves every turn reads the whole history and queues behind the other
    # P's turns.
    d0, d1 = mk_node("d0"), mk_node("d1")
    kv = {"total_kv_blocks": 16_384}
    p0 = state(mk_node("p0", NodeRole.PREFILL))

    def decode(last: str, d0_running: int, d1_running: int) -> str:
        nodes = [
            p0,
            state(d0, running_requests=d0_running, free_kv_blocks=16_384 - 350 * d0_running, **kv),
            state(d1, running_requests=d1_running, free_kv_blocks=16_384 - 350 * d1_running, **kv),
        ]
        return policy.route(snap(nodes, prompt=PROMPT, last_decode_node_id=last)).decode.node_id

    # One or two requests more on the last D: the conversation stays.
    for last, other in (("d0", "d1"), ("d1", "d0")):
        running = {last: 16, other: 14}
        assert decode(last, running["d0"], running["d1"]) == last
    # A clearly lighter D wins it.
    assert decode("d0", 24, 8) == "d1"
    # A first turn goes to the lighter D.
    assert decode("", 16, 15) == "d1"


def test_prefill_where_the_turn_costs_least_wins_its_cache_against_a_short_queue(
    policy: RoutingPolicy,
) -> None:
    nodes = [
        state(mk_node("p0", NodeRole.PREFILL), queued_prefill_tokens=50_000),
        state(mk_node("p1", NodeRole.PREFILL), queued_prefill_tokens=0),
        state(mk_node("p2", NodeRole.PREFILL), queued_prefill_tokens=0),
        state(mk_node("d0")),
    ]
    prompt = Prompt(4100)
    assert (
        policy.route(snap(nodes, prompt=prompt, prefill_cached_tokens={"p2": 4000})).prefill.node_id == "p2"
    )
    assert (
        policy.route(snap(nodes, prompt=prompt, prefill_cached_tokens={"p1": 4000})).prefill.node_id == "p1"
    )
    # 50k queued tokens cost more than the 4k the cache would save.
    assert (
        policy.route(snap(nodes, prompt=prompt, prefill_cached_tokens={"p0": 4000})).prefill.node_id != "p0"
    )
    assert policy.route(snap(nodes, prompt=prompt)).prefill.node_id != "p0"


def test_holder_pool_is_used_even_when_another_pool_is_idle(policy: RoutingPolicy) -> None:
    d0 = mk_node("d0")
    nodes = [
        state(mk_node("p0", NodeRole.PREFILL), queued_prefill_tokens=100_000),
        state(d0, running_requests=100, free_kv_blocks=5000, total_kv_blocks=10_000),
        state(mk_node("p8", NodeRole.PREFILL, fingerprint=FP8)),
        state(mk_node("d8", fingerprint=FP8), free_kv_blocks=10_000, total_kv_blocks=10_000),
    ]
    plan = policy.route(snap(nodes, handle=mk_handle(d0, H), prompt=PROMPT))
    assert (plan.prefill.node_id, plan.decode.node_id) == ("p0", "d0")


def test_prefill_and_decode_always_share_a_fingerprint(policy: RoutingPolicy) -> None:
    nodes = [
        state(mk_node("p0", NodeRole.PREFILL), queued_prefill_tokens=0),
        state(mk_node("d8", fingerprint=FP8), free_kv_blocks=10_000, total_kv_blocks=10_000),
        state(mk_node("d0"), running_requests=100),
    ]
    plan = policy.route(snap(nodes))
    assert (plan.prefill.node_id, plan.decode.node_id) == ("p0", "d0")


def test_holder_without_a_compatible_prefill_recomputes_holder_down(policy: RoutingPolicy) -> None:
    d8 = mk_node("d8", fingerprint=FP8)
    nodes = [state(mk_node("p0", NodeRole.PREFILL)), state(mk_node("d0")), state(d8)]
    plan = policy.route(snap(nodes, handle=mk_handle(d8, H), prompt=PROMPT))
    assert plan.decision is Decision.RECOMPUTE_HOLDER_DOWN
    assert plan.decode.fingerprint == plan.prefill.fingerprint


@pytest.mark.parametrize(
    ("nodes", "why"),
    [
        ([], "no nodes"),
        ([state(mk_node("d0"))], "no prefill"),
        ([state(mk_node("p0", NodeRole.PREFILL))], "no decode"),
        (
            [state(mk_node("p0", NodeRole.PREFILL, fingerprint=FP8)), state(mk_node("d0"))],
            "no shared fingerprint",
        ),
        (
            [state(mk_node("p0", NodeRole.PREFILL)), state(mk_node("d0", role=NodeRole.PREFILL))],
            "two prefills",
        ),
    ],
)
def test_no_pair_raises(policy: RoutingPolicy, nodes: list[object], why: str) -> None:
    with pytest.raises(NoEligibleNodes):
        policy.route(snap(nodes))  # type: ignore[arg-type]


def test_soft_filters_give_way_rather_than_fail_the_turn(policy: RoutingPolicy) -> None:
    # Every load report is old (the metadata service was down) and one decode drains.
    stale = {"reported_unix_ms": NOW - 600_000}
    nodes = [
        state(mk_node("p0", NodeRole.PREFILL), **stale),
        state(mk_node("d0", draining=True), **stale),
    ]
    plan = policy.route(snap(nodes))
    assert (plan.prefill.node_id, plan.decode.node_id) == ("p0", "d0")
    # While one fresh, undrained pair exists, it is preferred.
    fresh = [*nodes, state(mk_node("p1", NodeRole.PREFILL)), state(mk_node("d1"))]
    plan = policy.route(snap(fresh))
    assert (plan.prefill.node_id, plan.decode.node_id) == ("p1", "d1")


def test_a_both_role_node_serves_both_legs(policy: RoutingPolicy) -> None:
    plan = policy.route(snap([state(mk_node("b0", NodeRole.BOTH))]))
    assert plan.prefill.node_id == plan.decode.node_id == "b0"


def test_draining_holder_recomputes_holder_down(policy: RoutingPolicy) -> None:
    d0 = mk_node("d0", draining=True)
    nodes = [state(mk_node("p0", NodeRole.PREFILL)), state(d0), state(mk_node("d1"))]
    plan = policy.route(snap(nodes, handle=mk_handle(d0, H), prompt=PROMPT))
    assert plan.decision is Decision.RECOMPUTE_HOLDER_DOWN and plan.decode.node_id == "d1"


def test_route_is_deterministic(policy: RoutingPolicy) -> None:
    nodes = [state(mk_node(f"p{i}", NodeRole.PREFILL)) for i in range(4)] + [
        state(mk_node(f"d{i}")) for i in range(4)
    ]
    s = snap(nodes, conversation="same")
    assert len({(policy.route(s).prefill.node_id, policy.route(s).decode.node_id) for _ in range(10)}) == 1


def test_config_from_yaml_composes_plugins_by_name() -> None:
    config = policy_from_yaml(
        """
decode:
  filters: [role]
  scorers: [{name: free-kv, weight: 2}]
prefill:
  filters: [role, {name: live, params: {max_load_age_ms: 5}}]
  scorers: [queued-prefill]
  picker: max-score
pull: {threshold_tokens: 128}
cost_model: {recompute_ms_per_token: 0.05}
"""
    )
    assert [f.name for f in config.prefill.filters] == ["role", "live"]
    assert config.decode.scorers[0].weight == 2.0
    assert config.pull.threshold_tokens == 128
    assert config.cost_model.recompute_ms_per_token == 0.05


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"decode": {"filters": ["nope"]}, "prefill": {}}, "unknown filter"),
        ({"decode": {"scorers": [{"name": "free-kv", "params": {"bogus": 1}}]}, "prefill": {}}, "bogus"),
        ({"decode": {"scorers": [{"name": "free-kv", "weight": -1}]}, "prefill": {}}, "weight"),
        ({"decode": {}, "prefill": {}, "pull": {"threshold": 3}}, "threshold"),
        ({"decode": {}}, "prefill"),
        ({"decode": {}, "prefill": {}, "extra": {}}, "extra"),
        ({"decode": {"scorers": [{"name": "running-load", "params": {"scale": 0}}]}, "prefill": {}}, "scale"),
    ],
)
def test_bad_config_is_rejected_with_a_message(raw: dict[str, object], message: str) -> None:
    with pytest.raises(PolicyConfigError, match=message):
        policy_from_mapping(raw)


def test_the_live_holder_is_the_handles_holder_in_the_life_it_was_made_in() -> None:
    d0 = mk_node("d0")
    handle = mk_handle(d0, H)
    assert live_holder(snap([state(mk_node("d1")), state(d0)], handle=handle)) == d0
    assert live_holder(snap([state(d0)])) is None, "no handle, no holder"
    assert live_holder(snap([state(mk_node("d1"))], handle=handle)) is None, "the holder is gone"


@pytest.mark.parametrize(
    ("holder", "why"),
    [
        (mk_node("d0", incarnation="restarted"), "restarted since: its blocks are gone"),
        (mk_node("d0", draining=True), "draining"),
        (mk_node("d0", role=NodeRole.PREFILL), "cannot decode, so cannot be the decode leg that reuses them"),
    ],
)
def test_a_holder_that_cannot_serve_its_handle_is_not_live(holder: object, why: str) -> None:
    handle = mk_handle(mk_node("d0"), H)
    assert live_holder(snap([state(holder)], handle=handle)) is None, why  # type: ignore[arg-type]
