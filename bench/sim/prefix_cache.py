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

Poisoned blocks: vLLM keys a cached block by its tokens' hash, not by how
its KV was made. A pull that imported KV computed for other tokens (no
prefix check) leaves wrong KV under the new prompt's hashes, and every block
P computed after it attended to that KV, so it is wrong too: from the first
wrong block to the prompt's end. Later prompts that hit those blocks are
served wrong KV. The cache keeps, per run, the offset from which its held
blocks are poisoned, until pressure evicts them. A block already held is
never replaced by a later computation of the same hash (vLLM keeps the
first), so an insert poisons only the blocks it adds.
"""

from __future__ import annotations

from collections import OrderedDict

from kvplane.bench.sim.block_chain import BlockChain


class PrefixCache:
    """Up to `capacity_blocks` blocks of prompt KV, least recently used out first."""

    __slots__ = ("_held", "_poisoned", "_used", "capacity_blocks", "journal")

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = max(0, capacity_blocks)
        # When kept (not None): every change to a run's held length, (first value, blocks held
        # now; 0: gone), in order: what the engine's KV events (BlockStored, BlockRemoved) say.
        self.journal: list[tuple[int, int]] | None = None
        # First value of a run -> leading blocks of that run held; LRU first, MRU last.
        self._held: OrderedDict[int, int] = OrderedDict()
        # First value of a run -> offset in the run from which its held blocks hold wrong KV.
        self._poisoned: dict[int, int] = {}
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

    def hit(self, chain: BlockChain) -> tuple[int, int | None]:
        """Leading blocks of `chain` held, and the index of the first poisoned one among them."""
        held = self._held
        poisoned = self._poisoned
        hit = 0
        first_bad: int | None = None
        for start, base, length in chain.runs():
            have = held.get(base, 0)
            bad = poisoned.get(base)
            if first_bad is None and bad is not None and bad < min(have, length):
                first_bad = start + bad
            if have < length:
                return hit + have, first_bad
            hit += length
        return hit, first_bad

    def insert(self, chain: BlockChain, poisoned_from: int | None = None) -> None:
        """The engine has computed or imported every block of `chain`: hold them, most recent.

        `poisoned_from`: the index of the first block whose KV is wrong (None: all are right).
        """
        if self.capacity_blocks <= 0 or not len(chain):
            return
        held = self._held
        poisoned = self._poisoned
        # Tail runs first, so the head ends most recently used and is evicted last.
        for start, base, length in reversed(list(chain.runs())):
            have = held.get(base, 0)
            if poisoned_from is not None and length > have and start + length > poisoned_from:
                bad = max(poisoned_from - start, have)
                poisoned[base] = min(bad, poisoned.get(base, bad))
            if length > have:
                held[base] = length
                self._used += length - have
                if self.journal is not None:
                    self.journal.append((base, length))
            if base in held:
                held.move_to_end(base)
        self._evict()

    def resize(self, capacity_blocks: int) -> None:
        """Holds at most `capacity_blocks` from now on; least recently used blocks go first."""
        self.capacity_blocks = max(0, capacity_blocks)
        self._evict()

    def _evict(self) -> None:
        held = self._held
        excess = self._used - self.capacity_blocks
        while excess > 0 and held:
            base, have = next(iter(held.items()))
            if have <= excess:
                del held[base]
                self._poisoned.pop(base, None)
                self._used -= have
                excess -= have
                if self.journal is not None:
                    self.journal.append((base, 0))
            else:
                held[base] = have - excess  # drops that run's tail blocks only
                self._used -= excess
                excess = 0
                if self.journal is not None:
                    self.journal.append((base, held[base]))
                if self._poisoned.get(base, have) >= held[base]:
                    self._poisoned.pop(base, None)  # its poisoned tail went
