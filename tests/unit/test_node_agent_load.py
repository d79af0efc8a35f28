"""Which load changes the node agent reports before its heartbeat."""

from __future__ import annotations

import dataclasses

import pytest

from kvplane.connector.node_agent.load import load_changed, memory_changed
from kvplane.services.common.model.nodes import NodeLoad

BASE = NodeLoad(
    "d0",
    "inc",
    queued_requests=2,
    queued_prefill_tokens=4096,
    running_requests=8,
    free_kv_blocks=5000,
    total_kv_blocks=10_000,
    retained_bytes=1 << 30,
    reported_unix_ms=1,
)


@pytest.mark.parametrize(
    ("changes", "reported"),
    [
        ({}, False),
        ({"reported_unix_ms": 2}, False),  # the same load, later: the heartbeat's to send
        ({"queued_requests": 3}, True),
        ({"queued_prefill_tokens": 4097}, True),
        ({"waiting_kv_blocks": 1}, True),  # a request began to wait for memory
        ({"running_requests": 7}, True),
        ({"retained_bytes": (1 << 30) - 1}, True),
        ({"total_kv_blocks": 10_001}, True),
        ({"free_kv_blocks": 5099}, False),  # under 1% of the blocks
        ({"free_kv_blocks": 4900}, True),
        ({"free_kv_blocks": 5100}, True),
    ],
)
def test_a_load_is_reported_at_once_when_it_changed_materially(
    changes: dict[str, int], reported: bool
) -> None:
    assert load_changed(BASE, dataclasses.replace(BASE, **changes)) is reported


def test_one_free_block_counts_on_a_small_cache() -> None:
    small = NodeLoad("d0", "inc", free_kv_blocks=7, total_kv_blocks=9)
    assert load_changed(small, dataclasses.replace(small, free_kv_blocks=6))


@pytest.mark.parametrize(
    ("changes", "reported"),
    [
        ({}, False),
        # Request counts are the stream's to carry, not etcd's.
        ({"queued_requests": 3, "running_requests": 1, "queued_prefill_tokens": 0}, False),
        ({"free_kv_blocks": 5499}, False),  # under 5% of the blocks
        ({"free_kv_blocks": 5500}, True),
        ({"total_kv_blocks": 10_001}, True),
        ({"retained_bytes": (1 << 30) + (1 << 26)}, False),  # 6% more
        ({"retained_bytes": (1 << 30) + (1 << 27)}, True),  # 11% more
        ({"retained_bytes": 0}, True),
    ],
)
def test_while_routing_gets_the_load_on_its_streams_etcd_hears_only_memory_changes(
    changes: dict[str, int], reported: bool
) -> None:
    assert memory_changed(BASE, dataclasses.replace(BASE, **changes)) is reported


def test_retained_bytes_appearing_count_as_a_memory_change_only_when_the_capacity_is_unknown() -> None:
    empty = dataclasses.replace(BASE, retained_bytes=0)
    assert memory_changed(empty, dataclasses.replace(empty, retained_bytes=1))
    assert memory_changed(BASE, dataclasses.replace(BASE, retained_bytes=0))
    # One conversation's lease or handle, kept and read once a turn: a small share of the node.
    one = dataclasses.replace(empty, retained_bytes=1 << 20)
    assert not memory_changed(empty, one, capacity_bytes=1 << 40)
    assert not memory_changed(one, empty, capacity_bytes=1 << 40)
    assert memory_changed(empty, dataclasses.replace(empty, retained_bytes=1 << 36), capacity_bytes=1 << 40)


# A node of 32 GiB of KV: 5% of it is 1.6 GiB.
CAPACITY = 32 << 30
FIVE_PERCENT = -(-CAPACITY // 20)


@pytest.mark.parametrize(
    ("retained", "reported"),
    [
        # A conversation's handle published or released: a large share of what the node
        # retains, a small one of what it holds.
        ((1 << 30) + (1 << 29), False),
        ((1 << 30) - (1 << 29), False),
        # Enough to move the node across an eviction watermark by more than free blocks may.
        ((1 << 30) + FIVE_PERCENT, True),
        ((1 << 30) + FIVE_PERCENT - 1, False),
    ],
)
def test_retained_bytes_count_by_the_share_of_the_capacity_they_moved_when_it_is_known(
    retained: int, reported: bool
) -> None:
    now = dataclasses.replace(BASE, retained_bytes=retained)
    assert memory_changed(BASE, now, capacity_bytes=CAPACITY) is reported
