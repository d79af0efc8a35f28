"""Each conversation's prompt digest chain, hashed only when needed and only once per block.

Proving a prefix (against the handle, against what a prefill node was sent)
needs the prompt's chained block digests, one BLAKE2b per block: for a long
conversation that is most of a Route's CPU, and nearly all of it repeats the
previous turn's work, since a new prompt starts with the previous one.

So a prompt's chain is lazy (`LazyChain`): its length is known at once, its
values are hashed on first use, and then only after the blocks it shares
with the conversation's previous prompt, when that one's chain was hashed.
A comparison of the raw tokens (a memcmp, far cheaper than hashing) finds
the shared blocks. A first turn with nothing to prove hashes nothing.

Memory is bounded by a token budget (4 bytes per token, plus 8 per hashed
block) and a number of conversations, least recently routed first out. A
chain evicted before it was ever hashed can no longer be (`ChainUnavailable`):
what it would have proven is then unproven. Pure: no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import replace
from typing import overload

import numpy as np

from kvplane.connector import digests as token_digests
from kvplane.services.routing.policy.snapshot import Prompt


class ChainUnavailable(LookupError):
    """The prompt's tokens were dropped (the cache's budget) before its chain was needed."""


class _Entry:
    """One prompt: its whole blocks' tokens, and its chain once hashed."""

    __slots__ = ("base", "block_size", "blocks", "chain", "raw", "shared")

    def __init__(self, block_size: int, raw: bytes, base: _Entry | None, shared: int) -> None:
        self.block_size = block_size
        self.raw = raw  # little-endian uint32 token ids; b"" once dropped
        self.blocks = len(raw) // (4 * block_size)
        self.chain: tuple[int, ...] | None = None
        # The conversation's previous prompt and how many leading blocks this one shares with it.
        self.base = base
        self.shared = shared

    def values(self) -> tuple[int, ...]:
        if self.chain is None:
            if not self.raw and self.blocks:
                raise ChainUnavailable("the prompt's tokens were dropped before its chain was needed")
            base, shared, step = self.base, self.shared, self.block_size * 4
            if base is not None and base.chain is not None and shared:
                head = base.chain[:shared]
                tail = token_digests.chain_from(head[-1], self.raw[shared * step :], self.block_size)
                self.chain = head + tuple(tail)
            else:
                self.chain = tuple(token_digests.chain_from(None, self.raw, self.block_size))
            self.base = None
        return self.chain


class LazyChain(Sequence[int]):
    """A prompt's chained block digests, hashed on first access to a value."""

    __slots__ = ("_entry",)

    def __init__(self, entry: _Entry) -> None:
        self._entry = entry

    def __len__(self) -> int:
        return self._entry.blocks

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[int]: ...

    def __getitem__(self, index: int | slice) -> int | Sequence[int]:
        return self._entry.values()[index]

    def __iter__(self) -> Iterator[int]:
        return iter(self._entry.values())


class PromptChains:
    """An LRU of conversations' last prompts, within a token budget."""

    def __init__(self, *, max_conversations: int = 100_000, max_tokens: int = 16 << 20) -> None:
        if max_conversations <= 0 or max_tokens <= 0:
            raise ValueError("max_conversations and max_tokens must be positive")
        self.max_conversations = max_conversations
        self.max_tokens = max_tokens
        self._items: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._items)

    def with_chain(self, conversation: Hashable, prompt: Prompt, block_size: int) -> Prompt:
        """`prompt` with its (lazy) block digests, when it has token ids and none were given."""
        if not prompt.token_ids or prompt.block_digests or block_size <= 0:
            return prompt
        tokens = np.asarray(prompt.token_ids, dtype="<u4")
        whole = len(tokens) // block_size
        entry = self._entry(conversation, tokens[: whole * block_size].tobytes(), block_size)
        return replace(prompt, block_digests=LazyChain(entry), digest_block_size=block_size)

    def forget(self, conversation: Hashable) -> None:
        gone = self._items.pop(conversation, None)
        if gone is not None:
            self._drop(gone)

    def _entry(self, conversation: Hashable, raw: bytes, block_size: int) -> _Entry:
        previous = self._items.pop(conversation, None)
        shared = 0
        if previous is not None:
            self._tokens -= len(previous.raw) // 4
            shared = _shared_blocks(previous, raw, block_size)
        entry = _Entry(block_size, raw, previous if shared else None, shared)
        if previous is not None:
            # The previous prompt's tokens are no longer needed once this one's chain is hashed;
            # until then `entry.base` keeps what it needs.
            previous.raw = b"" if previous.chain is not None else previous.raw
        if len(raw) // 4 <= self.max_tokens:
            self._items[conversation] = entry
            self._tokens += len(raw) // 4
            while self._tokens > self.max_tokens or len(self._items) > self.max_conversations:
                _, oldest = self._items.popitem(last=False)
                self._drop(oldest)
        return entry

    def _drop(self, entry: _Entry) -> None:
        self._tokens -= len(entry.raw) // 4
        entry.raw = b""
        entry.base = None


def _shared_blocks(previous: _Entry, raw: bytes, block_size: int) -> int:
    """Whole blocks at the start of `raw` equal to the previous prompt's."""
    if previous.block_size != block_size or not previous.raw:
        return 0
    old = previous.raw
    n = min(len(old), len(raw))
    if raw[:n] == old[:n]:
        return n // (block_size * 4)
    a = np.frombuffer(old, dtype="<u4", count=n // 4)
    b = np.frombuffer(raw, dtype="<u4", count=n // 4)
    first = int(np.argmax(a != b))
    return first // block_size
