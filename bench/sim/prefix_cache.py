"""A prefill engine's prefix cache: which leading blocks of a prompt it still holds.

vLLM keeps the KV blocks of every prompt it computed or imported, keyed by
the chained hash of their tokens, and reuses the longest cached prefix of a
new prompt before computing anything. Free blocks are recycled least
recently used first; a finished request frees its blocks tail first, so a
conversation's later blocks go before its shared head.

The simulator's chains are runs of consecutive block values (`BlockChain`),
and a run's value at a position is the same in every chain that shares it.
So the cache keeps, per run (keyed by its first value), how many of the
run's leading blocks it holds, in an LRU order over runs. A prompt hits
runs in order, whole, until the first one held only in part or not at all.
Eviction takes the least recently used run's tail blocks first. This is the
same set of hits vLLM's block-level cache gives as long as a prompt's runs
are touched together, which they always are here: a prompt is touched as a
whole, its head last.
"""

from __future__ import annotations

from collections import OrderedDict

from kvplane.bench.sim.block_chain import BlockChain


class PrefixCache:
    """Up to `capacity_blocks` blocks of prompt KV, least recently used out first."""

    __slots__ = ("_held", "_used", "capacity_blocks")

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = max(0, capacity_blocks)
        # First value of a run -> leading blocks of that run held; LRU first, MRU last.
        self._held: OrderedDict[int, int] = OrderedDict()
        self._used = 0

    @property
    def used_blocks(self) -> int:
        return self._used

    def hit_blocks(self, chain: BlockChain) -> int:
        """Leading blocks of `chain` this cache holds (no change to the LRU order)."""
        held = self._held
        hit = 0
        for _, base, length in chain.runs():
            have = held.get(base, 0)
            if have >= length:
                hit += length
                continue
            return hit + have
        return hit

    def insert(self, chain: BlockChain) -> None:
        """The engine has computed or imported every block of `chain`: hold them, most recent."""
        if self.capacity_blocks <= 0 or not len(chain):
            return
        held = self._held
        # Tail runs first, so the head ends most recently used and is evicted last.
        for _, base, length in reversed(list(chain.runs())):
            have = held.get(base, 0)
            if length > have:
                held[base] = length
                self._used += length - have
            if base in held:
                held.move_to_end(base)
        self._evict()

    def _evict(self) -> None:
        held = self._held
        excess = self._used - self.capacity_blocks
        while excess > 0 and held:
            base, have = next(iter(held.items()))
            if have <= excess:
                del held[base]
                self._used -= have
                excess -= have
            else:
                held[base] = have - excess  # drops that run's tail blocks only
                self._used -= excess
                excess = 0
