"""Baselines whose decode nodes keep a prefix cache: SGLang's decode-side radix cache
(`decode-radix`) and Dynamo's conditional disaggregation (`conditional-disagg`)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvplane.bench.sim import BASELINES, ClusterSpec, SimConfig, simulator_for
from kvplane.bench.sim.block_chain import BlockChain, BlockIds
from kvplane.bench.sim.cluster import DecodeState, build_node
from kvplane.bench.sim.costs import SimCosts
from kvplane.bench.sim.decode_cache_router import DecodeCacheRouter
from kvplane.bench.sim.engine import LOCAL_PREFILL_CHUNK_TOKENS, Simulator
from kvplane.bench.sim.fleet import Conversation, Fleet
from kvplane.bench.sim.prefix_cache import PrefixCache
from kvplane.bench.sim.results import SimSummary
from kvplane.bench.sim.routers import TurnOutcome
from kvplane.bench.workloads import Turn
from kvplane.services.common.model.nodes import NodeRole

GIB = 1 << 30
ONE_PAIR = ClusterSpec(prefill_nodes=1, decode_nodes=1, decode_kv_capacity_bytes=16 * GIB)
BLOCK = 16


def _conversation(added_tokens: int, gap_s: float = 60.0) -> list[Turn]:
    """Two turns `gap_s` apart: 8,000 prompt tokens and 100 output, then the whole history plus
    `added_tokens`."""
    return [
        Turn(0.0, "c", 0, 8000, 100),
        Turn(
            gap_s, "c", 1, 8100 + added_tokens, 100, reused_prefix_tokens=8100, previous_context_tokens=8100
        ),
    ]


def _run(name: str, turns: list[Turn], cluster: ClusterSpec = ONE_PAIR) -> tuple[Simulator, SimSummary]:
    """The simulator after the run (its per-turn record), and the run's summary."""
    sim = simulator_for(BASELINES[name], SimConfig(cluster=cluster))
    return sim, sim.run(turns, name).summary


def test_decode_radix_spares_the_hand_off_of_the_blocks_d_holds_and_nothing_else() -> None:
    affinity = _run("prefix-affinity", _conversation(2000))[0]
    radix = _run("decode-radix", _conversation(2000))[0]
    # The first turn finds nothing on D; the second finds the first turn's 8,100 tokens (whole
    # blocks: 8,096) and is that much of a hand-off sooner. P's own work is the same: P's cache
    # served the same tokens on both.
    assert radix.rec.ttft_s[0] == pytest.approx(affinity.rec.ttft_s[0])
    saved = affinity.rec.ttft_s[1] - radix.rec.ttft_s[1]
    assert saved == pytest.approx(SimCosts().handoff_s(8096))
    assert radix.rec.cached_tokens == affinity.rec.cached_tokens > 0
    assert radix.rec.pulled_correct == 0


def test_without_a_decode_cache_the_radix_routers_refuse_to_run() -> None:
    fleet = Fleet(ONE_PAIR, SimCosts(), 0)
    with pytest.raises(ValueError, match="prefix cache"):
        DecodeCacheRouter(fleet)


def test_conditional_disagg_prefills_a_short_addition_on_the_decode_node() -> None:
    # The first turn's 8,000 tokens go to P; the second lacks 504 tokens on D, under Dynamo's
    # 1,000: D prefills it from its own cache, with no hand-off and no P.
    _prefilled_on_d_below_the_cap_only("conditional-disagg", "local_prefill")


def _prefilled_on_d_below_the_cap_only(
    name: str, decision: str, gap_s: float = 60.0, cluster: ClusterSpec = ONE_PAIR
) -> Simulator:
    """Runs `name` on a second turn that adds 500 tokens (D prefills it: P serves the first turn
    only, D reads the first turn's whole blocks) and on one that adds 2,000 (through P);
    returns the first run."""
    short = _run(name, _conversation(500, gap_s), cluster)[0]
    assert short.rec.decisions[decision] == 1
    assert short.fleet.prefill[0].served == 1
    assert short.rec.cached_tokens >= 8096
    long = _run(name, _conversation(2000, gap_s), cluster)[0]
    assert long.rec.decisions.get(decision, 0) == 0
    assert long.fleet.prefill[0].served == 2
    return short


def test_a_prefill_on_the_decode_node_costs_its_compute_and_one_decode_step_per_chunk() -> None:
    sim = _run("conditional-disagg", [Turn(0.0, "solo", 0, 600, 10)])[0]
    costs = SimCosts()
    # D computes all 600 tokens (nothing cached), one step beside its decodes, and reads nothing.
    expected = costs.prefill_s(600) + costs.timing.decode_s(0) - costs.handoff_s(600)
    assert sim.rec.ttft_s[0] == pytest.approx(expected)
    assert LOCAL_PREFILL_CHUNK_TOKENS >= 600


def test_a_prefill_on_the_decode_node_delays_every_decode_running_there() -> None:
    # a decodes 400 tokens; b's short first turn is prefilled on the same D meanwhile.
    a = Turn(0.0, "a", 0, 4000, 400)
    b = Turn(1.0, "b", 0, 600, 1)
    _, alone = _run("conditional-disagg", [a])
    both_sim, both = _run("conditional-disagg", [a, b])
    assert both.decisions["local_prefill"] == 1
    # b came to an idle D compute: its TTFT is its prefill, and a's last token came that much later
    # (a's decode, 400 steps, outlasts b's).
    b_prefill = both_sim.rec.ttft_s[1]
    assert both.simulated_s - alone.simulated_s == pytest.approx(b_prefill)
    # And the table's TPOT shows it: a's 399 tokens after its first took b's prefill longer (b's
    # one token has no TPOT).
    assert len(alone_tpot := _tpots(a)) == 1 and len(both_sim.rec.tpot_s) == 1
    assert both_sim.rec.tpot_s[0] - alone_tpot[0] == pytest.approx(b_prefill / 399)
    assert both.tpot_p50_ms == pytest.approx(both_sim.rec.tpot_s[0] * 1000.0)


def _tpots(*turns: Turn) -> list[float]:
    return list(_run("conditional-disagg", list(turns))[0].rec.tpot_s)


def test_the_decode_node_is_the_one_with_the_least_work_for_the_turn() -> None:
    cluster = replace(ONE_PAIR, decode_nodes=2, decode_prefix_cache=True)
    fleet = Fleet(cluster, SimCosts(), 0)
    router = DecodeCacheRouter(fleet)
    ids = BlockIds()
    history = BlockChain().extended(500, ids)
    d1 = fleet.decode[1]
    assert d1.prefix_cache is not None
    d1.prefix_cache.insert(history)
    prompt = history.extended(20, ids)
    turn = Turn(0.0, "c", 1, 520 * BLOCK, 10)
    conversation = Conversation()
    # D1 holds all but 320 of the prompt's tokens: it has the least to receive.
    first = router.route(turn, conversation, prompt, 0.0)
    assert first.decode is d1
    # That turn's 8,330 tokens of unfinished work on D1 outweigh the 8,000 it spares: the same
    # prompt now goes to the other D, which holds nothing; once the turn is over, to D1 again.
    assert router.route(turn, conversation, prompt, 0.0).decode is fleet.decode[0]
    router.observe(turn, first, TurnOutcome(0, 0.0, 0.0, 0.0))
    assert router.route(turn, conversation, prompt, 0.0).decode is d1


def test_the_decode_cache_holds_only_what_running_turns_leave_free() -> None:
    costs = SimCosts()
    block_bytes = BLOCK * costs.kv_bytes_per_token
    d = DecodeState(build_node(NodeRole.DECODE, 0, ONE_PAIR, costs.kv_bytes_per_token), 0, 100 * block_bytes)
    d.prefix_cache = PrefixCache(100)
    ids = BlockIds()
    old, new = BlockChain().extended(60, ids), BlockChain().extended(30, ids)
    d.prefix_cache.insert(old)
    d.prefix_cache.insert(new)
    assert d.prefix_cache.used_blocks == 90
    d.reserved = 50 * block_bytes
    d.fit_prefix_cache(block_bytes)
    # 50 blocks left: the older chain's tail went first; the newer chain is whole.
    assert d.prefix_cache.used_blocks == 50
    assert d.prefix_cache.hit_blocks(new) == 30 and d.prefix_cache.hit_blocks(old) == 20


def test_kvplane_lets_the_holder_d_prefill_a_short_turn_that_p_would_pull() -> None:
    # kvplane's gateway with prefill_on_decode, P's prefix cache off: the second turn continues the
    # handle D kept and adds 500 tokens; through P it would pull all 8,100 of them. Routing's rule
    # sends it to D alone, which reads the handle's blocks and computes the rest. P serves the
    # first turn only. Over routing's 1,000-token cap it goes through P. (Turns five seconds
    # apart: after a minute idle, kvplane's retention has released the handle.)
    cold = replace(ONE_PAIR, prefill_cache_bytes=0)
    local = _prefilled_on_d_below_the_cap_only(
        "kvplane-decode-prefill", "prefill_on_decode", gap_s=5.0, cluster=cold
    )
    # Without the gateway's word, the same routing pulls the history into P.
    routed = _run("kvplane-events", _conversation(500, 5.0), cold)[0]
    assert routed.rec.decisions.get("prefill_on_decode", 0) == 0
    assert routed.fleet.prefill[0].served == 2
    assert local.rec.ttft_s[1] < routed.rec.ttft_s[1]


def test_kvplane_sends_through_p_a_turn_whose_history_p_caches_but_the_answer() -> None:
    # P's cache holds the first turn's 8,000 prompt tokens; D's handle adds only the 100-token
    # answer, far fewer than the 500 new tokens D would compute, and D is streaming another
    # conversation's long answer, which a prefill there would hold up: the turn goes through P.
    other = Turn(0.5, "x", 0, 1000, 5000)
    busy = _run("kvplane-decode-prefill", [*_conversation(500, 5.0)[:1], other, _conversation(500, 5.0)[1]])[
        0
    ]
    assert busy.rec.decisions.get("prefill_on_decode", 0) == 0
    assert busy.fleet.prefill[0].served == 3
    assert busy.rec.cached_tokens >= 8000


def test_kvplane_prefills_on_an_idle_decode_node_even_what_p_caches() -> None:
    # The same turn with nothing else on D: D's prefill holds up no one, and it spares P's leg
    # and the hand-off.
    idle = _run("kvplane-decode-prefill", _conversation(500, 5.0))[0]
    assert idle.rec.decisions.get("prefill_on_decode", 0) == 1
    assert idle.fleet.prefill[0].served == 1
    assert idle.rec.cached_tokens >= 8096


def test_kvplane_prefills_on_the_decode_node_whose_events_show_the_history_after_the_handle_went() -> None:
    # A minute apart: kvplane's retention has released the handle by the second turn, but its
    # blocks are still in D's prefix cache (nothing reused the memory), and D's KV events tell
    # routing so. P's cache is off: through P the turn would recompute all 8,600 tokens.
    cold = replace(ONE_PAIR, prefill_cache_bytes=0)
    local, summary = _run("kvplane-decode-prefill", _conversation(500, 60.0), cold)
    assert sum(local.rec.releases.values()) >= 1  # the handle went before the second turn
    assert local.rec.decisions.get("prefill_on_decode", 0) == 1
    assert local.fleet.prefill[0].served == 1
    assert local.rec.cached_tokens >= 8096
    assert summary.wrong_prefix_turns == 0
    # The same turns where D's cache is not read: P recomputes the history.
    routed = _run("kvplane-events", _conversation(500, 60.0), cold)[0]
    assert routed.fleet.prefill[0].served == 2
    assert routed.rec.cached_tokens == 0
    assert local.rec.ttft_s[1] < routed.rec.ttft_s[1]


def test_a_handle_pins_its_blocks_in_ds_cache_and_leaves_them_there_when_released() -> None:
    # P's cache off. The conversation's first turn is kept as a handle; six other conversations'
    # turns follow on the same D and are kept too, until D's memory is short and retention
    # releases handles by value. Pinned, the first handle's blocks are not the cache's to evict
    # (no newer turn's blocks can take their place); released, they join D's cache as vLLM frees
    # them, most recently freed last out. So the conversation's next turn, a minute on, finds its
    # history in D's cache, as D's KV events show it, and D prefills it.
    cluster = replace(ONE_PAIR, prefill_cache_bytes=0)
    turns = [_conversation(500)[0], *(Turn(1.0 + 5 * i, f"x{i}", 0, 8000, 100) for i in range(6))]
    turns.append(replace(_conversation(500)[1], arrival_s=65.0))
    sim, summary = _run("kvplane-decode-prefill", turns, cluster)
    # Every handle is released for low value by the run's end, the conversation's first long
    # before its second turn (13 s into the run).
    assert sim.rec.releases == {"low_value": 8}
    assert sim.rec.decisions == {"recompute_no_handle": 7, "prefill_on_decode": 1}
    assert sim.rec.cached_tokens >= 8096
    assert summary.wrong_prefix_turns == 0
