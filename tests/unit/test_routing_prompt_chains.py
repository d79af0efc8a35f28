"""A conversation's prompt chain: only the blocks that changed since its last turn are hashed."""

from __future__ import annotations

import pytest

from kvplane.connector import digests as token_digests
from kvplane.services.routing.policy import Prompt
from kvplane.services.routing.state.prompt_chains import PromptChains
from tests.unit.routing_policy_fixtures import history

H = history(4000)
KEY = ("t", "c")


def chained(chains: PromptChains, ids: list[int], key: object = KEY) -> tuple[int, ...]:
    prompt = chains.with_chain(key, Prompt(len(ids), ids), 16)
    assert prompt.digest_block_size == 16 and prompt.token_ids == ids
    return tuple(prompt.block_digests)


@pytest.mark.parametrize(
    "second",
    [
        [*H, *history(100, seed=3)],
        [*H[:3000], 5, *H[3001:]],
        H[:1000],
        [9, *H[1:]],
        history(5000, seed=4),
    ],
    ids=["continued", "edited", "cut", "first token changed", "unrelated"],
)
def test_each_turns_chain_equals_a_full_hash(second: list[int]) -> None:
    chains = PromptChains()
    assert chained(chains, H) == tuple(token_digests.chain(H, 16))
    assert chained(chains, second) == tuple(token_digests.chain(second, 16))


def test_the_unchanged_blocks_are_not_hashed_again(monkeypatch: pytest.MonkeyPatch) -> None:
    chains = PromptChains()
    chained(chains, H)
    hashed: list[int] = []
    real = token_digests.chain_from

    def counting(previous: int | None, raw: bytes, block_size: int) -> list[int]:
        hashed.append(len(raw) // (4 * block_size))
        return real(previous, raw, block_size)

    monkeypatch.setattr(token_digests, "chain_from", counting)
    chained(chains, [*H, *history(160, seed=3)])
    assert hashed == [10]


def test_given_block_digests_or_a_bare_length_are_left_alone() -> None:
    chains = PromptChains()
    given = Prompt(32, (), (1, 2), 16)
    assert chains.with_chain(KEY, given, 16) is given
    bare = Prompt(4000)
    assert chains.with_chain(KEY, bare, 16) is bare


def test_the_cache_stays_within_its_token_budget() -> None:
    chains = PromptChains(max_tokens=10_000)
    for i in range(5):
        chained(chains, history(4000, seed=i), key=("t", f"c{i}"))
    assert len(chains) == 2


def test_a_prompt_nothing_asks_to_prove_is_never_hashed(monkeypatch: pytest.MonkeyPatch) -> None:
    nxt = [*H, *history(160, seed=3)]
    expected = tuple(token_digests.chain(nxt, 16))
    hashed: list[int] = []
    real = token_digests.chain_from

    def counting(previous: int | None, raw: bytes, block_size: int) -> list[int]:
        hashed.append(len(raw) // (4 * block_size))
        return real(previous, raw, block_size)

    monkeypatch.setattr(token_digests, "chain_from", counting)
    chains = PromptChains()
    prompt = chains.with_chain(KEY, Prompt(len(H), H), 16)
    assert len(prompt.block_digests) == len(H) // 16
    assert hashed == []
    # The next turn, asked for its chain, hashes each of its blocks once.
    later = chains.with_chain(KEY, Prompt(len(nxt), nxt), 16)
    assert tuple(later.block_digests) == expected
    assert hashed == [len(nxt) // 16]


def test_a_chain_dropped_before_it_was_needed_proves_nothing() -> None:
    chains = PromptChains(max_tokens=5000)
    lost = chains.with_chain(("t", "a"), Prompt(len(H), H), 16)
    chains.with_chain(("t", "b"), Prompt(len(H), history(4000, seed=2)), 16)
    with pytest.raises(LookupError):
        lost.block_digests[0]
