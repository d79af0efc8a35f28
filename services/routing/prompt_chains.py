"""Each conversation's last prompt digest chain, so a new turn hashes only its new blocks.

Proving a prefix (against the handle, against what a prefill node was sent)
needs the prompt's chained block digests, one BLAKE2b per block: for a long
conversation that is most of a Route's CPU, and nearly all of it repeats the
previous turn's work, since a new prompt starts with the previous one. The
cache keeps the previous prompt's whole-block tokens and chain; a comparison
of the raw tokens (a memcmp, far cheaper than hashing) finds the blocks that
are unchanged, and only the blocks after them are hashed.

Memory is bounded by a token budget (4 bytes per token plus 8 per block) and
a number of conversations, least recently routed first out. Pure: no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass, replace

import numpy as np

from kvplane.connector import digests as token_digests
from kvplane.services.routing.policy.snapshot import Prompt


@dataclass(frozen=True, slots=True)
class _Chained:
    block_size: int
    tokens: bytes  # the whole blocks' token ids, little-endian uint32
    chain: tuple[int, ...]


class PromptChains:
    """An LRU of conversations' last prompt chains, within a token budget."""

    def __init__(self, *, max_conversations: int = 100_000, max_tokens: int = 16 << 20) -> None:
        if max_conversations <= 0 or max_tokens <= 0:
            raise ValueError("max_conversations and max_tokens must be positive")
        self.max_conversations = max_conversations
        self.max_tokens = max_tokens
        self._items: OrderedDict[Hashable, _Chained] = OrderedDict()
        self._tokens = 0

    def __len__(self) -> int:
        return len(self._items)

    def with_chain(self, conversation: Hashable, prompt: Prompt, block_size: int) -> Prompt:
        """`prompt` with its block digests, when it has token ids and none were given."""
        if not prompt.token_ids or prompt.block_digests or block_size <= 0:
            return prompt
        tokens = np.asarray(prompt.token_ids, dtype="<u4")
        whole = len(tokens) // block_size
        raw = tokens[: whole * block_size].tobytes()
        chain = self._chain(conversation, raw, block_size)
        return replace(prompt, block_digests=chain, digest_block_size=block_size)

    def forget(self, conversation: Hashable) -> None:
        gone = self._items.pop(conversation, None)
        if gone is not None:
            self._tokens -= len(gone.tokens) // 4

    def _chain(self, conversation: Hashable, raw: bytes, block_size: int) -> tuple[int, ...]:
        previous = self._items.pop(conversation, None)
        if previous is not None:
            self._tokens -= len(previous.tokens) // 4
        same = _shared_blocks(previous, raw, block_size) if previous is not None else 0
        if previous is not None and same:
            head = previous.chain[:same]
            chain = head + tuple(token_digests.chain_from(head[-1], raw[same * block_size * 4 :], block_size))
        else:
            chain = tuple(token_digests.chain_from(None, raw, block_size))
        if len(raw) // 4 <= self.max_tokens:
            self._items[conversation] = _Chained(block_size, raw, chain)
            self._tokens += len(raw) // 4
            while self._tokens > self.max_tokens or len(self._items) > self.max_conversations:
                _, oldest = self._items.popitem(last=False)
                self._tokens -= len(oldest.tokens) // 4
        return chain


def _shared_blocks(previous: _Chained, raw: bytes, block_size: int) -> int:
    """Whole blocks at the start of `raw` equal to the previous prompt's."""
    if previous.block_size != block_size:
        return 0
    old = previous.tokens
    n = min(len(old), len(raw))
    if raw[:n] == old[:n]:
        return n // (block_size * 4)
    a = np.frombuffer(old, dtype="<u4", count=n // 4)
    b = np.frombuffer(raw, dtype="<u4", count=n // 4)
    first = int(np.argmax(a != b))
    return first // block_size
