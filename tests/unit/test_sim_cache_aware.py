"""vllm-router's cache-aware policy in the simulator: its own record of what it sent decides."""

from __future__ import annotations

from kvplane.bench.compare_workload import Workload
from kvplane.bench.sim import BASELINES, ClusterSpec, SimConfig, simulator_for
from kvplane.bench.sim.block_chain import BlockChain, BlockIds
from kvplane.bench.sim.ranking import LIVE_COUNTERPARTS, simulate
from kvplane.bench.sim.routers import CacheAwarePicker
from kvplane.bench.workloads.turns import Turn


def test_a_prompt_goes_where_the_router_sent_its_prefix() -> None:
    ids = BlockIds()
    picker = CacheAwarePicker(2, 16)
    first = BlockChain().extended(10, ids)
    other = BlockChain().extended(10, ids)
    a, why_a = picker.pick(first)
    b, why_b = picker.pick(other)
    assert (why_a, why_b) == ("smallest_tree", "smallest_tree") and a != b
    # The next turn extends the history: it matches 10 of 14 blocks on node a, whatever a's load.
    picker.pick(BlockChain().extended(3, ids))
    picker.pick(BlockChain().extended(3, ids))
    assert picker.pick(first.extended(4, ids)) == (a, "prefix_match")


def test_a_short_match_is_not_enough() -> None:
    ids = BlockIds()
    picker = CacheAwarePicker(2, 16)
    shared = BlockChain().extended(3, ids)
    a, _ = picker.pick(shared.extended(1, ids))
    # 3 of 10 blocks match node a (30%, not over the threshold): the smaller tree wins.
    assert picker.pick(shared.extended(7, ids)) == (1 - a, "smallest_tree")


def test_far_out_of_balance_the_idlest_node_is_taken() -> None:
    ids = BlockIds()
    picker = CacheAwarePicker(2, 16)
    history = BlockChain().extended(10, ids)
    home, _ = picker.pick(history)
    picker.in_flight[home] = 100
    picker.in_flight[1 - home] = 10
    assert picker.pick(history.extended(2, ids)) == (1 - home, "balance")
    picker.done(1 - home)
    assert picker.in_flight[1 - home] == 10


def test_conversations_stay_on_their_prefill_node_as_vllm_router_keeps_them() -> None:
    config = SimConfig(cluster=ClusterSpec(prefill_nodes=2, decode_nodes=2))
    turns = [
        Turn(0.0, "a", 0, 2_000, 10),
        Turn(0.001, "b", 0, 2_000, 10),
        Turn(5.0, "a", 1, 3_000, 10, reused_prefix_tokens=2_010, previous_context_tokens=2_010),
        Turn(5.001, "b", 1, 3_000, 10, reused_prefix_tokens=2_010, previous_context_tokens=2_010),
    ]
    result = simulator_for(BASELINES["cache-aware"], config).run(turns)
    assert result.summary.decisions == {"cache_aware_smallest_tree": 2, "cache_aware_prefix_match": 2}
    # Each follow-up found its history in its P's cache: 2,000 of its 3,000 tokens (whole blocks).
    assert result.summary.cached_tokens == 2 * 2_000


def test_vllm_router_is_simulated_by_its_own_policy() -> None:
    assert LIVE_COUNTERPARTS["vllm-router"] == "cache-aware"
    chats = Workload(turns=3, first_tokens=1400, user_tokens=900, answer_tokens=16, min_conversations=4)
    sim = simulate(chats, 4)
    assert sim["vllm-router"].reuse_share >= sim["example-proxy"].reuse_share
