"""The simulated KV cache: a DRAM block pool with a prefix cache and leases.

One contiguous numpy array holds every block, so NIXL registers it once and
block ``b`` lives at ``base + b * bytes_per_block``. Bookkeeping follows
vLLM's shape: blocks are reference counted; a freed whole block keeps its
content and its hash (a prefix-cache entry) until it is evicted for reuse;
a freed partial or unhashed block is poisoned at once.

The host tier, when there is one, is the array's tail: ids ``num_blocks`` to
``addressable_blocks - 1``, never given to requests nor cached, only taken and
given back whole by retention (``host_take``, ``host_give``). Registered with the
rest, a reader reads a host block by its id exactly as a cache block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvplane.connector.simengine.block_content import ContentModel, Words, block_hashes


class KvCacheFullError(Exception):
    """Not enough free blocks for a request."""


@dataclass(frozen=True)
class LeaseResult:
    """The blocks a lease ended up on, and how many shared blocks it copied or took over."""

    block_ids: list[int]
    copied: int
    restamped: int


class BlockPool:
    """Blocks, reference counts, prefix cache and lease trailers. Event-loop thread only."""

    def __init__(
        self, num_blocks: int, bytes_per_block: int, block_size: int, root: int, host_blocks: int = 0
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        if host_blocks < 0:
            raise ValueError("host_blocks must be non-negative")
        self.num_blocks = num_blocks
        self.host_blocks = host_blocks
        self.addressable_blocks = num_blocks + host_blocks
        self.block_size = block_size
        self.bytes_per_block = bytes_per_block
        self.root = root
        self.content = ContentModel(bytes_per_block)
        self.array: Words = np.empty((self.addressable_blocks, self.content.words), dtype=np.uint64)
        self.content.poison(self.array)  # never-written blocks read as poison, not as zeros
        self._refs = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}
        # Free blocks without a cache entry, reused first.
        self._free_plain: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        # Free blocks that still back a prefix-cache entry, least recently freed first.
        self._free_cached: OrderedDict[int, None] = OrderedDict()
        self._lease: list[int] = [0] * num_blocks
        self._host_free: OrderedDict[int, None] = OrderedDict(
            (b, None) for b in range(num_blocks, self.addressable_blocks)
        )
        # Told the id of every block whose prefix-cache entry is dropped (evicted or rewritten).
        self.on_uncached: Callable[[int], None] | None = None

    # -- accounting -------------------------------------------------------

    @property
    def free_blocks(self) -> int:
        return len(self._free_plain) + len(self._free_cached)

    @property
    def base_address(self) -> int:
        return int(self.array.ctypes.data)

    def block(self, block_id: int) -> Words:
        view: Words = self.array[block_id]
        return view

    def refcount(self, block_id: int) -> int:
        return self._refs[block_id]

    # -- host tier ----------------------------------------------------------

    @property
    def host_free_blocks(self) -> int:
        return len(self._host_free)

    def host_take(self, n: int) -> list[int] | None:
        """`n` free host blocks, or None (and none taken) when fewer are free."""
        if n > len(self._host_free):
            return None
        return [self._host_free.popitem(last=False)[0] for _ in range(n)]

    def host_copy(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy cache blocks `src` into host blocks `dst`, content and lease trailer alike."""
        if len(src) != len(dst) or any(not self.num_blocks <= b < self.addressable_blocks for b in dst):
            raise ValueError("host_copy needs as many host blocks as cache blocks")
        self.array[np.asarray(dst, dtype=np.int64)] = self.array[np.asarray(src, dtype=np.int64)]

    def host_give(self, block_ids: Sequence[int]) -> None:
        """Host blocks back, poisoned: a late read of them fails its check, never passes."""
        for b in block_ids:
            if not self.num_blocks <= b < self.addressable_blocks or b in self._host_free:
                raise RuntimeError(f"block {b} is not a taken host block")
            self.content.poison(self.array[b])
            self._host_free[b] = None

    # -- prefix cache -----------------------------------------------------

    def match_prefix(self, full_hashes: Sequence[int], salt: int = 0) -> list[int]:
        """Longest run of cached blocks for these whole-block hashes under `salt`; takes no reference.

        As vLLM's `cache_salt`: blocks cached under one salt never match a request with another
        (the salt keys the cache; the blocks' content is the same).
        """
        out: list[int] = []
        for h in full_hashes:
            b = self._cached.get(h ^ salt)
            if b is None:
                break
            out.append(b)
        return out

    def acquire(self, block_ids: Sequence[int]) -> None:
        for b in block_ids:
            if self._refs[b] == 0:
                self._free_cached.pop(b, None)
                self._free_plain.pop(b, None)
            self._refs[b] += 1

    def allocate(self, n: int) -> list[int]:
        if n > self.free_blocks:
            raise KvCacheFullError(f"need {n} blocks, {self.free_blocks} free of {self.num_blocks}")
        out: list[int] = []
        for _ in range(n):
            if self._free_plain:
                b, _ = self._free_plain.popitem(last=False)
            else:
                b, _ = self._free_cached.popitem(last=False)
                self._evict(b)
            self._refs[b] = 1
            out.append(b)
        return out

    def _evict(self, b: int) -> None:
        self._uncache(b)
        self._hash[b] = None
        self._lease[b] = 0
        self.content.poison(self.array[b])

    def _uncache(self, b: int) -> None:
        h = self._hash[b]
        if h is not None and self._cached.get(h) == b:
            del self._cached[h]
            if self.on_uncached is not None:
                self.on_uncached(b)

    def reset_prefix_cache(self) -> bool:
        """Forget every cache entry, as vLLM's reset does: only while no block is in use
        (False otherwise, and nothing changes). Tells `on_uncached` nothing: a reset is one event."""
        if any(self._refs):
            return False
        for b in self._free_cached:
            self._hash[b] = None
            self.content.poison(self.array[b])
            self._free_plain[b] = None
        self._free_cached.clear()
        self._cached.clear()
        return True

    def release(self, block_ids: Sequence[int]) -> None:
        for b in block_ids:
            if self._refs[b] <= 0:
                raise RuntimeError(f"block {b} released more often than acquired")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if self._hash[b] is not None and self._lease[b] == 0:
                    self._free_cached[b] = None
                else:
                    # Unhashed (partial) blocks can never be matched again:
                    # poison them now, so a stale read of them fails loudly.
                    self._evict(b)
                    self._free_plain[b] = None

    # -- content ----------------------------------------------------------

    def write_tokens(
        self,
        block_ids: Sequence[int],
        tokens: Sequence[int],
        num_tokens: int,
        first_block: int = 0,
        known_full: Sequence[int] = (),
        salt: int = 0,
        cached: list[int] | None = None,
    ) -> list[int]:
        """Write the content of blocks[first_block:] for tokens[:num_tokens]; cache whole blocks
        under `salt` (see match_prefix).

        Blocks before ``first_block`` were matched from the prefix cache and
        are shared, so they are never written. ``known_full`` are whole-block
        hashes of the same tokens computed earlier. Returns every block's hash;
        ``cached``, when given, gets the index of every block that entered the cache.
        """
        hashes = block_hashes(tokens, self.block_size, self.root, num_tokens, known_full)
        if len(hashes) > len(block_ids):
            raise ValueError(f"{num_tokens} tokens need {len(hashes)} blocks, have {len(block_ids)}")
        written = list(block_ids[first_block : len(hashes)])
        self.content.write_many(self.array, written, hashes[first_block:], first_block)
        if written:
            self.array[np.asarray(written, dtype=np.int64), -2:] = np.uint64(0)  # no lease trailer
        for i in range(first_block, len(hashes)):
            b = block_ids[i]
            self._lease[b] = 0
            full = (i + 1) * self.block_size <= num_tokens
            self._uncache(b)
            self._hash[b] = None
            if full and hashes[i] ^ salt not in self._cached:
                self._cached[hashes[i] ^ salt] = b
                self._hash[b] = hashes[i] ^ salt
                if cached is not None:
                    cached.append(i)
        return hashes

    # -- leases -----------------------------------------------------------

    def lease(self, block_ids: Sequence[int], stamp: int, reserve_blocks: int = 0) -> LeaseResult:
        """Stamp blocks for a remote reader; returns the block list actually leased.

        A block can carry one stamp. One already leased to another handle (a
        shared cached prefix, or the previous turn's handle nobody read) is
        copied to a fresh block while more than ``reserve_blocks`` stay free,
        so both handles stay readable; the caller's reference moves to the
        copy. Past that the block is restamped: the older handle then fails
        its reader's check (and is recomputed), never the newer one.
        """
        shared = [b for b in block_ids if self._lease[b] not in (0, stamp)]
        copy = len(shared) <= self.free_blocks - reserve_blocks
        out: list[int] = []
        for b in block_ids:
            if copy and self._lease[b] not in (0, stamp):
                (c,) = self.allocate(1)
                self.array[c] = self.array[b]
                self.release([b])
                b = c
            self._lease[b] = stamp
            self.content.set_trailer(self.array[b], stamp)
            out.append(b)
        return LeaseResult(out, copied=len(shared) if copy else 0, restamped=0 if copy else len(shared))

    def unlease(self, block_ids: Sequence[int], stamp: int) -> None:
        for b in block_ids:
            if self._lease[b] == stamp:
                self._lease[b] = 0
                self.content.clear_trailer(self.array[b])
