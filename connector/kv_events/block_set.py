"""What an engine's prefix cache holds, per medium, as its KV-cache events tell it.

Each block is kept with its depth in its prefix chain (the first block of a prompt is at depth 1,
its child at 2, ...), learnt from the event's parent: a `BlockStored` whose parent is held here
continues that chain; one without a parent starts one. A block whose parent is not held here
(its parent's event was lost: a gap that could not be replayed, a reset, the subscriber started
after the engine) has no known depth: it is kept, so that its children's depths stay unknown
too, but it is never forwarded to routing, which scores only a prefix it can prove from the
prompt's first block on.

What routing is sent is the set of *forwarded* blocks: those of the forwarded media (GPU by
default: what a prefill engine's scheduler matches first) with a known depth that is a multiple
of `checkpoint_blocks` (1: every block). Each stream to a routing replica holds a `Cursor`: the
forwarded blocks added and removed since it last took them, coalesced (a block stored and
evicted in between is never sent); a cursor whose pending delta outgrows its bound, or any
cursor after a reset, asks for a full snapshot instead.

Memory is bounded: at most `max_blocks` blocks over all media. More than that means removals
were missed (an engine holds no more blocks than its KV cache has), so the set resets.

Pure: no I/O, no clock. Not thread-safe: the node agent's loop owns it (`held_prefix` alone may
be read from another thread).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from kvplane.services.common.model.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)

# The depth of a block whose chain is not known back to its first block.
UNKNOWN_DEPTH = 0


@dataclass(slots=True)
class BlockSetStats:
    """Counters of what the set has seen."""

    # Blocks stored and removed by events.
    stored: int = 0
    removed: int = 0
    # Blocks stored whose parent was not held here (never forwarded).
    orphaned: int = 0
    # Times the set was emptied (AllBlocksCleared, a gap, a restart, an overflow).
    resets: int = 0
    # Resets because more than max_blocks blocks were held.
    overflows: int = 0


class Cursor:
    """One consumer's pending delta of forwarded blocks (a stream to one routing replica)."""

    __slots__ = ("added", "max_pending", "needs_snapshot", "removed")

    def __init__(self, max_pending: int) -> None:
        self.max_pending = max_pending
        self.added: set[int] = set()
        self.removed: set[int] = set()
        # True: the consumer must be sent the whole set (new, reset, or its delta overflowed).
        self.needs_snapshot = True

    def changed(self) -> bool:
        return self.needs_snapshot or bool(self.added) or bool(self.removed)

    def take(self) -> tuple[list[int], list[int]]:
        """The pending (stored, removed) ids, cleared. Call only when not needs_snapshot."""
        added, removed = sorted(self.added), sorted(self.removed)
        self.added.clear()
        self.removed.clear()
        return added, removed

    def _add(self, block_id: int) -> None:
        if self.needs_snapshot:
            return
        self.removed.discard(block_id)
        self.added.add(block_id)
        self._bound()

    def _remove(self, block_id: int) -> None:
        if self.needs_snapshot:
            return
        if block_id in self.added:
            self.added.discard(block_id)  # the consumer never had it
        else:
            self.removed.add(block_id)
            self._bound()

    def _bound(self) -> None:
        if len(self.added) + len(self.removed) > self.max_pending:
            self._restart()

    def _restart(self) -> None:
        self.needs_snapshot = True
        self.added.clear()
        self.removed.clear()


def _medium(medium: str | None) -> str:
    # vLLM leaves the medium out where there is only the GPU tier.
    return medium.upper() if medium else MEDIUM_GPU


class BlockSet:
    """The engine's blocks per medium, each with its chain depth; bounded."""

    def __init__(
        self,
        *,
        max_blocks: int = 4_000_000,
        checkpoint_blocks: int = 1,
        forwarded_media: Iterable[str] = (MEDIUM_GPU,),
        max_pending: int = 262_144,
    ) -> None:
        if max_blocks <= 0 or checkpoint_blocks <= 0 or max_pending <= 0:
            raise ValueError("max_blocks, checkpoint_blocks and max_pending must be positive")
        self.max_blocks = max_blocks
        self.checkpoint_blocks = checkpoint_blocks
        self.forwarded_media = frozenset(_medium(m) for m in forwarded_media)
        self.max_pending = max_pending
        self.stats = BlockSetStats()
        # medium -> block id -> depth (UNKNOWN_DEPTH: not proven from a first block).
        self._media: dict[str, dict[int, int]] = {}
        self._count = 0
        self._cursors: list[Cursor] = []

    def __len__(self) -> int:
        return self._count

    # -- events -----------------------------------------------------------------------------

    def apply(self, events: Iterable[KVEvent]) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                self._removed(event)
            elif isinstance(event, AllBlocksCleared):
                self.reset()

    def reset(self) -> None:
        """Forget everything: what the engine holds is unknown until events say again."""
        self._media.clear()
        self._count = 0
        self.stats.resets += 1
        for cursor in self._cursors:
            cursor._restart()

    def _stored(self, event: BlockStored) -> None:
        if event.parent_id is None and not event.token_ids:
            self._stored_by_name(event)
            return
        medium = _medium(event.medium)
        blocks = self._media.setdefault(medium, {})
        parent = event.parent_id
        if parent is None:
            depth = 0  # the event starts a chain: its first block is at depth 1
        else:
            held = blocks.get(parent)
            depth = self._depth_elsewhere(parent) if held is None else held
        forwarded = medium in self.forwarded_media
        known = parent is None or depth != UNKNOWN_DEPTH
        for block_id in event.block_ids:
            depth = depth + 1 if known else UNKNOWN_DEPTH
            held = blocks.get(block_id)
            if held is not None and held != UNKNOWN_DEPTH:
                # Held with its depth already: a block's hash fixes its chain, which goes on from it.
                depth, known = held, True
                continue
            self._place(blocks, block_id, depth, held is None, forwarded)
        self._bound()

    def _stored_by_name(self, event: BlockStored) -> None:
        """An event that names its blocks only: no parent and no tokens (vLLM's OffloadingConnector
        without `self_describing_kv_events` sends such placeholders for what it copies to its
        CPU tier, one block each, in no particular order). Neither a chain start nor a chain: a
        block's depth is its copy's on another medium (one hash, one place in its chain), else
        unknown."""
        medium = _medium(event.medium)
        blocks = self._media.setdefault(medium, {})
        forwarded = medium in self.forwarded_media
        for block_id in event.block_ids:
            held = blocks.get(block_id)
            if held is None or held == UNKNOWN_DEPTH:
                self._place(blocks, block_id, self._depth_elsewhere(block_id), held is None, forwarded)
        self._bound()

    def _place(self, blocks: dict[int, int], block_id: int, depth: int, new: bool, forwarded: bool) -> None:
        """Holds `block_id` at `depth` (UNKNOWN_DEPTH: not proven from a first block), counted,
        and given to every cursor when routing is sent it."""
        if new:
            self._count += 1
        if depth == UNKNOWN_DEPTH:
            self.stats.orphaned += 1
        elif forwarded and depth % self.checkpoint_blocks == 0:
            for cursor in self._cursors:
                cursor._add(block_id)
        blocks[block_id] = depth
        self.stats.stored += 1

    def _bound(self) -> None:
        """More blocks than `max_blocks` means removals were missed: start over."""
        if self._count > self.max_blocks:
            self.stats.overflows += 1
            self.reset()

    def _depth_elsewhere(self, parent: int) -> int:
        """The block's depth on any medium that knows it (an offloaded chain continues a GPU
        one; an offloaded copy sits where its GPU original does)."""
        for blocks in self._media.values():
            depth = blocks.get(parent)
            if depth is not None and depth != UNKNOWN_DEPTH:
                return depth
        return UNKNOWN_DEPTH

    def _removed(self, event: BlockRemoved) -> None:
        medium = _medium(event.medium)
        blocks = self._media.get(medium)
        if blocks is None:
            return
        forwarded = medium in self.forwarded_media
        k = self.checkpoint_blocks
        for block_id in event.block_ids:
            depth = blocks.pop(block_id, None)
            if depth is None:
                continue
            self._count -= 1
            self.stats.removed += 1
            if forwarded and depth != UNKNOWN_DEPTH and depth % k == 0:
                for cursor in self._cursors:
                    cursor._remove(block_id)

    # -- reading ----------------------------------------------------------------------------

    def depth(self, block_id: int, medium: str = MEDIUM_GPU) -> int | None:
        """The block's depth on `medium` (UNKNOWN_DEPTH: its chain is not known), None if absent."""
        return self._media.get(_medium(medium), {}).get(block_id)

    def held_prefix(self, block_ids: Sequence[int], medium: str = MEDIUM_GPU) -> int:
        """How many of a chain's leading blocks `medium` holds, each at its own depth (the first
        block at 1). One dict read per block: safe to call from another thread, which may see
        the set as of a moment before."""
        blocks = self._media.get(_medium(medium), {})
        n = 0
        for n, block_id in enumerate(block_ids, start=1):
            if blocks.get(block_id) != n:
                return n - 1
        return n

    def count(self, medium: str = MEDIUM_GPU) -> int:
        return len(self._media.get(_medium(medium), {}))

    def forwarded(self) -> Iterator[int]:
        """Every block routing is sent: forwarded media, known depth, at a checkpoint."""
        k = self.checkpoint_blocks
        seen: set[int] = set()
        for medium in sorted(self.forwarded_media):
            for block_id, depth in self._media.get(medium, {}).items():
                if depth != UNKNOWN_DEPTH and depth % k == 0 and block_id not in seen:
                    seen.add(block_id)
                    yield block_id

    def cursor(self) -> Cursor:
        """A new consumer; it starts with a snapshot (`snapshot_for`)."""
        cursor = Cursor(self.max_pending)
        self._cursors.append(cursor)
        return cursor

    def close(self, cursor: Cursor) -> None:
        if cursor in self._cursors:
            self._cursors.remove(cursor)

    def snapshot_for(self, cursor: Cursor) -> list[int]:
        """The whole forwarded set, and the cursor's deltas start from it."""
        cursor.added.clear()
        cursor.removed.clear()
        cursor.needs_snapshot = False
        return sorted(self.forwarded())
