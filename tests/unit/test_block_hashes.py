"""Block hashes predicted from token ids equal the ones vLLM computes and publishes."""

from __future__ import annotations

import pytest

from kvplane.services.common.model.block_hashes import (
    BlockHasher,
    UnknownHashAlgo,
    external_id,
)

# 3 whole blocks of 32 and 5 tokens more.
TOKENS = [(i * 7919) % 31000 + 100 for i in range(3 * 32 + 5)]

# Computed by vLLM 0.32's own `hash_block_tokens` with its `sha256` / `sha256_cbor`, after
# `init_none_hash`, and `maybe_convert_block_hash` (the ids its KV events carry).
VLLM_IDS = {
    ("sha256", None): [13141248092387208277, 16194824171070972390, 7753810810242874246],
    ("sha256", "tenant-a"): [9126312843513863697, 13617404544607254423, 9318018667446931169],
    ("sha256_cbor", None): [5223295378849316688, 3407571750903733920, 14469358225669746093],
    ("sha256_cbor", "tenant-a"): [5595772174562004635, 15646228713831045901, 9936104814888552861],
}


@pytest.mark.parametrize(("algo", "salt"), sorted(VLLM_IDS, key=str))
def test_predicted_ids_equal_the_ones_vllm_computes(algo: str, salt: str | None) -> None:
    assert BlockHasher(32, algo).ids(TOKENS, salt) == VLLM_IDS[(algo, salt)]


def test_tokens_after_the_last_whole_block_have_no_hash() -> None:
    hasher = BlockHasher(32)
    assert len(hasher.ids(TOKENS)) == 3
    assert hasher.ids(TOKENS[:31]) == []
    assert hasher.ids(TOKENS[:64]) == hasher.ids(TOKENS)[:2]


def test_a_salt_changes_every_block_through_the_chain() -> None:
    hasher = BlockHasher(32)
    plain, salted = hasher.ids(TOKENS), hasher.ids(TOKENS, "tenant-a")
    assert all(a != b for a, b in zip(plain, salted, strict=True))
    assert hasher.ids(TOKENS, "") == plain  # vLLM treats an empty salt as none


def test_a_changed_token_changes_its_block_and_every_later_one_only() -> None:
    hasher = BlockHasher(32)
    edited = list(TOKENS)
    edited[40] += 1
    before, after = hasher.ids(TOKENS), hasher.ids(edited)
    assert before[0] == after[0]
    assert before[1] != after[1] and before[2] != after[2]


def test_chain_from_continues_a_chain_block_by_block() -> None:
    hasher = BlockHasher(32)
    full = hasher.full_hashes(TOKENS)
    assert hasher.chain_from(full[0], TOKENS[32:64]) == full[1]


def test_an_unpredictable_algorithm_is_refused_by_name() -> None:
    with pytest.raises(UnknownHashAlgo, match="xxhash"):
        BlockHasher(32, "xxhash")
    with pytest.raises(ValueError, match="positive"):
        BlockHasher(0)


def test_external_id_keeps_the_low_64_bits_of_bytes_or_ints() -> None:
    whole = BlockHasher(32).full_hashes(TOKENS)[0]
    assert external_id(whole) == VLLM_IDS[("sha256", None)][0]
    assert external_id(int.from_bytes(whole, "big")) == external_id(whole)
