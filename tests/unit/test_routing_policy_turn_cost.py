"""Prefill-cache-aware routing: the turn's cost on each P, pulls sized to what P lacks, prefix pulls."""

from __future__ import annotations

import re
from dataclasses import replace
from importlib import resources
from typing import Any

import pytest

from kvplane.connector import digests as token_digests
from kvplane.connector.prefix_check import PullOutcome, check_pull
from kvplane.services.common.model.handles import KEY_DIGESTS
from kvplane.services.common.model.nodes import NodeRole
from kvplane.services.routing.policy import (
    CostModel,
    Decision,
    NodeState,
    Prompt,
    PullSettings,
    RoutePlan,
    RoutingPolicy,
    load_policy,
    policy_from_yaml,
)
from kvplane.services.routing.policy.registry import PolicyConfigError
from kvplane.services.routing.policy.turn_cost import estimate_prefill
from kvplane.services.routing.transfer_params import clip_pull
from tests.unit.routing_policy_fixtures import history, mk_handle, mk_node, snap, state

# Qwen3-32B-sized KV: 256 KiB a token, so pulls cost what they do on a real fleet.
KVB = 64 * 8 * 128 * 2 * 2
D0 = mk_node("d0", kv_bytes_per_token=KVB)
P0 = mk_node("p0", NodeRole.PREFILL, kv_bytes_per_token=KVB)
P1 = mk_node("p1", NodeRole.PREFILL, kv_bytes_per_token=KVB)
H = history(8192)
ANSWER = history(96, seed=4)
NEW = history(200, seed=5)
# Turn N's prompt, then D's handle (the prompt and the answer), then turn N+1's prompt.
PREVIOUS = H[:8096]
NEXT = [*PREVIOUS, *ANSWER, *NEW]


@pytest.fixture(scope="module")
def policy() -> RoutingPolicy:
    return RoutingPolicy(load_policy())


def nodes(p0_queue: int = 0, p1_queue: int = 0) -> list[NodeState]:
    return [
        state(P0, queued_prefill_tokens=p0_queue),
        state(P1, queued_prefill_tokens=p1_queue),
        state(D0, free_kv_blocks=100_000, total_kv_blocks=100_000),
    ]


def route(policy: RoutingPolicy, prompt: list[int], **kw: Any) -> RoutePlan:
    handle = kw.pop("handle", mk_handle(D0, [*PREVIOUS, *ANSWER]))
    # What P holds is known here (its events, or reports that showed the record right).
    kw.setdefault("prefill_cache_known", frozenset(kw.get("prefill_cached_tokens", {})))
    return policy.route(
        snap(nodes(**kw.pop("queues", {})), handle=handle, prompt=Prompt(len(prompt), prompt), **kw)
    )


def test_a_prefill_cache_hit_leaves_a_short_tail_that_is_recomputed_rather_than_pulled(
    policy: RoutingPolicy,
) -> None:
    # Without the hint, the whole 8k-token handle is worth pulling.
    assert route(policy, NEXT).decision is Decision.PULL
    # p0 computed the previous prompt: only D's 96-token answer is missing there, and
    # moving it costs a transfer's fixed overhead against ~3 ms of compute.
    plan = route(policy, NEXT, prefill_cached_tokens={"p0": len(PREVIOUS)})
    assert plan.prefill.node_id == "p0"
    assert plan.decision is Decision.RECOMPUTE_COST, plan.verdict.reason
    assert plan.verdict.cached_tokens == len(PREVIOUS) and plan.verdict.pulled_tokens == 0


def test_a_pull_brings_only_what_the_prefill_node_lacks(policy: RoutingPolicy) -> None:
    plan = route(policy, NEXT, prefill_cached_tokens={"p0": 2048})
    assert plan.prefill.node_id == "p0" and plan.decision is Decision.PULL
    assert plan.verdict.reusable_tokens == 8192 and plan.verdict.pulled_tokens == 8192 - 2048
    whole = route(policy, NEXT)
    assert plan.verdict.transfer_ms < whole.verdict.transfer_ms


def test_the_node_holding_the_history_wins_over_an_idle_one_until_its_queue_costs_more(
    policy: RoutingPolicy,
) -> None:
    hint = {"prefill_cached_tokens": {"p1": len(PREVIOUS)}}
    assert route(policy, NEXT, queues={"p1_queue": 2000}, **hint).prefill.node_id == "p1"
    # 100k queued tokens (3 s) cost more than pulling the history into idle p0.
    busy = route(policy, NEXT, queues={"p1_queue": 100_000}, **hint)
    assert busy.prefill.node_id == "p0" and busy.decision is Decision.PULL


def with_picker_param(name: str, value: float) -> RoutingPolicy:
    """The default policy with one of least-cost's parameters set to `value`."""
    default = resources.files("kvplane.services.routing.policy").joinpath("default_policy.yaml")
    text, replaced = re.subn(rf"{name}: [0-9.]+", f"{name}: {value}", default.read_text(encoding="utf-8"))
    assert replaced == 1, name
    return RoutingPolicy(policy_from_yaml(text))


def with_margin(margin_ms: float) -> RoutingPolicy:
    return with_picker_param("move_margin_ms", margin_ms)


# p1 holds the history and serves one other active conversation, p0 none: a move there evens
# the fleet, and pays no placement margin.
EVENING = {"p1": 1}


def test_a_conversation_stays_home_unless_moving_saves_more_than_the_margin(policy: RoutingPolicy) -> None:
    hint = {"prefill_cached_tokens": {"p1": len(PREVIOUS)}, "prefill_homes": EVENING}
    # p1 holds the history and has ~2,700 tokens (~80 ms) more queued than idle p0; pulling the
    # history into p0 would save more than its transfer costs, but not past the margin.
    queued = {"p1_queue": 2_700}
    stays = route(policy, NEXT, queues=queued, **hint)
    assert stays.prefill.node_id == "p1" and stays.verdict.cached_tokens == len(PREVIOUS)
    # Without a margin the same estimates move it.
    moved = route(with_margin(0), NEXT, queues=queued, **hint)
    assert moved.prefill.node_id == "p0" and moved.decision is Decision.PULL
    # Past the margin it moves anyway (see the test above for a busy home).
    assert route(policy, NEXT, queues={"p1_queue": 20_000}, **hint).prefill.node_id == "p0"


def test_the_margin_applies_only_where_a_node_holds_part_of_the_prompt(policy: RoutingPolicy) -> None:
    # Nothing cached anywhere, though p0 served the conversation last: it is no home, and with
    # no other conversations on either P the shorter queue wins however small the difference.
    plan = route(policy, NEXT, queues={"p0_queue": 300}, last_prefill_node_id="p0")
    assert plan.prefill.node_id == "p1"
    # The same p0 holding the history is home, and keeps the conversation at that queue.
    held = route(
        policy,
        NEXT,
        queues={"p0_queue": 300},
        last_prefill_node_id="p0",
        prefill_cached_tokens={"p0": len(PREVIOUS)},
    )
    assert held.prefill.node_id == "p0"


def test_a_move_that_leaves_the_fleet_less_even_must_also_pay_the_placement_margin(
    policy: RoutingPolicy,
) -> None:
    # ~8,000 tokens (~226 ms) queued on p1, which holds the history: pulling it to idle p0 saves
    # about 150 ms, more than the move margin. Where p0 serves fewer other conversations, the
    # turn moves.
    hint = {"prefill_cached_tokens": {"p1": len(PREVIOUS)}}
    queued = {"p1_queue": 8_000}
    assert route(policy, NEXT, queues=queued, prefill_homes=EVENING, **hint).prefill.node_id == "p0"
    # Where p0 serves as many, the move would carry this conversation's later turns to the busier
    # node: the saving does not cover the placement margin too.
    level = {"p0": 1, "p1": 1}
    assert route(policy, NEXT, queues=queued, prefill_homes=level, **hint).prefill.node_id == "p1"
    assert (
        route(with_placement_margin(0), NEXT, queues=queued, prefill_homes=level, **hint).prefill.node_id
        == "p0"
    )
    # A home seconds behind still loses the conversation.
    assert (
        route(policy, NEXT, queues={"p1_queue": 20_000}, prefill_homes=level, **hint).prefill.node_id == "p0"
    )


def with_extra_work_weight(weight: float) -> RoutingPolicy:
    return with_picker_param("extra_work_weight", weight)


def test_a_move_that_recomputes_the_history_must_also_pay_for_the_work_it_adds(policy: RoutingPolicy) -> None:
    # No handle to pull: a move recomputes the 8k-token history that p1's cache holds, ~150 ms
    # more compute than the turn costs at home. 12,000 tokens (~340 ms) queued on p1 would save
    # the turn itself more than that and the margin, but the added work delays whatever queues
    # behind it on p0: the move does not pay.
    hint = {"prefill_cached_tokens": {"p1": len(PREVIOUS)}, "handle": None, "prefill_homes": EVENING}
    stays = route(policy, NEXT, queues={"p1_queue": 12_000}, **hint)
    assert stays.prefill.node_id == "p1" and stays.verdict.cached_tokens == len(PREVIOUS)
    # Counting only the turn's own time, the same estimates move it.
    moved = route(with_extra_work_weight(0), NEXT, queues={"p1_queue": 12_000}, **hint)
    assert moved.prefill.node_id == "p0" and moved.verdict.cached_tokens == 0
    # A queue well past both moves it anyway.
    assert route(policy, NEXT, queues={"p1_queue": 30_000}, **hint).prefill.node_id == "p0"


def test_a_move_that_pulls_adds_no_compute_and_pays_only_the_margin(policy: RoutingPolicy) -> None:
    # With D's handle the move pulls the history: the pulled tokens cost what cached ones do, so
    # the same queue that keeps a recomputing move home moves this one.
    hint = {"prefill_cached_tokens": {"p1": len(PREVIOUS)}}
    moved = route(policy, NEXT, queues={"p1_queue": 12_000}, **hint)
    assert moved.prefill.node_id == "p0" and moved.decision is Decision.PULL


def test_a_move_says_which_node_it_left_and_the_estimates_that_decided_it(policy: RoutingPolicy) -> None:
    hint = {"prefill_cached_tokens": {"p1": len(PREVIOUS)}}
    moved = route(policy, NEXT, queues={"p1_queue": 12_000}, **hint)
    assert moved.prefill.node_id == "p0"
    match = re.fullmatch(
        r"moved from p1 \(queue (\d+) \+ pull 0 \+ prefill (\d+) = (\d+) ms\)"
        r" to p0 \(queue 0 \+ pull (\d+) \+ prefill (\d+) = (\d+) ms\)",
        moved.moved_from,
    )
    assert match is not None, moved.moved_from
    home_queue, _, home_total, pull, _, total = (int(x) for x in match.groups())
    # p1's 12,000 queued tokens are most of what it would cost there; p0 pays the pull instead.
    assert home_queue > 300 and pull > 0 and total < home_total
    # A turn that stays home, or that no node holds any of, moved from nowhere.
    assert route(policy, NEXT, queues={"p1_queue": 2_000}, **hint).moved_from == ""
    assert route(policy, NEXT, queues={"p1_queue": 12_000}).moved_from == ""


def test_a_turn_whose_home_is_filtered_out_says_so(policy: RoutingPolicy) -> None:
    plan = policy.route(
        snap(
            [
                state(P0),
                state(mk_node("p1", NodeRole.PREFILL, kv_bytes_per_token=KVB, draining=True)),
                state(D0, free_kv_blocks=100_000, total_kv_blocks=100_000),
            ],
            handle=mk_handle(D0, [*PREVIOUS, *ANSWER]),
            prompt=Prompt(len(NEXT), NEXT),
            prefill_cached_tokens={"p1": len(PREVIOUS)},
        )
    )
    assert plan.prefill.node_id == "p0"
    assert plan.moved_from == "moved from p1: not eligible for the turn"


def test_a_negative_extra_work_weight_is_rejected() -> None:
    with pytest.raises(PolicyConfigError):
        with_extra_work_weight(-1)


def test_a_negative_move_margin_is_rejected() -> None:
    with pytest.raises(PolicyConfigError):
        with_margin(-1)


def test_an_edited_message_pulls_the_verified_prefix_and_recomputes_the_rest(policy: RoutingPolicy) -> None:
    edited = [*PREVIOUS[:6000], 1, *PREVIOUS[6001:], *ANSWER, *NEW]
    plan = route(policy, edited)
    assert plan.decision is Decision.PULL_PREFIX, plan.verdict.reason
    verified = plan.verdict.reusable_tokens
    assert 0 < verified <= 6000 and verified % 16 == 0
    assert plan.verdict.pulled_tokens == verified


def test_a_retried_turn_pulls_what_it_shares_with_the_handle(policy: RoutingPolicy) -> None:
    plan = route(policy, PREVIOUS)
    assert plan.decision is Decision.PULL_PREFIX
    assert plan.verdict.reusable_tokens == len(PREVIOUS) - 1


def test_a_short_verified_prefix_is_not_worth_a_pull(policy: RoutingPolicy) -> None:
    early_edit = [*PREVIOUS[:40], 1, *PREVIOUS[41:], *ANSWER, *NEW]
    assert route(policy, early_edit).decision is Decision.RECOMPUTE_PREFIX_MISMATCH


def test_a_handle_with_several_kv_cache_groups_is_never_clipped(policy: RoutingPolicy) -> None:
    handle = mk_handle(D0, [*PREVIOUS, *ANSWER])
    blocks = handle.vllm.remote_block_ids[0]
    two_groups = replace(handle, vllm=replace(handle.vllm, remote_block_ids=(blocks, blocks)))
    edited = [*PREVIOUS[:6000], 1, *PREVIOUS[6001:], *ANSWER, *NEW]
    assert route(policy, edited, handle=two_groups).decision is Decision.RECOMPUTE_PREFIX_MISMATCH
    assert route(policy, NEXT, handle=two_groups).decision is Decision.PULL


def test_the_clipped_params_make_the_prefill_connector_read_only_the_verified_blocks(
    policy: RoutingPolicy,
) -> None:
    handle = mk_handle(D0, [*PREVIOUS, *ANSWER])
    edited = [*PREVIOUS[:6000], 1, *PREVIOUS[6001:], *ANSWER, *NEW]
    plan = route(policy, edited, handle=handle)
    params = handle.prefill_kv_transfer_params()
    assert handle.digests is not None
    params[KEY_DIGESTS] = token_digests.encode(handle.digests)
    clip_pull(params, plan.verdict.reusable_tokens, 16)
    assert params["remote_num_tokens"] == plan.verdict.reusable_tokens
    assert params["remote_block_ids"] == [list(range(plan.verdict.reusable_tokens // 16))]
    # P's connector proves the same prefix and passes the clipped pull through unchanged.
    check = check_pull(params, edited)
    assert check.outcome is PullOutcome.VERIFIED
    assert params["remote_num_tokens"] == plan.verdict.reusable_tokens


def test_an_unknown_prefill_cost_model_still_ranks_by_queue(policy: RoutingPolicy) -> None:
    plan = policy.route(
        snap(nodes(p0_queue=50_000), prompt=Prompt(1000)),
        CostModel(recompute_ms_per_token=0.01),
    )
    assert plan.prefill.node_id == "p1"


def test_a_turns_cost_on_a_node_counts_the_prefill_fixed_cost_once() -> None:
    costs = CostModel(prefill_fixed_ms=100.0, recompute_ms_per_token=0.03, reused_ms_per_token=0.01)
    snapshot = snap(nodes(), prompt=Prompt(len(NEXT), NEXT), prefill_cached_tokens={"p0": len(PREVIOUS)})
    p0 = snapshot.nodes[0]
    estimate = estimate_prefill(snapshot, p0, None, False, costs, PullSettings())
    computed = len(NEXT) - len(PREVIOUS)
    assert estimate.compute_tokens == computed
    assert estimate.total_ms == pytest.approx(100.0 + computed * 0.03 + len(PREVIOUS) * 0.01)
    # Queued requests each bring theirs.
    busy = NodeState(P0, replace(p0.load, queued_requests=3)) if p0.load is not None else p0
    queued = estimate_prefill(snapshot, busy, None, False, costs, PullSettings())
    assert queued.queue_ms == pytest.approx(300.0)
    assert queued.total_ms == pytest.approx(estimate.total_ms + 300.0)


def _first_turn_on(policy: RoutingPolicy, conversation: str, **kw: Any) -> str:
    """Where a first turn (nothing held anywhere, both P idle: equal costs) is prefilled."""
    snapshot = snap(nodes(), prompt=Prompt(1000), conversation=conversation, **kw)
    return policy.route(snapshot).prefill.node_id


def test_equal_costs_go_to_the_p_fewer_other_conversations_call_home(policy: RoutingPolicy) -> None:
    names = [f"c-{i}" for i in range(8)]
    by_hash = {name: _first_turn_on(policy, name) for name in names}
    assert set(by_hash.values()) == {"p0", "p1"}, "the hash alone must split these names both ways"
    for name, hashed in by_hash.items():
        other = "p1" if hashed == "p0" else "p0"
        # The hash's choice is the home of more conversations: the other P takes the turn.
        crowded = {hashed: 5, other: 2}
        assert _first_turn_on(policy, name, prefill_homes=crowded) == other, name
        # Equal counts leave it to the hash.
        assert _first_turn_on(policy, name, prefill_homes={"p0": 3, "p1": 3}) == hashed, name


def test_a_conversation_no_p_holds_is_placed_anew_even_off_its_last_p(policy: RoutingPolicy) -> None:
    # Nothing cached anywhere: its last P is no home. It leaves one crowded with other active
    # conversations; between equally crowded ones, it stays.
    for name in (f"c-{i}" for i in range(8)):
        for last, other in (("p0", "p1"), ("p1", "p0")):
            crowded = _first_turn_on(
                policy, name, prefill_homes={last: 9, other: 0}, last_prefill_node_id=last
            )
            assert crowded == other, (name, last)
            level = _first_turn_on(policy, name, prefill_homes={last: 3, other: 3}, last_prefill_node_id=last)
            assert level == last, (name, last)


def with_placement_margin(margin_ms: float) -> RoutingPolicy:
    return with_picker_param("placement_margin_ms", margin_ms)


def _placed_on(policy: RoutingPolicy, conversation: str, p0_queue: int, **kw: Any) -> str:
    """Where a first turn goes with `p0_queue` tokens queued on p0 and p1 idle."""
    snapshot = snap(nodes(p0_queue=p0_queue), prompt=Prompt(1000), conversation=conversation, **kw)
    return policy.route(snapshot).prefill.node_id


def test_a_new_conversation_goes_to_the_p_with_fewer_active_ones_within_the_margin(
    policy: RoutingPolicy,
) -> None:
    # 2,000 tokens queued on p0 (~56 ms): p1 is cheaper for this turn, but it is home to more
    # active conversations, whose later turns this one's will queue with.
    homes = {"p0": 2, "p1": 3}
    for name in (f"c-{i}" for i in range(8)):
        assert _placed_on(policy, name, 2_000, prefill_homes=homes) == "p0", name
        # Ranked by this turn's cost alone, it joins the crowd.
        assert _placed_on(with_placement_margin(0), name, 2_000, prefill_homes=homes) == "p1", name
        # A saving past the margin (8,000 tokens, ~226 ms) still wins.
        assert _placed_on(policy, name, 8_000, prefill_homes=homes) == "p1", name


def test_new_conversations_on_equally_loaded_ps_go_to_the_cheaper_not_the_hash(policy: RoutingPolicy) -> None:
    # A few ms of queue on p0 decide, whatever the hash says: the next arrival alternates.
    for name in (f"c-{i}" for i in range(8)):
        assert _placed_on(policy, name, 300, prefill_homes={"p0": 4, "p1": 4}) == "p1", name


def test_equal_costs_and_counts_go_to_the_p_sent_a_turn_least_lately(policy: RoutingPolicy) -> None:
    # An idle fleet: new conversations alternate, whatever the hash says.
    for name in (f"c-{i}" for i in range(8)):
        homes = {"p0": 2, "p1": 2}
        assert (
            _first_turn_on(policy, name, prefill_homes=homes, prefill_routed_order={"p0": 7, "p1": 6}) == "p1"
        )
        assert (
            _first_turn_on(policy, name, prefill_homes=homes, prefill_routed_order={"p0": 6, "p1": 7}) == "p0"
        )
        # A P never sent a turn comes first.
        assert _first_turn_on(policy, name, prefill_homes=homes, prefill_routed_order={"p0": 1}) == "p1"


def test_a_negative_placement_margin_is_rejected() -> None:
    with pytest.raises(PolicyConfigError):
        with_placement_margin(-1)
