"""vLLM's KV event batches read in both encodings, and written as vLLM writes them."""

from __future__ import annotations

import msgspec
import pytest

from kvplane.services.common.model.block_hashes import BlockHasher
from kvplane.services.common.model.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventFormatError,
    decode_batch,
    encode_batch,
    seq_bytes,
    seq_of,
)

# A batch as vLLM 0.32's publisher encodes it (`KVEventBatch` of a BlockStored with a salt and a
# session id, a BlockRemoved on CPU, an AllBlocksCleared), captured from its msgspec encoder.
VLLM_032_BATCH = bytes.fromhex(
    "93cb3ff4000000000000938aa474797065ab426c6f636b53746f726564ac626c6f636b5f686173686573920b16"
    "b1706172656e745f626c6f636b5f68617368c0a9746f6b656e5f696473dc0040000102030405060708090a0b0c"
    "0d0e0f101112131415161718191a1b1c1d1e1f202122232425262728292a2b2c2d2e2f30313233343536373839"
    "3a3b3c3d3e3faa626c6f636b5f73697a6520a76c6f72615f6964c0a66d656469756da3475055a96c6f72615f6e"
    "616d65c0aa65787472615f6b6579739291a874656e616e742d61c0aa73657373696f6e5f6964a6636f6e762d31"
    "83a474797065ac426c6f636b52656d6f766564ac626c6f636b5f686173686573910ba66d656469756da3435055"
    "81a474797065b0416c6c426c6f636b73436c6561726564c0"
)


def test_reads_a_batch_vllm_032_published() -> None:
    batch = decode_batch(VLLM_032_BATCH)
    stored, removed, cleared = batch.events
    assert batch.ts == 1.25 and batch.unknown == 0
    assert isinstance(stored, BlockStored)
    assert stored.block_ids == (11, 22) and stored.parent_id is None
    assert stored.token_ids == tuple(range(64)) and stored.block_size == 32
    assert stored.medium == "GPU" and stored.session_id == "conv-1"
    assert stored.extra_keys is not None and list(stored.extra_keys[0]) == ["tenant-a"]
    assert removed == BlockRemoved(block_ids=(11,), medium="CPU")
    assert cleared == AllBlocksCleared()


class _OldEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class _OldStored(_OldEvent, tag="BlockStored"):
    """The tagged-array form of vLLM releases before the map encoding: no newer fields."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class _OldRemoved(_OldEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class _OldBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[_OldStored | _OldRemoved]
    data_parallel_rank: int | None = None


def test_reads_the_tagged_array_encoding_of_earlier_releases() -> None:
    payload = msgspec.msgpack.encode(
        _OldBatch(
            ts=2.0,
            events=[_OldStored([7, 8], 6, list(range(64)), 32, None, "GPU"), _OldRemoved([7], "GPU")],
        )
    )
    stored, removed = decode_batch(payload).events
    assert stored == BlockStored((7, 8), 6, tuple(range(64)), 32, medium="GPU")
    assert removed == BlockRemoved((7,), medium="GPU")


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_what_is_written_reads_back_in_either_encoding(encoding: str) -> None:
    ids = BlockHasher(32).ids(list(range(96)))
    events = (
        AllBlocksCleared(),
        BlockStored(tuple(ids[1:]), ids[0], tuple(range(32, 96)), 32, session_id="c"),
        BlockRemoved(tuple(ids[:1]), medium="CPU"),
    )
    batch = decode_batch(encode_batch(3.5, events, encoding, data_parallel_rank=0))  # type: ignore[arg-type]
    assert batch.events == events and batch.ts == 3.5 and batch.data_parallel_rank == 0


def test_written_map_batches_are_what_vllm_writes() -> None:
    stored = BlockStored(
        (11, 22), None, tuple(range(64)), 32, extra_keys=(("tenant-a",), None), session_id="conv-1"
    )
    ours = encode_batch(1.25, [stored, BlockRemoved((11,), medium="CPU"), AllBlocksCleared()])
    assert msgspec.msgpack.decode(ours) == msgspec.msgpack.decode(VLLM_032_BATCH)


def test_whole_hashes_as_bytes_become_the_same_ids() -> None:
    hasher = BlockHasher(32)
    whole = hasher.full_hashes(list(range(64)))
    payload = msgspec.msgpack.encode(
        [0.0, [{"type": "BlockRemoved", "block_hashes": whole, "medium": "GPU"}]]
    )
    (removed,) = decode_batch(payload).events
    assert isinstance(removed, BlockRemoved)
    assert list(removed.block_ids) == hasher.ids(list(range(64)))


def test_an_unknown_event_type_is_skipped_and_counted() -> None:
    payload = msgspec.msgpack.encode([0.0, [{"type": "BlockPinned", "x": 1}, {"type": "AllBlocksCleared"}]])
    batch = decode_batch(payload)
    assert batch.events == (AllBlocksCleared(),) and batch.unknown == 1


@pytest.mark.parametrize(
    "payload",
    [
        b"\xc1",
        msgspec.msgpack.encode({"ts": 1}),
        msgspec.msgpack.encode([0.0, [{"type": "BlockRemoved", "block_hashes": "x"}]]),
        msgspec.msgpack.encode([0.0, [["BlockStored", [1]]]]),
    ],
)
def test_a_malformed_batch_is_refused(payload: bytes) -> None:
    with pytest.raises(EventFormatError):
        decode_batch(payload)


def test_sequence_frames() -> None:
    assert seq_of(seq_bytes(41)) == 41
    assert seq_of(END_SEQ) == -1
    with pytest.raises(EventFormatError):
        seq_of(b"\x00")
