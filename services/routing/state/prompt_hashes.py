"""Each conversation's predicted prefix-cache block hashes, so that a new turn hashes only its new blocks.

Scoring prefill nodes by their engines' events (`engine_caches`) predicts the prompt's vLLM block
hashes: one SHA-256 per block, about 2 µs, so 4.7 ms for a 32k-token prompt a node holds whole,
on every Route. Nearly all of it repeats the previous turn's work, since a new prompt starts with
the previous one. So the hashes a Route computed are kept per conversation with the prompt, hash
configuration and salt they were computed for (one set per conversation: the one last used); the
next Route takes each block's hash from there while its tokens are the same (a list comparison, far
cheaper than a hash), and hashes from the first block that differs. A hash is used only for the
very tokens it was computed from: a wrong hash is never taken from here.

Bounded: at most `max_conversations` entries and `max_blocks` hashes in all, least recently used
first out. Pure: no I/O.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence

from kvplane.services.common.model.block_hashes import BlockHasher, external_id

# How the hashes were computed: block size, algorithm, first parent, salt.
_HashKey = tuple[int, str, bytes, str | None]


class HashWalk:
    """One prompt's block hashes, computed in order on demand, reusing what its conversation's last
    prompt had where their tokens agree."""

    __slots__ = (
        "_known",
        "_known_tokens",
        "_reusing",
        "_salt",
        "_shared",
        "hasher",
        "hashes",
        "ids",
        "token_ids",
    )

    def __init__(
        self,
        hasher: BlockHasher,
        token_ids: Sequence[int],
        cache_salt: str | None,
        known_tokens: Sequence[int] = (),
        known: tuple[list[bytes], list[int]] = ([], []),
    ) -> None:
        self.hasher = hasher
        self.token_ids = token_ids
        self._salt = (("cache_salt", cache_salt),) if cache_salt else None
        self._known_tokens = known_tokens
        self._known = known
        self._reusing = bool(known[0])
        # Leading blocks known to be equal: all the known ones when one comparison shows it (the
        # usual case, a prompt that extends the last), else each is compared when reached.
        size = hasher.block_size
        n = min(len(known[0]) * size, len(token_ids) - len(token_ids) % size)
        equal = self._reusing and list(known_tokens[:n]) == list(token_ids[:n])
        self._shared = n // size if equal else 0
        # The whole hash of every block computed so far, in order, and its 64-bit id.
        self.hashes: list[bytes] = []
        self.ids: list[int] = []

    def block_id(self, depth: int) -> int:
        """The 64-bit id (as KV events carry it) of the block at `depth` (1: the first)."""
        hashes, ids = self.hashes, self.ids
        if depth <= len(ids):
            return ids[depth - 1]
        if len(hashes) < self._shared:
            upto = min(depth, self._shared)
            hashes.extend(self._known[0][len(hashes) : upto])
            ids.extend(self._known[1][len(ids) : upto])
        size, known_hashes, known_ids = self.hasher.block_size, self._known[0], self._known[1]
        while len(hashes) < depth:
            done = len(hashes)
            start = done * size
            block = self.token_ids[start : start + size]
            if (
                self._reusing
                and done < len(known_hashes)
                and self._known_tokens[start : start + size] == block
            ):
                hashes.append(known_hashes[done])
                ids.append(known_ids[done])
                continue
            self._reusing = False
            parent = hashes[-1] if hashes else self.hasher.none_hash
            hashes.append(self.hasher.chain_from(parent, block, self._salt if done == 0 else None))
            ids.append(external_id(hashes[-1]))
        return ids[depth - 1]

    @property
    def extends_known(self) -> bool:
        """Whether every hash so far came from the known prompt (which may reach further)."""
        return self._reusing and len(self.hashes) <= len(self._known[0])


class PromptHashes:
    """An LRU of conversations' last predicted block hashes."""

    def __init__(self, *, max_conversations: int = 100_000, max_blocks: int = 1 << 20) -> None:
        if max_conversations <= 0 or max_blocks <= 0:
            raise ValueError("max_conversations and max_blocks must be positive")
        self.max_conversations = max_conversations
        self.max_blocks = max_blocks
        self._items: OrderedDict[Hashable, tuple[_HashKey, Sequence[int], list[bytes], list[int]]] = (
            OrderedDict()
        )
        self._blocks = 0

    def __len__(self) -> int:
        return len(self._items)

    def walk(
        self, conversation: Hashable, hasher: BlockHasher, token_ids: Sequence[int], cache_salt: str | None
    ) -> HashWalk:
        """A walk over the prompt's hashes; hand it back to `keep` when done."""
        known = self._items.get(conversation)
        if known is None or known[0] != _hash_key(hasher, cache_salt):
            return HashWalk(hasher, token_ids, cache_salt)
        return HashWalk(hasher, token_ids, cache_salt, known[1], (known[2], known[3]))

    def keep(self, conversation: Hashable, walk: HashWalk, cache_salt: str | None) -> None:
        """Remembers what the walk computed for the conversation's next prompt."""
        key = _hash_key(walk.hasher, cache_salt)
        known = self._items.get(conversation)
        if walk.extends_known and known is not None and known[0] == key:
            self._items.move_to_end(conversation)  # the known prompt reaches at least as far
            return
        self.forget(conversation)
        if not walk.hashes or len(walk.hashes) > self.max_blocks:
            return
        self._items[conversation] = (key, walk.token_ids, walk.hashes, walk.ids)
        self._blocks += len(walk.hashes)
        while self._blocks > self.max_blocks or len(self._items) > self.max_conversations:
            _, (_, _, hashes, _) = self._items.popitem(last=False)
            self._blocks -= len(hashes)

    def forget(self, conversation: Hashable) -> None:
        old = self._items.pop(conversation, None)
        if old is not None:
            self._blocks -= len(old[2])


def _hash_key(hasher: BlockHasher, cache_salt: str | None) -> _HashKey:
    return (hasher.block_size, hasher.algo, hasher.none_hash, cache_salt)
