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

Pinned blocks: a decode engine's retained KV (a handle) stays in its cache, found by any
prompt that starts with it, but is not free memory: nothing evicts it while the handle holds it,
and it takes none of the capacity, which is the memory left free. Freed, it becomes the most
recently used, as vLLM appends freed blocks to the end of its free queue.

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
    """Up to `capacity_blocks` unpinned blocks of prompt KV, least recently used out first, and
    every pinned one."""

    __slots__ = ("_held", "_pinned", "_pins", "_poisoned", "_used", "capacity_blocks", "journal")

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
        # First value of a run -> {leading blocks pinned: how many pins}; a run's pinned blocks are
        # its longest pin's. `_pinned`: the blocks pinned in all.
        self._pins: dict[int, dict[int, int]] = {}
        self._pinned = 0

    @property
    def used_blocks(self) -> int:
        return self._used

    @property
    def pinned_blocks(self) -> int:
        return self._pinned

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

    def insert(self, chain: BlockChain, poisoned_from: int | None = None, pin: bool = False) -> None:
        """The engine has computed or imported every block of `chain`: hold them, most recent.

        `poisoned_from`: the index of the first block whose KV is wrong (None: all are right).
        `pin`: a handle holds them too, until `unpin`: held whatever the capacity, never evicted.
        """
        if not len(chain) or (self.capacity_blocks <= 0 and not pin):
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
            if pin:
                self._pin(base, length, 1)
        self._evict()

    def unpin(self, chain: BlockChain) -> None:
        """The handle that pinned `chain` frees it: its blocks stay, most recently used, and may
        now be evicted."""
        held = self._held
        # Tail runs first, so the head ends most recently used and is evicted last.
        for _, base, length in reversed(list(chain.runs())):
            self._pin(base, length, -1)
            if base in held:
                held.move_to_end(base)
        self._evict()

    def _pin(self, base: int, length: int, change: int) -> None:
        pins = self._pins.get(base)
        before = max(pins) if pins else 0
        if pins is None:
            if change < 0:
                return
            pins = self._pins[base] = {}
        count = pins.get(length, 0) + change
        if count > 0:
            pins[length] = count
        else:
            pins.pop(length, None)
        after = max(pins) if pins else 0
        if not pins:
            del self._pins[base]
        self._pinned += after - before

    def resize(self, capacity_blocks: int) -> None:
        """Holds at most `capacity_blocks` from now on; least recently used blocks go first."""
        self.capacity_blocks = max(0, capacity_blocks)
        self._evict()

    def _evict(self) -> None:
        """Least recently used runs' unpinned tail blocks go, until the unpinned blocks fit. A run
        pinned whole moves out of the way, to the most recent end: its place in the order is set
        again when it is unpinned."""
        held = self._held
        excess = self._used - self._pinned - self.capacity_blocks
        for _ in range(len(held)):
            if excess <= 0:
                return
            base, have = next(iter(held.items()))
            pins = self._pins.get(base)
            pinned = max(pins) if pins else 0
            keep = max(have - excess, pinned)
            if keep < have:
                excess -= have - keep
                self._used -= have - keep
                if keep == 0:
                    del held[base]
                    self._poisoned.pop(base, None)
                else:
                    held[base] = keep  # drops that run's tail blocks only
                    if self._poisoned.get(base, have) >= keep:
                        self._poisoned.pop(base, None)  # its poisoned tail went
                if self.journal is not None:
                    self.journal.append((base, keep))
            if keep and keep == pinned:
                held.move_to_end(base)
