"""The node agent's KV-event subscriber against a real ZMQ publisher (vLLM's wire): gaps filled by
replay, gaps replay cannot fill, engine restarts and replay storms, each leaving a block set that
never claims a block the engine does not hold with its chain."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest

from kvplane.connector.kv_events.block_set import BlockSet
from kvplane.connector.kv_events.source import KVEventsSource
from kvplane.connector.kv_events.subscriber import KVEventsSubscriber, SubscriberLimits
from kvplane.services.common.model.kv_events import AllBlocksCleared, Encoding
from tests.support.kv_event_publisher import EventPublisher, removed, stored
from tests.support.polling import eventually


@asynccontextmanager
async def running(
    publisher: EventPublisher, limits: SubscriberLimits | None = None
) -> AsyncIterator[KVEventsSubscriber]:
    source = KVEventsSource(publisher.endpoint, publisher.replay_endpoint, 16, topic=publisher.topic)
    subscriber = KVEventsSubscriber(source, BlockSet(), limits)
    task = asyncio.create_task(subscriber.run())
    try:
        await publisher.subscribed()
        yield subscriber
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def applied(subscriber: KVEventsSubscriber, batches: int) -> None:
    async def done() -> bool:
        return subscriber.stats.batches >= batches

    await eventually(done, what=f"{batches} batches applied")


def forwarded(subscriber: KVEventsSubscriber) -> list[int]:
    return sorted(subscriber.blocks.forwarded())


@pytest.mark.parametrize("encoding", ["map", "array"])
async def test_batches_in_order_build_the_block_set(encoding: Encoding) -> None:
    async with EventPublisher(encoding=encoding) as pub, running(pub) as sub:
        await pub.publish([stored([1, 2], None)])
        await pub.publish([stored([3], 2), removed([1])])
        await applied(sub, 2)
        assert forwarded(sub) == [2, 3] and sub.blocks.depth(3) == 3
        assert (sub.stats.events, sub.stats.gaps_filled, sub.blocks.stats.resets) == (3, 0, 0)


async def test_a_gap_is_filled_from_the_replay_socket() -> None:
    async with EventPublisher() as pub, running(pub) as sub:
        await pub.publish([stored([1], None)])
        await pub.publish([stored([2], 1)], send=False)
        await pub.publish([stored([3], 2)])
        await applied(sub, 3)
        assert forwarded(sub) == [1, 2, 3]
        assert (sub.stats.gaps_filled, sub.blocks.stats.resets) == (1, 0)


async def test_a_gap_the_replay_buffer_no_longer_holds_resets_the_set() -> None:
    async with EventPublisher() as pub, running(pub) as sub:
        await pub.publish([stored([1], None)])
        await pub.publish([removed([1]), stored([2], None)], send=False)
        pub.forget_buffer()
        await pub.publish([stored([3], 2)])
        await applied(sub, 2)
        # 1 was evicted in the lost batch: it must not be believed held; 3's chain is unknown.
        assert forwarded(sub) == []
        assert (sub.stats.gaps_unfilled, sub.blocks.stats.resets) == (1, 1)
        await pub.publish([stored([4], None)])
        await applied(sub, 3)
        assert forwarded(sub) == [4]


async def test_an_engine_restart_resets_then_replays_the_new_start() -> None:
    async with EventPublisher() as pub, running(pub) as sub:
        await pub.publish([stored([1], None)])
        await pub.publish([stored([2], 1)])
        await applied(sub, 2)
        pub.restart()
        await pub.publish([stored([10], None)], send=False)
        await pub.publish([stored([11], 10)])
        await applied(sub, 4)
        assert forwarded(sub) == [10, 11]
        assert (sub.stats.restarts, sub.stats.gaps_filled) == (1, 1)


async def test_all_blocks_cleared_empties_the_set() -> None:
    async with EventPublisher() as pub, running(pub) as sub:
        await pub.publish([stored([1], None)])
        await pub.publish([AllBlocksCleared(), stored([5], None)])
        await applied(sub, 2)
        assert forwarded(sub) == [5]


async def test_a_replay_storm_is_bounded_and_never_claims_a_block_not_held() -> None:
    limits = SubscriberLimits(max_replays=3, replay_window_s=3600.0)
    async with EventPublisher() as pub, running(pub, limits) as sub:
        held: set[int] = set()
        for i in range(1, 21):
            block = 100 + i
            held.add(block)
            if i % 4 == 0:
                held.discard(block - 1)  # evicted in a batch that may be lost
                await pub.publish([removed([block - 1]), stored([block], None)], send=i % 2 == 1)
            else:
                await pub.publish([stored([block], None)], send=i % 2 == 1)
        await pub.publish([stored([999], None)])
        held.add(999)
        await eventually(lambda: _true(sub.stats.gaps_filled + sub.stats.gaps_unfilled == 10), what="gaps")
        assert pub.replays == 3 and sub.stats.replays == 3
        assert (sub.stats.gaps_filled, sub.stats.gaps_unfilled) == (3, 7)
        assert set(forwarded(sub)) <= held and 999 in forwarded(sub)


async def test_a_gap_longer_than_the_bound_resets_without_a_replay() -> None:
    async with EventPublisher() as pub, running(pub, SubscriberLimits(max_gap_batches=100)) as sub:
        await pub.publish([stored([1], None)])
        for i in range(500):
            await pub.publish([stored([1000 + i], None)], send=False)
        await pub.publish([stored([2], None)])
        await applied(sub, 2)
        assert pub.replays == 0 and sub.stats.gaps_unfilled == 1
        assert forwarded(sub) == [2]


async def test_a_replay_with_a_huge_backlog_is_read_only_to_the_gap_s_end() -> None:
    async with EventPublisher() as pub, running(pub) as sub:
        await pub.publish([stored([1], None)])
        await pub.publish([stored([2], 1)], send=False)
        late = await pub.publish([stored([3], 2)], send=False)
        for i in range(3000):
            await pub.publish([stored([5000 + i], None)], send=False)
        # The batch after the gap arrives once the engine's buffer holds 3,000 more.
        await pub.send_late(late)
        await applied(sub, 3)
        assert pub.replays == 1 and sub.stats.gaps_filled == 1
        assert sub.stats.batches == 3 and forwarded(sub) == [1, 2, 3]


async def _true(value: bool) -> bool:
    return value
