"""The sim-engine's KV event publisher on real ZMQ sockets: vLLM's frames, its replay, its faults."""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest

from kvplane.connector.simengine.kv_event_publisher import KVEventPublisher
from kvplane.connector.simengine.kv_events_config import KVEventsConfig
from kvplane.services.common.model.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Encoding,
)
from kvplane.services.common.runtime.ports import free_port
from tests.support.kv_events import EventReader, ipc_dir

STORED = BlockStored(
    block_ids=(11, 12),
    parent_id=10,
    token_ids=tuple(range(8)),
    block_size=4,
    extra_keys=(["tenant-a"], None),  # decoded, an entry reads back as a list
    group_idx=0,
    session_id="conv-1",
)
REMOVED = BlockRemoved(block_ids=(10,), group_idx=0)
CLEARED = AllBlocksCleared()


@pytest.fixture
def endpoints() -> Iterator[tuple[str, str]]:
    with ipc_dir() as d:
        yield f"ipc://{d}/pub", f"ipc://{d}/replay"


def started(endpoint: str, replay: str | None, **config: object) -> KVEventPublisher:
    publisher = KVEventPublisher(
        KVEventsConfig(enable_kv_cache_events=True, endpoint=endpoint, replay_endpoint=replay, **config)  # type: ignore[arg-type]
    )
    publisher.start()
    return publisher


def warm(reader: EventReader, publisher: KVEventPublisher) -> int:
    """Publish until the subscription is live; the sequence number the next batch gets."""
    return reader.warm(lambda: publisher.publish([CLEARED]), lambda: publisher.next_seq)


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_every_event_type_goes_out_in_either_encoding(encoding: Encoding, endpoints: tuple[str, str]) -> None:
    pub_ep, replay_ep = endpoints
    publisher = started(pub_ep, replay_ep, encoding=encoding, topic="kv@p-0")
    try:
        with EventReader(pub_ep, replay_ep) as reader:
            first = warm(reader, publisher)
            publisher.publish([STORED, REMOVED])
            publisher.publish([CLEARED])
            a, b = reader.next(), reader.next()
    finally:
        publisher.close()
    assert (a.topic, a.seq, b.seq) == (b"kv@p-0", first, first + 1)
    assert a.decoded.events == (STORED, REMOVED) and b.decoded.events == (CLEARED,)
    assert a.decoded.data_parallel_rank == 0, "vLLM's publisher stamps its data-parallel rank"
    ts, raw_events, rank = msgspec.msgpack.decode(a.payload)
    assert rank == 0 and ts > 0
    if encoding == "map":
        assert raw_events[0]["type"] == "BlockStored" and raw_events[0]["extra_keys"] == [["tenant-a"], None]
        assert raw_events[1]["type"] == "BlockRemoved"
    else:
        assert raw_events[0][0] == "BlockStored" and raw_events[0][1] == [11, 12]
        assert raw_events[1][0] == "BlockRemoved"


def test_loopback_tcp_wildcard_is_bound_and_read_on_127_0_0_1() -> None:
    port, replay_port = free_port(), free_port()
    publisher = started(f"tcp://*:{port}", f"tcp://*:{replay_port}")
    try:
        with EventReader(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay_port}") as reader:
            warm(reader, publisher)
            seq = publisher.publish([REMOVED])
            assert reader.drain_until(lambda b: b.seq == seq)[-1].decoded.events == (REMOVED,)
            assert [b.seq for b in reader.replay(seq)] == [seq]
    finally:
        publisher.close()


def test_replay_returns_the_buffered_batches_from_a_sequence_number_then_the_end_marker(
    endpoints: tuple[str, str],
) -> None:
    pub_ep, replay_ep = endpoints
    publisher = started(pub_ep, replay_ep, buffer_steps=4)
    try:
        seqs = [publisher.publish([BlockRemoved(block_ids=(i,))]) for i in range(6)]
        assert seqs == list(range(6)), "numbered from 0 at each start"
        with EventReader(pub_ep, replay_ep) as reader:
            assert publisher.next_seq == 6
            replayed = reader.replay(3)
            assert [b.seq for b in replayed] == [3, 4, 5]
            assert [b.decoded.events[0] for b in replayed] == [
                BlockRemoved(block_ids=(i,)) for i in (3, 4, 5)
            ]
            # Only the last buffer_steps batches are kept.
            assert [b.seq for b in reader.replay(0)] == [2, 3, 4, 5]
            assert reader.replay(6) == []
    finally:
        publisher.close()


def test_a_dropped_batch_is_a_sequence_gap_that_the_replay_fills(endpoints: tuple[str, str]) -> None:
    pub_ep, replay_ep = endpoints
    publisher = started(pub_ep, replay_ep)
    try:
        with EventReader(pub_ep, replay_ep) as reader:
            first = warm(reader, publisher)
            publisher.drop_next(2)
            for i in range(3):
                publisher.publish([BlockRemoved(block_ids=(i,))])
            live = reader.next()
            assert live.seq == first + 2, "batches first and first+1 never went out"
            assert publisher.state()["dropped_on_purpose"] == 2
            gap = reader.replay(first)
            assert [b.seq for b in gap] == [first, first + 1, first + 2]
            assert [b.decoded.events for b in gap] == [(BlockRemoved(block_ids=(i,)),) for i in range(3)]
    finally:
        publisher.close()


def test_a_paused_stream_holds_its_batches_and_sends_them_in_order_on_resume(
    endpoints: tuple[str, str],
) -> None:
    pub_ep, replay_ep = endpoints
    publisher = started(pub_ep, replay_ep)
    try:
        with EventReader(pub_ep, replay_ep) as reader:
            first = warm(reader, publisher)
            publisher.pause()
            for i in range(3):
                publisher.publish([BlockRemoved(block_ids=(i,))])
            assert reader.replay(first) == [], "held batches are neither sent nor buffered"
            assert reader.pending() == []
            assert publisher.state()["queued"] == 3
            publisher.resume()
            assert [reader.next().seq for _ in range(3)] == [first, first + 1, first + 2]
    finally:
        publisher.close()


def test_a_full_queue_drops_the_batch_and_spends_its_number(endpoints: tuple[str, str]) -> None:
    pub_ep, replay_ep = endpoints
    publisher = started(pub_ep, replay_ep, max_queue_size=2)
    try:
        with EventReader(pub_ep, replay_ep) as reader:
            first = warm(reader, publisher)
            publisher.pause()
            seqs = [publisher.publish([BlockRemoved(block_ids=(i,))]) for i in range(3)]
            assert seqs == [first, first + 1, first + 2]
            assert publisher.state()["dropped_queue_full"] == 1
            publisher.resume()
            assert [reader.next().seq for _ in range(2)] == [first, first + 1]
            publisher.publish([CLEARED])
            # The next batch follows a gap that no replay fills.
            assert reader.next().seq == first + 3
            assert [b.seq for b in reader.replay(first)] == [first, first + 1, first + 3]
    finally:
        publisher.close()


def test_a_new_publisher_on_the_same_endpoints_counts_from_zero_again(endpoints: tuple[str, str]) -> None:
    pub_ep, replay_ep = endpoints
    publisher = started(pub_ep, replay_ep)
    for _ in range(3):
        publisher.publish([CLEARED])
    publisher.close()
    restarted = started(pub_ep, replay_ep)
    try:
        assert restarted.publish([REMOVED]) == 0
        with EventReader(pub_ep, replay_ep) as reader:
            replayed = reader.replay(0)
        assert [(b.seq, b.decoded.events) for b in replayed] == [(0, (REMOVED,))]
    finally:
        restarted.close()


def test_a_tcp_endpoint_in_use_fails_the_start() -> None:
    port = free_port()
    holder = started(f"tcp://127.0.0.1:{port}", None)
    try:
        with pytest.raises(Exception, match=r"(?i)address already in use"):
            started(f"tcp://127.0.0.1:{port}", None)
    finally:
        holder.close()
