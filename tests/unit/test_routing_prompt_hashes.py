"""A conversation's predicted block hashes, reused by its next prompt only where the tokens agree."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvplane.services.common.model.block_hashes import BlockHasher, external_id
from kvplane.services.routing.state.prompt_hashes import PromptHashes


class CountingHasher(BlockHasher):
    def __init__(self) -> None:
        super().__init__(16)
        self.calls = 0

    def chain_from(self, parent: bytes, block_tokens: Sequence[int], extra: Any = None) -> bytes:
        self.calls += 1
        return super().chain_from(parent, block_tokens, extra)


def prompt(blocks: int, seed: int = 1) -> list[int]:
    return [(seed * 31 + i * 7) % 5000 + 1 for i in range(16 * blocks)]


def walk_all(
    memo: PromptHashes, hasher: BlockHasher, tokens: list[int], salt: str | None = None
) -> list[bytes]:
    walk = memo.walk("c", hasher, tokens, salt)
    ids = [walk.block_id(d) for d in range(1, len(tokens) // 16 + 1)]
    memo.keep("c", walk, salt)
    assert ids == [external_id(h) for h in walk.hashes]
    return walk.hashes


def test_a_later_prompt_hashes_only_its_new_blocks_and_gets_the_same_hashes() -> None:
    memo, hasher = PromptHashes(), CountingHasher()
    first = prompt(10)
    assert walk_all(memo, hasher, first) == hasher.full_hashes(first)
    hasher.calls = 0
    later = [*first, *prompt(3, seed=2)]
    assert walk_all(memo, hasher, later) == BlockHasher(16).full_hashes(later)
    assert hasher.calls == 3


def test_a_prompt_that_differs_is_hashed_from_the_first_block_that_differs() -> None:
    memo, hasher = PromptHashes(), CountingHasher()
    first = prompt(10)
    walk_all(memo, hasher, first)
    edited = list(first)
    edited[16 * 4 + 3] += 1
    hasher.calls = 0
    assert walk_all(memo, hasher, edited) == BlockHasher(16).full_hashes(edited)
    assert hasher.calls == 6


def test_another_salt_reuses_nothing() -> None:
    memo, hasher = PromptHashes(), CountingHasher()
    tokens = prompt(4)
    walk_all(memo, hasher, tokens, "a")
    hasher.calls = 0
    assert walk_all(memo, hasher, tokens, "b") == BlockHasher(16).full_hashes(tokens, "b")
    assert hasher.calls == 4


def test_memory_is_bounded_in_blocks_and_conversations() -> None:
    memo, hasher = PromptHashes(max_conversations=2, max_blocks=12), BlockHasher(16)
    for conversation in ("a", "b", "c"):
        walk = memo.walk(conversation, hasher, prompt(5), None)
        walk.block_id(5)
        memo.keep(conversation, walk, None)
    assert len(memo) == 2
    walk = memo.walk("d", hasher, prompt(20), None)
    walk.block_id(20)
    memo.keep("d", walk, None)
    assert len(memo) == 2  # 20 blocks exceed the bound: not kept
    memo.forget("c")
    assert len(memo) == 1
