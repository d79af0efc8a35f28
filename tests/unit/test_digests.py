"""Token digests: compact, chained, and finding the longest verified prefix."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvplane.connector import digests
from kvplane.connector.digests import DigestFormatError, checkpoints, decode, digest_tokens, encode
from kvplane.connector.digests import verified_prefix_blocks as verified
from kvplane.services.common.model import convert


def _tokens(n: int, seed: int = 0) -> list[int]:
    rnd = random.Random(seed)
    return [rnd.randrange(32000) for _ in range(n)]


def test_a_32k_token_handle_stays_under_one_kib_in_etcd() -> None:
    d = digest_tokens(_tokens(32768), 16)
    assert len(convert.digests_to_pb(d).SerializeToString()) < 1024


def test_exact_continuation_verifies_every_block() -> None:
    history = _tokens(1000)
    d = digest_tokens(history, 16)
    assert verified(d, history + _tokens(50, 1)) == 1000 // 16


@pytest.mark.parametrize("block_size", [16, 128])
def test_divergence_near_the_end_is_located_to_the_block(block_size: int) -> None:
    history = _tokens(20 * block_size + 5)
    d = digest_tokens(history, block_size)
    edited = list(history)
    edited[17 * block_size + 3] += 1  # inside block 17
    assert verified(d, edited) == 17


def test_divergence_far_back_verifies_a_shorter_prefix_never_a_longer_one() -> None:
    history = _tokens(32768)
    d = digest_tokens(history, 16)
    edited = list(history)
    edited[1000] += 1  # block 62
    got = verified(d, edited)
    assert got <= 62
    assert got >= 62 - 32  # checkpoints are at most 32 blocks apart for 2048 blocks


def test_prompt_shorter_than_the_handle_verifies_its_whole_blocks_on_a_checkpoint() -> None:
    history = _tokens(640)
    d = digest_tokens(history, 16)
    got = verified(d, history[:330])
    assert got in checkpoints(40) and got <= 330 // 16


def test_first_token_changed_verifies_nothing() -> None:
    history = _tokens(640)
    d = digest_tokens(history, 16)
    assert verified(d, [history[0] + 1, *history[1:]]) == 0


def test_block_size_is_part_of_the_digest() -> None:
    history = _tokens(512)
    a, b = digest_tokens(history, 16), digest_tokens(history, 32)
    assert a.values[0] != b.values[0]


def test_encoding_round_trips_and_rejects_garbage() -> None:
    d = digest_tokens(_tokens(5000), 16)
    assert decode(encode(d)) == d
    with pytest.raises(DigestFormatError):
        decode("not base64 !!")
    with pytest.raises(DigestFormatError):
        decode(encode(d)[:-4])


def test_checkpoints_are_dense_at_the_end_and_bounded() -> None:
    points = checkpoints(2048)
    assert points[-8:] == tuple(range(2041, 2049))
    assert len(points) <= 100
    assert checkpoints(0) == ()
    assert checkpoints(1) == (1,)


def test_chain_ignores_a_partial_last_block() -> None:
    assert len(digests.chain(_tokens(33), 16)) == 2


def test_version_1_digests_are_fixed_on_the_wire() -> None:
    # Engines, routers and simulators of different releases compare these values: a change to how
    # they are computed must come with a new VERSION, never silently.
    assert digests.chain(list(range(1, 40)), 16) == [17916282987563303011, 8209168131365619585]
    continued = digests.chain_from(8209168131365619585, np.arange(33, 65, dtype="<u4").tobytes(), 16)
    assert continued == digests.chain(list(range(1, 65)), 16)[2:]
