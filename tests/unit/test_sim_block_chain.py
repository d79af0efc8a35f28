"""Simulated block chains prove prefixes through the real digest comparison."""

from __future__ import annotations

from kvplane.bench.sim.block_chain import BlockChain, BlockIds, handle_digests
from kvplane.connector.digests import verified_prefix_blocks_from_chain


def test_a_continuation_verifies_every_block_of_the_handle() -> None:
    ids = BlockIds()
    context = BlockChain().extended(100, ids).extended(7, ids)
    prompt = context.extended(20, ids)
    assert verified_prefix_blocks_from_chain(handle_digests(context, 16), prompt) == 107


def test_an_edited_history_verifies_only_its_shared_prefix() -> None:
    ids = BlockIds()
    context = BlockChain().extended(100, ids)
    edited = context.prefix(60).extended(50, ids)
    verified = verified_prefix_blocks_from_chain(handle_digests(context, 16), edited)
    assert 0 < verified <= 60


def test_runs_index_like_a_flat_list() -> None:
    ids = BlockIds()
    chain = BlockChain().extended(3, ids).extended(2, ids)
    assert list(chain) == [1, 2, 3, 4, 5]
    assert list(chain.prefix(4).extended(2, ids)) == [1, 2, 3, 4, 6, 7]
    assert chain[-1] == 5 and list(chain[1:3]) == [2, 3]
