"""Block content, the block pool and its leases: what makes every pulled block checkable."""

from __future__ import annotations

import numpy as np
import pytest

from kvplane.connector.simengine.block_content import (
    BlockCheck,
    ContentModel,
    block_hashes,
    full_block_hashes,
    lease_stamp,
    root_hash,
)
from kvplane.connector.simengine.block_pool import BlockPool, KvCacheFullError

BS = 4
ROOT = root_hash("m")


def pool(n: int = 16) -> BlockPool:
    return BlockPool(n, 128, BS, ROOT)


def test_block_hash_depends_on_the_whole_prefix() -> None:
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], BS, ROOT)
    b = block_hashes([9, 2, 3, 4, 5, 6, 7, 8], BS, ROOT)
    assert a[0] != b[0] and a[1] != b[1], "a change in block 0 must change every later block"
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], BS, root_hash("other"))[0] != a[0]


def test_partial_block_hash_differs_from_the_full_block() -> None:
    full = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], BS, ROOT)
    partial = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], BS, ROOT, num_tokens=6)
    assert partial[0] == full[0] and partial[1] != full[1] and len(partial) == 2
    assert full_block_hashes([1, 2, 3, 4, 5, 6], BS, ROOT) == full[:1]


def test_check_detects_wrong_prefix_and_missing_lease() -> None:
    cm = ContentModel(128)
    block = np.zeros(16, dtype=np.uint64)
    h = block_hashes([1, 2, 3, 4], BS, ROOT)[0]
    stamp = lease_stamp("e", "i", "r")
    cm.write_payload(block, h, 0)
    cm.set_trailer(block, stamp)
    assert cm.check(block, h, 0, stamp) is BlockCheck.OK
    assert cm.check(block, h, 1, stamp) is BlockCheck.WRONG_PREFIX, "the position is part of the content"
    assert cm.check(block, h ^ 1, 0, stamp) is BlockCheck.WRONG_PREFIX
    assert cm.check(block, h, 0, lease_stamp("e", "i2", "r")) is BlockCheck.NOT_LEASED
    cm.clear_trailer(block)
    assert cm.check(block, h, 0, stamp) is BlockCheck.NOT_LEASED


def test_content_model_rejects_tiny_or_unaligned_blocks() -> None:
    with pytest.raises(ValueError):
        ContentModel(32)
    with pytest.raises(ValueError):
        ContentModel(130)


def test_freed_whole_blocks_stay_cached_and_partial_ones_are_poisoned() -> None:
    p = pool()
    tokens = list(range(10, 20))  # 2 whole blocks + 2 tokens
    blocks = p.allocate(3)
    p.write_tokens(blocks, tokens, len(tokens))
    hashes = block_hashes(tokens, BS, ROOT)
    p.release(blocks)
    assert p.free_blocks == 16
    assert p.match_prefix(full_block_hashes(tokens, BS, ROOT)) == blocks[:2]
    words = p.content.payload_words
    assert np.array_equal(p.block(blocks[0])[:words], p.content.payload(hashes[0], 0))
    assert not np.array_equal(p.block(blocks[2])[:words], p.content.payload(hashes[2], 2))


def test_allocation_evicts_cached_blocks_last_and_drops_their_cache_entry() -> None:
    p = pool(4)
    tokens = list(range(8))
    blocks = p.allocate(2)
    p.write_tokens(blocks, tokens, 8)
    p.release(blocks)
    p.allocate(2)  # the two never-used blocks go first
    assert p.match_prefix(full_block_hashes(tokens, BS, ROOT)) == blocks
    p.allocate(1)
    assert p.match_prefix(full_block_hashes(tokens, BS, ROOT)) == []
    with pytest.raises(KvCacheFullError):
        p.allocate(2)


def test_lease_copies_a_block_already_leased_to_another_handle() -> None:
    p = pool()
    tokens = list(range(8))
    a = p.allocate(2)
    p.write_tokens(a, tokens, 8)
    s1, s2 = lease_stamp("e", "i", "r1"), lease_stamp("e", "i", "r2")
    a = p.lease(a, s1).block_ids
    p.acquire(a)  # a second request shares the cached prefix
    second = p.lease(a, s2)
    b = second.block_ids
    assert (second.copied, second.restamped) == (2, 0)
    assert set(a).isdisjoint(b), "each block carries one lease"
    h = block_hashes(tokens, BS, ROOT)
    assert all(p.content.check(p.block(x), h[i], i, s2) is BlockCheck.OK for i, x in enumerate(b))
    p.unlease(a, s1)
    p.release(a)
    assert all(p.content.check(p.block(x), h[i], i, s1) is BlockCheck.NOT_LEASED for i, x in enumerate(a))
    assert all(p.content.check(p.block(x), h[i], i, s2) is BlockCheck.OK for i, x in enumerate(b))


def test_releasing_more_than_acquired_is_an_error() -> None:
    p = pool()
    (b,) = p.allocate(1)
    p.release([b])
    with pytest.raises(RuntimeError):
        p.release([b])


def test_lease_restamps_shared_blocks_when_copies_would_eat_the_reserve() -> None:
    p = pool(4)
    tokens = list(range(8))
    a = p.allocate(2)
    p.write_tokens(a, tokens, 8)
    s1, s2 = lease_stamp("e", "i", "r1"), lease_stamp("e", "i", "r2")
    p.lease(a, s1)
    p.acquire(a)
    second = p.lease(a, s2, reserve_blocks=1)  # 2 free, copying 2 would leave 0 < 1
    assert second.block_ids == a and (second.copied, second.restamped) == (0, 2)
    h = block_hashes(tokens, BS, ROOT)
    assert all(p.content.check(p.block(x), h[i], i, s2) is BlockCheck.OK for i, x in enumerate(a))
    assert all(p.content.check(p.block(x), h[i], i, s1) is BlockCheck.NOT_LEASED for i, x in enumerate(a))
    p.unlease(a, s1)  # freeing the voided handle leaves the newer stamp alone
    p.release(a)
    assert all(p.content.check(p.block(x), h[i], i, s2) is BlockCheck.OK for i, x in enumerate(a))
