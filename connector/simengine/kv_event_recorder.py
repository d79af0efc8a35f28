"""What the sim-engine's prefix cache does, as vLLM's KV-cache events say it.

vLLM's block pool (`vllm/v1/core/block_pool.py`) emits, per scheduler step:

- `BlockStored` when full blocks enter the prefix cache (prompt blocks after prefill, blocks
  that decode-generated tokens complete): their hashes, the parent's hash (None for a run that
  starts at block 0), their tokens, `block_size`, medium "GPU", `group_idx` 0, the request's
  `session_id`, and `extra_keys` with one entry per block, untagged: `(cache_salt,)` on block 0
  of a salted request, None otherwise;
- `BlockRemoved`, one per hash, when a cached block is evicted for reuse;
- `AllBlocksCleared` when the prefix cache is reset.

The hashes are vLLM's own (`BlockHasher`, the engine's `--prefix-caching-hash-algo` and seed),
not the sim's content hashes, so a router predicting them from token ids matches. The sim keeps
each hash cached at most once: a block whose hash is already cached by another block (two
identical prompts computed at once) is not stored again, so every `BlockStored` hash is removed
at most once. Blocks completed by decode enter the cache when the request finishes (the sim
writes a request's generated KV then), not step by step.

Events of one event-loop turn form one batch, as a vLLM step's do. Event-loop thread only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvplane.services.common.model.block_hashes import BlockHasher, external_id
from kvplane.services.common.model.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
)


@dataclass
class RequestBlocks:
    """One request as vLLM's prefix cache keys it: its salt, its session, and the whole hashes
    of its full blocks computed so far (extended as its tokens grow)."""

    cache_salt: str | None
    session_id: str | None
    hashes: list[bytes] = field(default_factory=list)


def _runs(indices: Sequence[int]) -> Iterator[tuple[int, int]]:
    """[first, last] of each run of consecutive block indices."""
    ordered = sorted(indices)
    start = prev = ordered[0]
    for i in ordered[1:]:
        if i != prev + 1:
            yield start, prev
            start = i
        prev = i
    yield start, prev


class KVEventRecorder:
    """Turns the block pool's cache changes into vLLM's events and hands them, a batch per
    event-loop turn, to `publish` (which must not block)."""

    def __init__(self, hasher: BlockHasher, publish: Callable[[list[KVEvent]], Any]) -> None:
        self.hasher = hasher
        self._publish = publish
        # Cached blocks by block id: the 64-bit id their BlockRemoved will carry.
        self._ids: dict[int, int] = {}
        self._pending: list[KVEvent] = []
        self._flush_scheduled = False

    def request(self, cache_salt: str | None, session_id: str | None) -> RequestBlocks:
        return RequestBlocks(cache_salt, session_id)

    def _hashes(self, req: RequestBlocks, tokens: Sequence[int], count: int) -> list[bytes]:
        """The whole hashes of the request's first `count` blocks, chained on from those known."""
        bs = self.hasher.block_size
        hashes = req.hashes
        salt = (("cache_salt", req.cache_salt),) if req.cache_salt else None
        for i in range(len(hashes), count):
            parent = hashes[-1] if hashes else self.hasher.none_hash
            block = tokens[i * bs : (i + 1) * bs]
            hashes.append(self.hasher.chain_from(parent, block, salt if i == 0 else None))
        return hashes

    def stored(
        self, req: RequestBlocks, tokens: Sequence[int], block_ids: Sequence[int], indices: Sequence[int]
    ) -> None:
        """Blocks `block_ids[i]`, for `i` in `indices`, entered the cache holding the tokens of
        the request's block `i`."""
        if not indices:
            return
        bs = self.hasher.block_size
        hashes = self._hashes(req, tokens, max(indices) + 1)
        for first, last in _runs(indices):
            ids = tuple(external_id(h) for h in hashes[first : last + 1])
            for offset, block_id in enumerate(block_ids[first : last + 1]):
                self._ids[block_id] = ids[offset]
            salted = req.cache_salt
            extra = tuple((salted,) if i == 0 and salted else None for i in range(first, last + 1))
            self._add(
                BlockStored(
                    block_ids=ids,
                    parent_id=external_id(hashes[first - 1]) if first else None,
                    token_ids=tuple(tokens[first * bs : (last + 1) * bs]),
                    block_size=bs,
                    medium=MEDIUM_GPU,
                    extra_keys=extra,
                    group_idx=0,
                    session_id=req.session_id,
                )
            )

    def evicted(self, block_id: int) -> None:
        """Block `block_id` left the cache."""
        block = self._ids.pop(block_id, None)
        if block is not None:
            self._add(BlockRemoved(block_ids=(block,), medium=MEDIUM_GPU, group_idx=0))

    def cleared(self) -> None:
        """The whole cache was reset."""
        self._ids.clear()
        self._add(AllBlocksCleared())

    def _add(self, event: KVEvent) -> None:
        self._pending.append(event)
        if self._flush_scheduled:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop (a unit test): the caller flushes
        loop.call_soon(self.flush)
        self._flush_scheduled = True

    def flush(self) -> None:
        """Publish what is pending as one batch."""
        self._flush_scheduled = False
        if self._pending:
            events, self._pending = self._pending, []
            self._publish(events)
