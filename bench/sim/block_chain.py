"""Compact stand-ins for the chained digests of a conversation's token blocks.

The routing policy proves a continuation by comparing the chained digest
after each whole block of the prompt with a handle's checkpoints. The
simulator has no tokens, only counts, so it gives every new block a fresh
integer and lets a continuation inherit its predecessor's integers for the
blocks it shares: equal values then mean equal prefixes, exactly the
property of the real chain. A chain is stored as runs of consecutive
integers (one run per turn), so a 100k-token context costs a few tuples,
not thousands of ints.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator, Sequence
from functools import lru_cache
from typing import overload

from kvplane.connector.digests import TokenDigests, checkpoints


class BlockIds:
    """Issues fresh block values; one per simulation, so runs are deterministic."""

    def __init__(self) -> None:
        self._base = 1

    def take(self, blocks: int) -> int:
        """The first of `blocks` fresh consecutive values."""
        base = self._base
        self._base += max(0, blocks)
        return base


class BlockChain(Sequence[int]):
    """Block values as runs: run i covers blocks [starts[i], starts[i+1]) from bases[i]."""

    __slots__ = ("_bases", "_length", "_starts")

    def __init__(self, starts: tuple[int, ...] = (), bases: tuple[int, ...] = (), length: int = 0) -> None:
        self._starts = starts
        self._bases = bases
        self._length = length

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[int]: ...

    def __getitem__(self, index: int | slice) -> int | Sequence[int]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._length))]
        if index < 0:
            index += self._length
        if not 0 <= index < self._length:
            raise IndexError(index)
        run = bisect.bisect_right(self._starts, index) - 1
        return self._bases[run] + index - self._starts[run]

    def __iter__(self) -> Iterator[int]:
        for i in range(self._length):
            yield self[i]

    def runs(self) -> Iterator[tuple[int, int, int]]:
        """(first block, first value, blocks) of each run, in order."""
        starts, bases, n = self._starts, self._bases, len(self._starts)
        for i in range(n):
            end = starts[i + 1] if i + 1 < n else self._length
            yield starts[i], bases[i], end - starts[i]

    def values_at(self, points: tuple[int, ...]) -> tuple[int, ...]:
        """Values after each of `points` (ascending prefix lengths, in blocks), in one pass."""
        starts, bases = self._starts, self._bases
        last_run = len(starts) - 1
        run = 0
        out = []
        for p in points:
            i = p - 1
            while run < last_run and starts[run + 1] <= i:
                run += 1
            out.append(bases[run] + i - starts[run])
        return tuple(out)

    def prefix(self, blocks: int) -> BlockChain:
        """The first `blocks` blocks."""
        blocks = max(0, min(blocks, self._length))
        if blocks == self._length:
            return self
        runs = bisect.bisect_left(self._starts, blocks)
        return BlockChain(self._starts[:runs], self._bases[:runs], blocks)

    def extended(self, blocks: int, ids: BlockIds) -> BlockChain:
        """This chain followed by `blocks` fresh blocks."""
        if blocks <= 0:
            return self
        return BlockChain(
            (*self._starts, self._length), (*self._bases, ids.take(blocks)), self._length + blocks
        )


class NamedBlocks:
    """Prompts whose blocks a workload names with chained ids (`Turn.block_ids`), so that prompts
    of other conversations with equal leading ids get the same block values there."""

    def __init__(self) -> None:
        self._latest: dict[int, BlockChain] = {}  # id -> the latest prompt that sent its block

    def sent(self, ids: Sequence[int], prompt: BlockChain) -> None:
        """`prompt` holds the blocks named by `ids`, in order from its start."""
        for h in ids:
            self._latest[h] = prompt

    def prefix(self, ids: Sequence[int], blocks_per_id: int) -> BlockChain:
        """The longest leading run of `ids` an earlier prompt sent, as that prompt's blocks (ids
        are chained: the prompt that sent the i-th id sent all before it)."""
        for i in range(len(ids) - 1, -1, -1):
            earlier = self._latest.get(ids[i])
            if earlier is not None:
                return earlier.prefix((i + 1) * blocks_per_id)
        return BlockChain()


@lru_cache(maxsize=65536)
def _points(num_blocks: int) -> tuple[int, ...]:
    return checkpoints(num_blocks)


def handle_digests(chain: BlockChain, block_size: int) -> TokenDigests:
    """The digests a decode engine would publish for a context with this chain."""
    n = len(chain)
    return TokenDigests(block_size, n, chain.values_at(_points(n)))
