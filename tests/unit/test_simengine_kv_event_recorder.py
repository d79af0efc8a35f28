"""The sim-engine's block pool as vLLM's KV events tell it (no sockets): what enters and leaves
the prefix cache, under vLLM's block hashes."""

from __future__ import annotations

import asyncio

from kvplane.connector.simengine.block_content import full_block_hashes, root_hash, salt_key
from kvplane.connector.simengine.block_pool import BlockPool
from kvplane.connector.simengine.kv_event_recorder import KVEventRecorder
from kvplane.services.common.model.block_hashes import BlockHasher
from kvplane.services.common.model.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

BS = 4
ROOT = root_hash("m")


def wired(n: int = 16) -> tuple[BlockPool, KVEventRecorder, list[list[KVEvent]]]:
    pool = BlockPool(n, 128, BS, ROOT)
    batches: list[list[KVEvent]] = []
    recorder = KVEventRecorder(BlockHasher(BS), batches.append)
    pool.on_uncached = recorder.evicted
    return pool, recorder, batches


def write(
    pool: BlockPool,
    recorder: KVEventRecorder,
    tokens: list[int],
    salt: str | None = None,
    session: str | None = None,
) -> list[int]:
    """One request's prompt, prefilled into fresh blocks; returns its blocks (still held)."""
    blocks = pool.allocate(-(-len(tokens) // BS))
    cached: list[int] = []
    chain = full_block_hashes(tokens, BS, ROOT)
    pool.write_tokens(blocks, tokens, len(tokens), 0, chain, salt_key(salt), cached)
    recorder.stored(recorder.request(salt, session), tokens, blocks, cached)
    return blocks


def test_stored_blocks_are_named_by_vllms_hashes_with_the_salt_on_block_zero() -> None:
    pool, recorder, batches = wired()
    prompt = list(range(100, 110))
    write(pool, recorder, prompt, salt="s", session="conv")
    recorder.flush()
    ids = BlockHasher(BS).ids(prompt, cache_salt="s")
    assert batches == [
        [
            BlockStored(
                block_ids=tuple(ids),
                parent_id=None,
                token_ids=tuple(prompt[:8]),
                block_size=BS,
                extra_keys=(("s",), None),
                group_idx=0,
                session_id="conv",
            )
        ]
    ]


def test_a_hash_already_cached_is_not_stored_again_and_runs_keep_their_parents() -> None:
    pool, recorder, batches = wired()
    prompt = list(range(12))
    write(pool, recorder, prompt)
    # The same first two blocks, computed again at once, then a new third block.
    twin = [*prompt[:8], 99, 98, 97, 96]
    write(pool, recorder, twin)
    recorder.flush()
    first, second = batches[0]
    ids = BlockHasher(BS).ids(twin)
    assert isinstance(second, BlockStored)
    assert second.block_ids == (ids[2],) and second.parent_id == ids[1]
    assert isinstance(first, BlockStored) and len(first.block_ids) == 3


def test_eviction_removes_each_hash_once_and_a_reset_is_one_event() -> None:
    pool, recorder, batches = wired(n=4)
    prompt = list(range(16))
    blocks = write(pool, recorder, prompt)
    recorder.flush()
    assert not pool.reset_prefix_cache(), "blocks in use: vLLM refuses the reset"
    pool.release(blocks)
    pool.allocate(1)  # takes the least recently freed cached block
    recorder.flush()
    ids = BlockHasher(BS).ids(prompt)
    assert batches[-1] == [BlockRemoved(block_ids=(ids[0],), group_idx=0)]
    assert pool.reset_prefix_cache() is False  # the allocated block is in use
    pool.release([b for b in range(4) if pool.refcount(b)])
    assert pool.reset_prefix_cache()
    recorder.cleared()
    recorder.flush()
    assert batches[-1] == [AllBlocksCleared()]
    assert pool.match_prefix(full_block_hashes(prompt, BS, ROOT)) == []
    pool.allocate(4)  # reusing the once-cached blocks removes nothing more
    recorder.flush()
    assert batches[-1] == [AllBlocksCleared()]


async def test_the_events_of_one_loop_turn_form_one_batch() -> None:
    pool, recorder, batches = wired()
    write(pool, recorder, list(range(8)))
    write(pool, recorder, list(range(50, 58)))
    assert batches == []
    await asyncio.sleep(0)
    assert len(batches) == 1 and len(batches[0]) == 2
