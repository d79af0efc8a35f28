"""Routing's view of prefill engines' caches from their events: exact prefixes, freshness, bounds."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from kvplane.services.common.model.block_hashes import BlockHasher
from kvplane.services.routing.metrics import EngineCacheBlocks
from kvplane.services.routing.state.engine_caches import CacheUpdate, EngineCaches, HashConfig

CONFIG = HashConfig(16, "sha256", "vllm-none-hash")
HASHER = BlockHasher(16)
PROMPT = [(i * 37) % 1000 + 1 for i in range(16 * 10 + 5)]  # 10 whole blocks and 5 tokens


def snapshot(ids: list[int], node: str = "p0", incarnation: str = "i1", **kw: object) -> CacheUpdate:
    config = kw.pop("config", CONFIG)
    return CacheUpdate(node, incarnation, config, True, ids, (), **kw)  # type: ignore[arg-type]


def delta(stored: list[int], removed: list[int], node: str = "p0") -> CacheUpdate:
    return CacheUpdate(node, "i1", CONFIG, False, stored, removed)


def test_the_prefix_held_is_the_run_of_prompt_blocks_from_the_first() -> None:
    caches = EngineCaches()
    ids = HASHER.ids(PROMPT)
    caches.apply(snapshot(ids[:6] + ids[7:]), now_s=0.0)
    assert caches.cached_tokens([("p0", "i1")], PROMPT, None, now_s=1.0) == {"p0": 6 * 16}


def test_a_fresh_view_that_holds_nothing_says_zero() -> None:
    caches = EngineCaches()
    caches.apply(snapshot([]), now_s=0.0)
    assert caches.cached_tokens([("p0", "i1")], PROMPT, None, now_s=0.0) == {"p0": 0}


def test_the_prompt_s_last_token_is_never_counted_as_cached() -> None:
    caches = EngineCaches()
    whole = PROMPT[: 16 * 4]
    caches.apply(snapshot(HASHER.ids(whole)), now_s=0.0)
    # vLLM computes a prompt's last token itself: of 4 whole blocks, 3 can be hits.
    assert caches.cached_tokens([("p0", "i1")], whole, None, now_s=0.0) == {"p0": 3 * 16}


def test_the_tenant_s_salt_changes_every_block_id() -> None:
    caches = EngineCaches()
    caches.apply(snapshot(HASHER.ids(PROMPT, "salt-a")), now_s=0.0)
    assert caches.cached_tokens([("p0", "i1")], PROMPT, "salt-a", now_s=0.0) == {"p0": 160}
    assert caches.cached_tokens([("p0", "i1")], PROMPT, "salt-b", now_s=0.0) == {"p0": 0}
    assert caches.cached_tokens([("p0", "i1")], PROMPT, None, now_s=0.0) == {"p0": 0}


def test_a_view_not_heard_from_within_the_bound_is_stale_and_absent() -> None:
    caches = EngineCaches(stale_after_s=2.0)
    caches.apply(snapshot(HASHER.ids(PROMPT)), now_s=0.0)
    assert "p0" in caches.cached_tokens([("p0", "i1")], PROMPT, None, now_s=2.0)
    assert caches.cached_tokens([("p0", "i1")], PROMPT, None, now_s=2.5) == {}
    caches.apply(delta([], []), now_s=2.6)  # a keep-alive
    assert "p0" in caches.cached_tokens([("p0", "i1")], PROMPT, None, now_s=3.0)


def test_a_view_of_another_incarnation_is_not_used() -> None:
    caches = EngineCaches()
    caches.apply(snapshot(HASHER.ids(PROMPT)), now_s=0.0)
    assert caches.cached_tokens([("p0", "i2")], PROMPT, None, now_s=0.0) == {}


def test_deltas_apply_after_a_snapshot_and_are_refused_without_one() -> None:
    caches = EngineCaches()
    ids = HASHER.ids(PROMPT)
    assert not caches.apply(delta(ids, []), now_s=0.0)
    caches.apply(snapshot(ids[:2]), now_s=0.0)
    caches.apply(delta(ids[2:5], [ids[1]]), now_s=0.1)
    assert caches.cached_tokens([("p0", "i1")], PROMPT, None, now_s=0.2) == {"p0": 16}
    assert caches.stats.rejected == 1


def test_a_snapshot_in_parts_is_used_only_once_complete() -> None:
    caches = EngineCaches()
    ids = HASHER.ids(PROMPT)
    caches.apply(snapshot(ids[:5], snapshot_continues=True), now_s=0.0)
    assert caches.cached_tokens([("p0", "i1")], PROMPT, None, now_s=0.0) == {}
    caches.apply(snapshot(ids[:5]), now_s=0.0)
    caches.apply(CacheUpdate("p0", "i1", CONFIG, True, ids[:3], (), snapshot_continues=True), 0.1)
    caches.apply(CacheUpdate("p0", "i1", CONFIG, False, ids[3:8], ()), now_s=0.2)
    assert caches.cached_tokens([("p0", "i1")], PROMPT, None, now_s=0.2) == {"p0": 128}


def test_checkpoint_views_match_to_their_checkpoints() -> None:
    config = HashConfig(16, "sha256", "vllm-none-hash", checkpoint_blocks=4)
    caches = EngineCaches()
    ids = HASHER.ids(PROMPT)
    caches.apply(snapshot([ids[3], ids[7]], config=config), now_s=0.0)
    assert caches.cached_tokens([("p0", "i1")], PROMPT, None, now_s=0.0) == {"p0": 8 * 16}


def test_each_node_is_matched_with_its_own_hash_configuration() -> None:
    caches = EngineCaches()
    cbor = HashConfig(32, "sha256_cbor", "vllm-none-hash")
    caches.apply(snapshot(BlockHasher(32, "sha256_cbor").ids(PROMPT), node="p1", config=cbor), 0.0)
    caches.apply(snapshot(HASHER.ids(PROMPT)[:2]), now_s=0.0)
    held = caches.cached_tokens([("p0", "i1"), ("p1", "i1")], PROMPT, None, now_s=0.0)
    assert held == {"p0": 32, "p1": 160}


def test_an_unpredictable_hash_algorithm_is_refused() -> None:
    caches = EngineCaches()
    xx = HashConfig(16, "xxhash", "")
    assert not caches.apply(snapshot([1, 2], config=xx), now_s=0.0)
    assert caches.cached_tokens([("p0", "i1")], PROMPT, None, now_s=0.0) == {}


def test_memory_is_bounded_by_nodes_and_blocks_per_node() -> None:
    caches = EngineCaches(max_nodes=2, max_blocks=4)
    assert not caches.apply(snapshot([1, 2, 3, 4, 5]), now_s=0.0)
    assert caches.stats.overflows == 1 and len(caches) == 0
    for node in ("a", "b", "c"):
        caches.apply(snapshot([1], node=node), now_s=0.0)
    assert len(caches) == 2 and caches.blocks("a") == 0


def test_the_blocks_each_view_holds_are_a_gauge_read_at_scrape_time() -> None:
    caches = EngineCaches()
    registry = CollectorRegistry()
    registry.register(EngineCacheBlocks(caches.block_counts))
    assert "kvplane_routing_engine_cache_blocks{" not in generate_latest(registry).decode()
    caches.apply(snapshot(HASHER.ids(PROMPT)), now_s=0.0)
    caches.apply(snapshot(HASHER.ids(PROMPT[:32]), node="d0"), now_s=0.0)
    caches.apply(delta([], HASHER.ids(PROMPT)[:2]), now_s=0.1)
    text = generate_latest(registry).decode()
    assert 'kvplane_routing_engine_cache_blocks{node="p0"} 8.0' in text
    assert 'kvplane_routing_engine_cache_blocks{node="d0"} 2.0' in text
