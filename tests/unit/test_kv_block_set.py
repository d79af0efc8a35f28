"""The node agent's block set: depths from parents, untrusted orphans, per medium, bounded deltas."""

from __future__ import annotations

from kvplane.connector.kv_events.block_set import UNKNOWN_DEPTH, BlockSet
from kvplane.services.common.model.kv_events import AllBlocksCleared, BlockRemoved, BlockStored


def stored(ids: list[int], parent: int | None, medium: str | None = "GPU") -> BlockStored:
    return BlockStored(tuple(ids), parent, tuple(range(16 * len(ids))), 16, medium)


def test_depths_follow_the_parent_chain_across_events() -> None:
    blocks = BlockSet()
    blocks.apply([stored([1, 2], None), stored([3], 2)])
    assert [blocks.depth(b) for b in (1, 2, 3)] == [1, 2, 3]
    assert sorted(blocks.forwarded()) == [1, 2, 3]


def test_a_block_whose_parent_is_unknown_is_kept_but_never_forwarded() -> None:
    blocks = BlockSet()
    blocks.apply([stored([7, 8], parent=99)])
    assert blocks.depth(7) == UNKNOWN_DEPTH and blocks.depth(8) == UNKNOWN_DEPTH
    assert list(blocks.forwarded()) == []
    assert blocks.stats.orphaned == 2


def test_an_orphan_chain_that_reaches_a_known_block_is_known_from_there() -> None:
    blocks = BlockSet()
    blocks.apply([stored([1], None), stored([5, 1, 6], parent=99)])
    assert blocks.depth(5) == UNKNOWN_DEPTH
    assert blocks.depth(6) == 2


def test_media_are_kept_apart_and_only_the_gpu_is_forwarded_by_default() -> None:
    blocks = BlockSet()
    blocks.apply([stored([1, 2], None), stored([1, 2], None, medium="CPU"), stored([3], None, medium=None)])
    blocks.apply([BlockRemoved((2,), "GPU")])
    assert blocks.count("GPU") == 2 and blocks.count("CPU") == 2
    assert sorted(blocks.forwarded()) == [1, 3]


def test_a_cpu_chain_continues_from_its_gpu_parent() -> None:
    blocks = BlockSet()
    blocks.apply([stored([1], None), stored([2], 1, medium="CPU")])
    assert blocks.depth(2, "CPU") == 2


def named(ids: list[int], medium: str) -> BlockStored:
    """A store that names its blocks only (vLLM's offloading placeholders): no parent, no tokens."""
    return BlockStored(tuple(ids), None, (), 0, medium)


def test_a_copy_named_without_its_chain_takes_its_original_depth_not_a_chain_start() -> None:
    blocks = BlockSet(forwarded_media=("GPU", "CPU"))
    cursor = blocks.cursor()
    blocks.snapshot_for(cursor)
    blocks.apply([stored([1, 2, 3], None)])
    # The copies come one per event and in any order; unknown blocks are no first blocks.
    blocks.apply([named([3], "CPU"), named([1], "CPU"), named([2], "CPU"), named([9], "CPU")])
    assert [blocks.depth(b, "CPU") for b in (1, 2, 3)] == [1, 2, 3]
    assert blocks.depth(9, "CPU") == UNKNOWN_DEPTH
    assert blocks.stats.orphaned == 1
    assert cursor.take() == ([1, 2, 3], [])
    # A copy already known keeps its depth when it is named again.
    blocks.apply([named([2], "CPU")])
    assert blocks.depth(2, "CPU") == 2 and blocks.count("CPU") == 4


def test_held_prefix_counts_leading_blocks_each_at_its_own_depth() -> None:
    blocks = BlockSet()
    blocks.apply([stored([1, 2, 3, 4], None), named([1, 2, 4], "CPU"), stored([7, 8], parent=99)])
    assert blocks.held_prefix([1, 2, 3, 4]) == 4
    assert blocks.held_prefix([1, 2, 3, 4], "CPU") == 2  # the third is missing
    assert blocks.held_prefix([2, 3], "GPU") == 0  # held, but not as a chain's first block
    assert blocks.held_prefix([7, 8]) == 0  # no known depth
    assert blocks.held_prefix([], "CPU") == 0


def test_all_blocks_cleared_empties_the_set_and_asks_every_cursor_for_a_snapshot() -> None:
    blocks = BlockSet()
    cursor = blocks.cursor()
    blocks.snapshot_for(cursor)
    blocks.apply([stored([1, 2], None), AllBlocksCleared(), stored([3], 2)])
    assert len(blocks) == 1 and blocks.stats.resets == 1
    assert cursor.needs_snapshot
    assert blocks.snapshot_for(cursor) == []  # 3's parent went with the reset


def test_a_cursor_coalesces_what_was_stored_and_removed_since_it_last_took() -> None:
    blocks = BlockSet()
    blocks.apply([stored([1, 2], None)])
    cursor = blocks.cursor()
    assert blocks.snapshot_for(cursor) == [1, 2]
    blocks.apply([stored([3, 4], 2), BlockRemoved((4,), "GPU"), BlockRemoved((1,), "GPU")])
    blocks.apply([stored([1], None)])
    # 4 came and went unseen; 1 went and came back: the consumer holds it already.
    assert cursor.take() == ([1, 3], [])
    blocks.apply([BlockRemoved((3,), "GPU")])
    assert cursor.take() == ([], [3])


def test_a_cursor_whose_delta_outgrows_its_bound_asks_for_a_snapshot() -> None:
    blocks = BlockSet(max_pending=4)
    cursor = blocks.cursor()
    blocks.snapshot_for(cursor)
    blocks.apply([stored(list(range(1, 7)), None)])
    assert cursor.needs_snapshot and not cursor.added
    assert blocks.snapshot_for(cursor) == [1, 2, 3, 4, 5, 6]


def test_only_checkpoint_depths_are_forwarded() -> None:
    blocks = BlockSet(checkpoint_blocks=4)
    cursor = blocks.cursor()
    blocks.snapshot_for(cursor)
    blocks.apply([stored(list(range(101, 111)), None)])
    assert sorted(blocks.forwarded()) == [104, 108]
    assert cursor.take() == ([104, 108], [])


def test_more_blocks_than_the_bound_means_missed_removals_and_resets() -> None:
    blocks = BlockSet(max_blocks=3)
    blocks.apply([stored([1, 2], None), stored([3, 4], 2)])
    assert len(blocks) == 0 and blocks.stats.overflows == 1
