"""Prefill nodes' prefix caches: a hit, an eviction, and a pull that fills one."""

from __future__ import annotations

from dataclasses import replace

from kvplane.bench.sim import BASELINES, ClusterSpec, SimConfig, simulator_for
from kvplane.bench.sim.block_chain import BlockChain, BlockIds
from kvplane.bench.sim.prefix_cache import PrefixCache
from kvplane.bench.workloads.turns import Turn

BLOCK = 16
ROOMY = SimConfig(cluster=ClusterSpec(prefill_nodes=1, decode_nodes=1, decode_kv_capacity_bytes=80 << 30))


def _conversation(*prompts: int, output: int = 200) -> list[Turn]:
    """Turns 60 s apart, each prompt extending the previous context exactly."""
    turns, previous = [], 0
    for k, prompt in enumerate(prompts):
        turns.append(Turn(60.0 * k, "c", k, prompt, output, previous, previous))
        previous = prompt + output
    return turns


def test_a_cache_hits_the_leading_blocks_it_holds() -> None:
    ids = BlockIds()
    history = BlockChain().extended(10, ids)
    cache = PrefixCache(100)
    cache.insert(history)
    assert cache.hit_blocks(history.extended(5, ids)) == 10
    assert cache.hit_blocks(history.prefix(4).extended(3, ids)) == 4
    assert cache.hit_blocks(BlockChain().extended(3, ids)) == 0


def test_a_full_cache_evicts_the_least_recently_used_prompt_tail_first() -> None:
    ids = BlockIds()
    old = BlockChain().extended(6, ids).extended(4, ids)  # head run of 6, tail run of 4
    new = BlockChain().extended(8, ids)
    cache = PrefixCache(14)
    cache.insert(old)
    cache.insert(new)
    assert cache.used_blocks == 14
    assert cache.hit_blocks(new) == 8
    assert cache.hit_blocks(old) == 6  # its tail run went first; its head stays
    cache.insert(BlockChain().extended(8, ids))
    assert cache.hit_blocks(old) == 0 and cache.hit_blocks(new) == 6


def test_pinned_blocks_are_hit_never_evicted_and_take_none_of_the_free_room() -> None:
    ids = BlockIds()
    pinned, other, newer = (BlockChain().extended(n, ids) for n in (40, 30, 30))
    cache = PrefixCache(30)  # room for 30 free blocks
    cache.journal = []
    cache.insert(pinned, pin=True)
    cache.insert(other)
    cache.insert(newer)
    # The pinned chain is the oldest, yet only the unpinned `other` made room for `newer`.
    assert cache.hit_blocks(pinned) == 40 and cache.pinned_blocks == 40
    assert cache.hit_blocks(other) == 0 and cache.hit_blocks(newer) == 30
    assert cache.used_blocks == 70
    # Freed, it is the most recently used: what the free room cannot hold goes from `newer` first.
    cache.unpin(pinned)
    assert cache.pinned_blocks == 0 and cache.used_blocks == 30
    assert cache.hit_blocks(pinned) == 30 and cache.hit_blocks(newer) == 0
    # The events say so: nothing of the pinned chain was removed until it was freed.
    first_pinned = next(base for _, base, _ in pinned.runs())
    removed = [held for base, held in cache.journal if base == first_pinned and held < 40]
    assert removed == [30]


def test_a_run_pinned_twice_stays_pinned_until_both_pins_go() -> None:
    ids = BlockIds()
    head = BlockChain().extended(20, ids)
    longer = head.extended(10, ids)
    cache = PrefixCache(0)  # no free room: only pins hold blocks
    cache.insert(head, pin=True)
    cache.insert(longer, pin=True)
    assert cache.hit_blocks(longer) == 30
    cache.unpin(longer)
    assert cache.hit_blocks(longer) == 20 and cache.pinned_blocks == 20
    cache.unpin(head)
    assert cache.hit_blocks(head) == 0 and cache.used_blocks == 0 and cache.pinned_blocks == 0


def test_a_turn_computes_only_what_its_prefill_node_does_not_hold() -> None:
    turns = _conversation(4000, 4400)
    cached = simulator_for(BASELINES["no-reuse"], ROOMY).run(turns).summary
    cold_config = replace(ROOMY, cluster=replace(ROOMY.cluster, prefill_cache_bytes=0))
    cold = simulator_for(BASELINES["no-reuse"], cold_config).run(turns).summary
    # P computed turn 0's prompt, not its answer: the whole prompt is held, the answer is not.
    assert cached.cached_tokens == 4000 and cached.reused_tokens == 4000 and cold.cached_tokens == 0
    assert cached.ttft_mean_ms < cold.ttft_mean_ms


def test_a_pull_moves_only_what_the_prefill_node_lacks() -> None:
    turns = _conversation(4000, 4400)
    s = simulator_for(BASELINES["vllm-proxy"], ROOMY).run(turns).summary
    # remote_num_tokens is the 4,200-token context; P already holds the 4,000-token prompt.
    assert s.decisions["pull"] == 1
    assert s.cached_tokens == 4000 and s.pulled_tokens == 200


def test_a_pull_fills_the_prefill_nodes_cache() -> None:
    config = replace(ROOMY, cluster=replace(ROOMY.cluster, prefill_nodes=2))
    turns = _conversation(4000, 4400)
    sim = simulator_for(BASELINES["vllm-proxy"], config)
    s = sim.run(turns).summary
    # Round-robin: turn 1 on the other P, which holds nothing and pulls the whole context.
    assert s.cached_tokens == 0 and s.pulled_tokens == 4200
    assert sorted(p.cache.used_blocks for p in sim.fleet.prefill) == [4000 // BLOCK, 4400 // BLOCK]


def test_the_oracle_uses_every_cache_hit_and_pulls_the_rest() -> None:
    turns = _conversation(4000, 4400, 5000)
    s = simulator_for(BASELINES["oracle"], ROOMY).run(turns).summary
    # It pulls whole verified blocks: each 4,200- and 4,600-token context up to its last whole block.
    assert s.cached_tokens == 4000 + 4400 and s.pulled_tokens == (4192 - 4000) + (4592 - 4400)
