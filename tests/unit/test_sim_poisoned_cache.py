"""Poisoned prefill caches: wrong KV imported by an unchecked pull is served again from P's cache."""

from __future__ import annotations

from kvplane.bench.sim import BASELINES, ClusterSpec, SimConfig, SimSummary, simulator_for
from kvplane.bench.sim.block_chain import BlockChain, BlockIds
from kvplane.bench.sim.prefix_cache import PrefixCache
from kvplane.bench.workloads.turns import Turn

BLOCK = 16
CONFIG = SimConfig(cluster=ClusterSpec(prefill_nodes=1, decode_nodes=1))
# Turn 0 leaves a 4,200-token context on D. Turn 1 edits a message at token 2,000: the unchecked
# proxy pulls the whole handle into it, so P's blocks from token 2,000 on hold wrong KV.
EDITED = (
    Turn(0.0, "c", 0, 4000, 200),
    Turn(60.0, "c", 1, 4600, 100, reused_prefix_tokens=2000, previous_context_tokens=4200),
)
# After the proxy forgot the conversation (450 s), turn 2 repeats turn 1's prompt and adds to it:
# nothing is pulled, and P's cache serves turn 1's prompt.
AGAIN = Turn(600.0, "c", 2, 5000, 100, reused_prefix_tokens=4600, previous_context_tokens=4700)


def _run(name: str, turns: tuple[Turn, ...]) -> SimSummary:
    return simulator_for(BASELINES[name], CONFIG).run(list(turns), name).summary


def test_a_poisoned_insert_is_reported_by_later_hits_from_its_first_wrong_block() -> None:
    ids = BlockIds()
    head = BlockChain().extended(10, ids)
    prompt = head.extended(6, ids)
    cache = PrefixCache(100)
    cache.insert(head)
    cache.insert(prompt, poisoned_from=12)
    assert cache.hit(prompt.extended(2, ids)) == (16, 12)
    # The clean head, on its own or followed by other blocks, is served clean.
    assert cache.hit(head.extended(3, ids)) == (10, None)


def test_an_insert_poisons_only_the_blocks_it_adds_not_those_already_held() -> None:
    ids = BlockIds()
    prompt = BlockChain().extended(10, ids)
    cache = PrefixCache(100)
    cache.insert(prompt)
    inserted = prompt.extended(4, ids)
    cache.insert(inserted, poisoned_from=0)
    assert cache.hit(inserted) == (14, 10)
    assert cache.hit(prompt.extended(4, ids)) == (10, None)


def test_evicting_the_poisoned_blocks_ends_the_poison() -> None:
    ids = BlockIds()
    head = BlockChain().extended(6, ids)
    poisoned = head.extended(4, ids)
    cache = PrefixCache(10)
    cache.insert(poisoned, poisoned_from=6)
    cache.insert(BlockChain().extended(4, ids))  # pressure takes the poisoned tail run
    assert cache.hit(poisoned) == (6, None)
    cache.insert(poisoned)  # computed again, right this time
    assert cache.hit(poisoned) == (10, None)


def test_a_later_turn_served_from_poisoned_cache_blocks_is_a_wrong_prefix_turn() -> None:
    s = _run("vllm-proxy", (*EDITED, AGAIN))
    assert s.decisions["pull_wrong_prefix"] == 1 and s.decisions["recompute_no_handle"] == 2
    # Turn 2's hit: turn 1's whole blocks, wrong from token 2,000 on.
    hit = 4600 // BLOCK * BLOCK
    assert s.wrong_prefix_turns == 2
    assert s.wrong_prefix_tokens == 2200 + (hit - 2000)
    # Reuse is only what was right: turn 1's 2,000 cached tokens and turn 2's first 2,000.
    assert s.reused_tokens == s.cached_tokens == 2000 + 2000 and s.pulled_tokens == 0


def test_a_pull_of_a_context_built_on_wrong_kv_is_wrong_too() -> None:
    # Two prefill nodes, round-robin: turn 1 on p1 (nothing cached: all 4,200 pulled tokens wrong),
    # turn 2 on p0, which holds turn 0's clean prompt. Turn 2 extends turn 1's whole context: the
    # pull's prefix matches, but D built that context's KV on the wrong pull.
    config = SimConfig(cluster=ClusterSpec(prefill_nodes=2, decode_nodes=1))
    follow = Turn(120.0, "c", 2, 5000, 100, reused_prefix_tokens=4700, previous_context_tokens=4700)
    s = simulator_for(BASELINES["vllm-proxy"], config).run([*EDITED, follow]).summary
    assert s.decisions["pull"] == 1 and s.wrong_prefix_turns == 2
    # Turn 2: p0's 2,000 clean tokens are reuse; the 2,700 pulled after them are wrong.
    assert s.cached_tokens == 2000 and s.pulled_tokens == 0
    assert s.wrong_prefix_tokens == 4200 + 2700


def test_the_checked_proxy_never_poisons_a_cache() -> None:
    s = _run("vllm-proxy-checked", (*EDITED, AGAIN))
    assert s.wrong_prefix_turns == 0 and s.wrong_prefix_tokens == 0
    assert s.cached_tokens == 2000 + 4600 // BLOCK * BLOCK
