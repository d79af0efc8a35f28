"""The simulator's KV-event path: a router's view of a prefill cache, late by the lag, with losses."""

from __future__ import annotations

import random

import pytest

from kvplane.bench.sim.block_chain import BlockChain, BlockIds
from kvplane.bench.sim.cache_events import CacheEventFeed
from kvplane.bench.sim.prefix_cache import PrefixCache


@pytest.fixture
def prompts() -> list[BlockChain]:
    """Three conversations' prompts of 20 blocks, the second and third sharing 5 leading blocks."""
    ids = BlockIds()
    shared = BlockChain().extended(5, ids)
    return [BlockChain().extended(20, ids), shared.extended(15, ids), shared.extended(15, ids)]


@pytest.fixture
def prompt(prompts: list[BlockChain]) -> BlockChain:
    return prompts[0]


def _engine_and_feed(
    lag_s: float, loss: float = 0.0, capacity: int = 100
) -> tuple[PrefixCache, CacheEventFeed]:
    cache = PrefixCache(capacity)
    cache.journal = []
    return cache, CacheEventFeed(lag_s, loss, random.Random(7))


def _publish(cache: PrefixCache, feed: CacheEventFeed, now_s: float) -> None:
    assert cache.journal is not None
    feed.publish(now_s, cache.journal)
    cache.journal.clear()


def test_the_view_sees_a_stored_prompt_only_after_the_lag(prompt: BlockChain) -> None:
    cache, feed = _engine_and_feed(lag_s=0.05)
    cache.insert(prompt)
    _publish(cache, feed, now_s=1.0)
    assert cache.hit_blocks(prompt) == len(prompt)
    assert feed.hit_blocks(prompt, now_s=1.04) == 0
    assert feed.hit_blocks(prompt, now_s=1.05) == len(prompt)


def test_with_no_lag_the_view_is_the_engines_cache_through_evictions(prompts: list[BlockChain]) -> None:
    cache, feed = _engine_and_feed(lag_s=0.0, capacity=50)
    for i, prompt in enumerate(prompts):
        cache.insert(prompt)
        _publish(cache, feed, now_s=float(i))
        for seen in prompts[: i + 1]:
            assert feed.hit_blocks(seen, now_s=float(i)) == cache.hit_blocks(seen)


def test_a_lost_removal_leaves_the_view_believing_in_an_evicted_prompt(prompts: list[BlockChain]) -> None:
    cache, feed = _engine_and_feed(lag_s=0.0, capacity=30)
    cache.insert(prompts[0])
    _publish(cache, feed, 0.0)
    feed._loss, feed._rng = 0.999, random.Random(1)  # everything from now on is lost
    cache.insert(prompts[1])
    cache.insert(prompts[2])
    _publish(cache, feed, 1.0)
    assert cache.hit_blocks(prompts[0]) < len(prompts[0])  # evicted on the engine
    assert feed.hit_blocks(prompts[0], 1.0) == len(prompts[0])  # still believed held
    assert feed.lost > 0


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError):
        CacheEventFeed(lag_s=-1)
    with pytest.raises(ValueError):
        CacheEventFeed(loss=1.0)
