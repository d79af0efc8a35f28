"""Prefill on decode: the holder D computes a short turn itself, only when it may and it pays."""

from __future__ import annotations

import re
from typing import Any

import pytest

from kvplane.services.common.model.nodes import NodeRole
from kvplane.services.routing.policy import (
    Decision,
    PolicyConfigError,
    Prompt,
    load_policy,
    policy_from_mapping,
)
from kvplane.services.routing.policy.config import PolicyConfig
from kvplane.services.routing.policy.decode_prefill import (
    PrefillOnDecodeSettings,
    handle_could_serve_on_decode,
)
from kvplane.services.routing.policy.pipeline import RoutingPolicy
from kvplane.services.routing.policy.snapshot import NodeState
from tests.unit.routing_policy_fixtures import NOW, history, mk_handle, mk_node, replace, snap, state

H = history(4096)
P0, D0, D1 = mk_node("p0", NodeRole.PREFILL), mk_node("d0"), mk_node("d1")
ROOM = {"free_kv_blocks": 10_000, "total_kv_blocks": 10_000}
# A decode node streaming other answers: a prefill there holds them up.
STREAMING = {**ROOM, "running_requests": 4}


def route(prompt: Prompt, *, ok: bool = True, config: PolicyConfig | None = None, **kw: Any) -> Any:
    nodes = kw.pop("nodes", None) or [state(P0), state(D0, **ROOM), state(D1, **ROOM)]
    handle = kw.pop("handle", None) or mk_handle(D0, H)
    snapshot = snap(nodes, handle=handle, prompt=prompt, prefill_on_decode_ok=ok, **kw)
    return RoutingPolicy(config or load_policy()).route(snapshot)


def added(n: int) -> Prompt:
    ids = [*H, *history(n, seed=7)]
    return Prompt(len(ids), ids)


def test_the_holder_prefills_a_short_addition_itself() -> None:
    plan = route(added(200))
    assert plan.decision is Decision.PREFILL_ON_DECODE
    # D is both legs: nothing reaches P, and the handle's tokens are D's own cache.
    assert plan.prefill.node_id == plan.decode.node_id == "d0"
    assert plan.verdict.reusable_tokens == 4096
    assert plan.verdict.pulled_tokens == 0
    assert "prefills the 200 new ones itself" in plan.verdict.reason


def test_never_unless_the_caller_can_run_a_turn_on_d_alone() -> None:
    plan = route(added(200), ok=False)
    assert plan.decision is Decision.PULL
    assert plan.prefill.node_id == "p0"


def test_an_addition_over_the_cap_goes_through_p() -> None:
    assert route(added(1200)).decision is Decision.PULL
    raised = replace(load_policy(), prefill_on_decode=PrefillOnDecodeSettings(max_new_tokens=2000))
    assert route(added(1200), config=raised).decision is Decision.PREFILL_ON_DECODE
    off = replace(load_policy(), prefill_on_decode=PrefillOnDecodeSettings(max_new_tokens=0))
    assert route(added(10), config=off).decision is Decision.PULL


def test_a_prompt_that_does_not_continue_the_handle_goes_through_p() -> None:
    edited = [*H[:2000], *history(2296, seed=9)]
    plan = route(Prompt(len(edited), edited))
    assert plan.decision is not Decision.PREFILL_ON_DECODE
    assert plan.prefill.node_id == "p0"


def test_a_holder_with_prefills_queued_goes_through_an_idle_p() -> None:
    busy = state(D0, queued_requests=12, queued_prefill_tokens=60_000, **ROOM)
    plan = route(added(200), nodes=[state(P0), busy, state(D1, **ROOM)])
    assert plan.decision is not Decision.PREFILL_ON_DECODE
    assert plan.prefill.node_id == "p0"


def test_a_handle_about_to_expire_goes_through_p() -> None:
    plan = route(added(200), handle=mk_handle(D0, H, life_ms=3_000))
    assert plan.decision is not Decision.PREFILL_ON_DECODE


def test_only_where_the_decode_leg_chose_the_holder() -> None:
    full = state(D0, free_kv_blocks=3, total_kv_blocks=10_000)
    plan = route(added(200), nodes=[state(P0), full, state(D1, **ROOM)])
    assert plan.decode.node_id == "d1"
    assert plan.decision is Decision.PULL


def test_the_policy_file_sets_it_and_refuses_nonsense() -> None:
    assert load_policy().prefill_on_decode == PrefillOnDecodeSettings(
        max_new_tokens=1000,
        expiry_margin_ms=5000,
        min_history_per_new_token=1.0,
        from_decode_cache=True,
        idle_decode_skips_history_rule=True,
        running_delay_weight=1.0,
    )
    base = {"decode": {"filters": ["role"]}, "prefill": {"filters": ["role"]}}
    config = policy_from_mapping({**base, "prefill_on_decode": {"max_new_tokens": 250}})
    assert config.prefill_on_decode.max_new_tokens == 250
    with pytest.raises(PolicyConfigError, match="prefill_on_decode"):
        policy_from_mapping({**base, "prefill_on_decode": {"max_new_tokens": -1}})
    with pytest.raises(PolicyConfigError, match="prefill_on_decode"):
        policy_from_mapping({**base, "prefill_on_decode": {"min_history_per_new_token": -0.5}})
    with pytest.raises(PolicyConfigError, match="prefill_on_decode"):
        policy_from_mapping({**base, "prefill_on_decode": {"running_delay_weight": -1}})
    weighed = policy_from_mapping({**base, "prefill_on_decode": {"running_delay_weight": 0.25}})
    assert weighed.prefill_on_decode.running_delay_weight == 0.25
    with pytest.raises(PolicyConfigError, match="unknown key"):
        policy_from_mapping({**base, "prefill_on_decode": {"max_tokens": 5}})
    with pytest.raises(PolicyConfigError, match="from_decode_cache"):
        policy_from_mapping({**base, "prefill_on_decode": {"from_decode_cache": "yes"}})
    with pytest.raises(PolicyConfigError, match="idle_decode_skips_history_rule"):
        policy_from_mapping({**base, "prefill_on_decode": {"idle_decode_skips_history_rule": 1}})
    assert not policy_from_mapping(
        {**base, "prefill_on_decode": {"from_decode_cache": False}}
    ).prefill_on_decode.from_decode_cache


def test_the_snapshot_time_decides_the_life_left() -> None:
    # The same handle, seen 117 s later, has 3 s left: under the 5 s margin.
    assert route(added(200), now_unix_ms=NOW + 117_000).decision is not Decision.PREFILL_ON_DECODE


# The history rule and the time rules alone, the delay to the answers streaming from D not weighed.
UNWEIGHED = replace(load_policy(), prefill_on_decode=PrefillOnDecodeSettings(running_delay_weight=0))


def test_decodes_running_on_the_holder_are_not_ahead_of_its_prefill() -> None:
    # A prefill joins the running decodes' batch: only prefills waiting on D delay it.
    decoding = state(D0, running_requests=8, **ROOM)
    plan = route(added(200), nodes=[state(P0), decoding, state(D1, **ROOM)], config=UNWEIGHED)
    assert plan.decode.node_id == "d0"
    assert plan.decision is Decision.PREFILL_ON_DECODE


def on_holder(running: int, config: PolicyConfig | None = None) -> Any:
    nodes = [state(P0), state(D0, running_requests=running, **ROOM), state(D1, **ROOM)]
    return route(added(200), nodes=nodes, config=config)


def test_the_turn_goes_through_p_when_it_would_hold_up_the_answers_streaming_from_d() -> None:
    # Through P the turn would pull D's 4,096 tokens: on D it saves about 180 ms, and its
    # prefill there takes about 145 ms, which each answer running on D waits out.
    alone = on_holder(1)
    assert alone.decision is Decision.PREFILL_ON_DECODE
    local_ms, routed_ms = (float(x) for x in re.findall(r"([0-9.]+) ms", alone.verdict.reason))
    assert local_ms < routed_ms - local_ms
    assert 2 * local_ms > routed_ms - local_ms
    # Two answers streaming there would wait longer, together, than the turn saves.
    assert on_holder(2).decision is Decision.PULL
    assert on_holder(8).decision is Decision.PULL
    # Weighed at half, two are worth it and three are not.
    half = replace(load_policy(), prefill_on_decode=PrefillOnDecodeSettings(running_delay_weight=0.5))
    assert on_holder(2, half).decision is Decision.PREFILL_ON_DECODE
    assert on_holder(3, half).decision is Decision.PULL
    # A decode node whose load is unknown is charged nothing for it (the history rule holds there).
    unknown = route(added(200), nodes=[state(P0), state(D0), state(D1)])
    assert unknown.decision is Decision.PREFILL_ON_DECODE


def streaming() -> list[Any]:
    return [state(P0), state(D0, **STREAMING), state(D1, **STREAMING)]


def test_where_p_caches_the_history_but_the_last_answer_the_turn_goes_through_p() -> None:
    # P's cache holds the previous prompt; D's handle adds the 128-token answer. D would save
    # the hand-off and 128 tokens, for 898 of its own: not enough, while D streams others.
    warm = {"p0": 4096 - 128}
    plan = route(added(898), prefill_cached_tokens=warm, nodes=streaming())
    assert plan.decision is not Decision.PREFILL_ON_DECODE
    assert plan.prefill.node_id == "p0"
    anywhere = replace(
        load_policy(),
        prefill_on_decode=PrefillOnDecodeSettings(min_history_per_new_token=0, running_delay_weight=0),
    )
    assert (
        route(added(898), prefill_cached_tokens=warm, config=anywhere, nodes=streaming()).decision
        is Decision.PREFILL_ON_DECODE
    )


def test_an_idle_holder_prefills_even_what_p_caches() -> None:
    # The same turn on a D that runs and queues nothing: its prefill holds up no one.
    warm = {"p0": 4096 - 128}
    plan = route(added(898), prefill_cached_tokens=warm)
    assert plan.decision is Decision.PREFILL_ON_DECODE
    assert plan.prefill.node_id == plan.decode.node_id == "d0"
    # One request queued on D, or running there, and the rule holds again.
    for load in ({"queued_requests": 1}, {"running_requests": 1}):
        nodes = [state(P0), state(D0, **ROOM, **load), state(D1, **ROOM)]
        assert route(added(898), prefill_cached_tokens=warm, nodes=nodes).decision is not (
            Decision.PREFILL_ON_DECODE
        )
    # A D whose load is unknown is not taken for idle.
    unknown = [state(P0), state(D0), state(D1)]
    assert route(added(898), prefill_cached_tokens=warm, nodes=unknown).decision is not (
        Decision.PREFILL_ON_DECODE
    )
    # Off: the rule holds on an idle D as well.
    strict = replace(
        load_policy(), prefill_on_decode=PrefillOnDecodeSettings(idle_decode_skips_history_rule=False)
    )
    assert route(added(898), prefill_cached_tokens=warm, config=strict).decision is not (
        Decision.PREFILL_ON_DECODE
    )


def test_where_p_lacks_the_history_the_holder_prefills_it() -> None:
    # P's cache holds the first 1,000 tokens only: through P the turn would pull or recompute
    # 3,096 tokens of history, more than the 898 D computes itself.
    plan = route(added(898), prefill_cached_tokens={"p0": 1000})
    assert plan.decision is Decision.PREFILL_ON_DECODE
    assert plan.prefill.node_id == plan.decode.node_id == "d0"


def test_the_history_that_p_lacks_is_weighed_against_the_new_tokens() -> None:
    # 600 history tokens missing on P against 500 new: D at the default ratio, P at a ratio of 2.
    cached = {"p0": 4096 - 600}
    nodes = streaming()
    assert (
        route(added(500), prefill_cached_tokens=cached, nodes=nodes, config=UNWEIGHED).decision
        is Decision.PREFILL_ON_DECODE
    )
    strict = replace(
        load_policy(),
        prefill_on_decode=PrefillOnDecodeSettings(min_history_per_new_token=2, running_delay_weight=0),
    )
    assert (
        route(added(500), prefill_cached_tokens=cached, config=strict, nodes=streaming()).decision
        is not Decision.PREFILL_ON_DECODE
    )


# D's own prefix cache, as its engine's KV events show it (RouteSnapshot.decode_cached_tokens).


def no_handle(prompt: Prompt, *, config: PolicyConfig | None = None, **kw: Any) -> Any:
    nodes = kw.pop("nodes", None) or [state(P0), state(D0, **ROOM), state(D1, **ROOM)]
    snapshot = snap(nodes, prompt=prompt, prefill_on_decode_ok=kw.pop("ok", True), **kw)
    return RoutingPolicy(config or load_policy()).route(snapshot)


def test_a_decode_cache_that_holds_the_history_prefills_a_turn_without_a_handle() -> None:
    # The handle is gone (released under memory pressure), its blocks still in d1's cache.
    plan = no_handle(added(200), decode_cached_tokens={"d1": 4096})
    assert plan.decision is Decision.PREFILL_ON_DECODE
    assert plan.prefill.node_id == plan.decode.node_id == "d1"
    assert plan.verdict.reusable_tokens == 4096
    assert plan.verdict.pulled_tokens == 0
    assert "d1's prefix cache holds 4096 tokens" in plan.verdict.reason
    # Without what the events show, the same turn goes through P and recomputes.
    plain = no_handle(added(200))
    assert plain.decision is Decision.RECOMPUTE_NO_HANDLE
    assert plain.prefill.node_id == "p0"


def test_the_decode_node_whose_cache_holds_the_most_is_chosen() -> None:
    plan = no_handle(added(200), decode_cached_tokens={"d0": 1024, "d1": 4096})
    assert plan.decode.node_id == "d1"
    assert plan.verdict.reusable_tokens == 4096


def test_a_decode_cache_is_not_used_unless_allowed_and_it_pays() -> None:
    cached = {"d1": 4096}
    assert (
        no_handle(added(200), decode_cached_tokens=cached, ok=False).decision
        is not Decision.PREFILL_ON_DECODE
    )
    off = replace(load_policy(), prefill_on_decode=PrefillOnDecodeSettings(from_decode_cache=False))
    assert (
        no_handle(added(200), decode_cached_tokens=cached, config=off).decision
        is not Decision.PREFILL_ON_DECODE
    )
    # Over the cap on new tokens, or where P's cache holds the history too and D streams other
    # answers: through P. On an idle D, P's cache does not keep the turn from D's.
    assert no_handle(added(1200), decode_cached_tokens=cached).decision is not Decision.PREFILL_ON_DECODE
    warm = {"p0": 4096}
    plan = no_handle(added(200), decode_cached_tokens=cached, prefill_cached_tokens=warm, nodes=streaming())
    assert plan.decision is not Decision.PREFILL_ON_DECODE
    assert plan.prefill.node_id == "p0"
    idle = no_handle(added(200), decode_cached_tokens=cached, prefill_cached_tokens=warm)
    assert idle.decision is Decision.PREFILL_ON_DECODE and idle.decode.node_id == "d1"
    # A decode node with prefills queued is slower than P.
    busy = state(D1, queued_requests=12, queued_prefill_tokens=60_000, **ROOM)
    plan = no_handle(added(200), decode_cached_tokens=cached, nodes=[state(P0), state(D0, **ROOM), busy])
    assert plan.decision is not Decision.PREFILL_ON_DECODE


def test_a_decode_node_the_filters_leave_out_is_not_chosen_for_its_cache() -> None:
    draining = mk_node("d1", draining=True)
    plan = no_handle(
        added(200),
        decode_cached_tokens={"d1": 4096},
        nodes=[state(P0), state(D0, **ROOM), state(draining, **ROOM)],
    )
    assert plan.decode.node_id == "d0"
    assert plan.decision is not Decision.PREFILL_ON_DECODE


def test_a_handle_on_another_node_does_not_keep_the_turn_from_a_cache_that_holds_it() -> None:
    # The holder d0 has no room for the turn, so the decode leg chose d1, whose cache holds the
    # history (an earlier turn ran there): d1 prefills it rather than P pulling from d0.
    full = state(D0, free_kv_blocks=3, total_kv_blocks=10_000)
    plan = route(added(200), nodes=[state(P0), full, state(D1, **ROOM)], decode_cached_tokens={"d1": 4096})
    assert plan.decision is Decision.PREFILL_ON_DECODE
    assert plan.decode.node_id == "d1"


def test_a_decode_node_without_room_for_the_turn_is_not_chosen_for_its_cache() -> None:
    # d1's cache holds the most, but it has no free KV for the new tokens and the answer: d0,
    # which holds less and has room, prefills the turn.
    full = state(D1, free_kv_blocks=3, total_kv_blocks=10_000)
    plan = no_handle(
        added(200), decode_cached_tokens={"d0": 4000, "d1": 4096}, nodes=[state(P0), state(D0, **ROOM), full]
    )
    assert plan.decision is Decision.PREFILL_ON_DECODE
    assert plan.decode.node_id == "d0" and plan.verdict.reusable_tokens == 4000
    # With no other, the turn goes through P.
    plan = no_handle(
        added(200), decode_cached_tokens={"d1": 4096}, nodes=[state(P0), state(D0, **ROOM), full]
    )
    assert plan.decision is not Decision.PREFILL_ON_DECODE


def test_whether_an_unseen_handle_could_serve_a_prefill_on_d_follows_the_rules_on_its_tokens() -> None:
    rules = PrefillOnDecodeSettings()
    busy = [state(D0, **STREAMING), state(D1, **STREAMING)]
    idle = [state(D0, **STREAMING), state(D1, **ROOM)]

    def could(
        held: int,
        prompt: int,
        prefill_held: int,
        nodes: list[NodeState],
        settings: PrefillOnDecodeSettings = rules,
    ) -> bool:
        return handle_could_serve_on_decode(held, prompt, prefill_held, lambda: nodes, settings)

    # D holds 4,096 tokens of a 4,296-token prompt; P holds none of them, or all but 80.
    assert could(4096, 4296, 0, busy)
    assert not could(4096, 4296, 4016, busy)
    # Sparing P fewer tokens than D would compute is waived where a decode node is idle.
    assert could(4096, 4296, 4016, idle)
    assert not could(4096, 4296, 4016, idle, replace(rules, idle_decode_skips_history_rule=False))
    # More new tokens than D may compute, none at all, or prefill on D off: never.
    assert not could(4096, 4096 + rules.max_new_tokens + 1, 0, idle)
    assert not could(4096, 4096, 0, idle)
    assert not could(4096, 4296, 0, idle, replace(rules, max_new_tokens=0))


def test_the_decode_nodes_loads_are_read_only_where_the_idle_waiver_decides() -> None:
    rules = PrefillOnDecodeSettings()
    asked: list[int] = []

    def decodes() -> list[NodeState]:
        asked.append(1)
        return [state(D1, **ROOM)]

    # Too many new tokens, or a history that spares P enough: the loads do not matter.
    assert not handle_could_serve_on_decode(4096, 4096 + rules.max_new_tokens + 1, 4016, decodes, rules)
    assert handle_could_serve_on_decode(4096, 4296, 0, decodes, rules)
    assert asked == []
    # Too little spared: only an idle decode node lets it through.
    assert handle_could_serve_on_decode(4096, 4296, 4016, decodes, rules)
    assert asked == [1]
