"""vLLM's KV-cache events on the wire: the batches an engine publishes with `--kv-events-config`.

The engine publishes on a ZMQ PUB socket three frames per batch: the topic, the batch's sequence
number (8 bytes, big-endian, counting from 0 at each engine start), and the batch as msgpack:
`[ts, [event, ...], data_parallel_rank]`. A ROUTER replay socket answers a request
`["", seq(8 bytes)]` with every buffered batch from `seq` on, framed `["", topic, seq, payload]`,
then an end marker whose sequence number is -1 and whose payload is empty.

Events are `BlockStored`, `BlockRemoved` and `AllBlocksCleared`, in one of two encodings, both
read here: vLLM 0.32 and 0.33 write each event as a map with a `type` field naming it; earlier
releases wrote a tagged array (`["BlockStored", block_hashes, parent_block_hash, ...]`, fields in
declaration order). Block hashes are 64-bit integers by default, or the whole hash as bytes when
the engine runs with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`; `decode_batch` turns both into the
integer ids of `block_hashes.external_id`. An event of a type this module does not know is
skipped and counted (`DecodedBatch.unknown`), never guessed at.

`encode_batch` writes either encoding, for the sim-engine, which publishes what vLLM publishes.

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import msgspec

from kvplane.services.common.model.block_hashes import external_id

Encoding = Literal["map", "array"]
ENCODINGS: Final[tuple[Encoding, ...]] = ("map", "array")
# The sequence number of the replay socket's end marker.
END_SEQ: Final = (-1).to_bytes(8, "big", signed=True)
MEDIUM_GPU: Final = "GPU"
MEDIUM_CPU: Final = "CPU"

BlockHash = int | bytes


class EventFormatError(ValueError):
    """A payload that is not a KV event batch."""


# ---- the two wire forms of each event (the array form's order is the fields' order here) ----

_STORED_HEAD: Final[list[Any]] = [
    ("block_hashes", list[BlockHash]),
    ("parent_block_hash", BlockHash | None),
    ("token_ids", list[int]),
    ("block_size", int),
    ("lora_id", int | None),
    ("medium", str | None),
]
_STORED_TAIL: Final[list[Any]] = [
    ("extra_keys", list[Any] | None, None),
    ("group_idx", int | None, None),
    ("kv_cache_spec_kind", str | None, None),
    ("kv_cache_spec_sliding_window", int | None, None),
    ("locality", str | None, None),
    ("ownership", str | None, None),
    ("session_id", str | None, None),
]
_REMOVED: Final[list[Any]] = [
    ("block_hashes", list[BlockHash]),
    ("medium", str | None),
    ("group_idx", int | None, None),
    ("locality", str | None, None),
    ("ownership", str | None, None),
]
# vLLM writes `lora_name` always, `null` included; the array form of earlier releases may end
# before it.
_MAP_LORA: Final = ("lora_name", str | None)
_ARRAY_LORA: Final = ("lora_name", str | None, None)


def _event(name: str, fields: list[Any], array: bool) -> type[msgspec.Struct]:
    return msgspec.defstruct(name, fields, tag=name, array_like=array, omit_defaults=True, gc=False)


_MapStored: Any = _event("BlockStored", [*_STORED_HEAD, _MAP_LORA, *_STORED_TAIL], array=False)
_MapRemoved: Any = _event("BlockRemoved", _REMOVED, array=False)
_MapCleared: Any = _event("AllBlocksCleared", [], array=False)
_ArrayStored: Any = _event("BlockStored", [*_STORED_HEAD, _ARRAY_LORA, *_STORED_TAIL], array=True)
_ArrayRemoved: Any = _event("BlockRemoved", _REMOVED, array=True)
_ArrayCleared: Any = _event("AllBlocksCleared", [], array=True)


class _Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


_MAP_DECODER: Final[msgspec.msgpack.Decoder[Any]] = msgspec.msgpack.Decoder(
    _MapStored | _MapRemoved | _MapCleared
)
_ARRAY_DECODER: Final[msgspec.msgpack.Decoder[Any]] = msgspec.msgpack.Decoder(
    _ArrayStored | _ArrayRemoved | _ArrayCleared
)
_BATCH_DECODER: Final = msgspec.msgpack.Decoder(_Batch)
_ENCODER: Final = msgspec.msgpack.Encoder()

# ---- kvplane's view of an event ----


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Blocks now in the engine's cache on `medium`, in prefix order after `parent`."""

    block_ids: tuple[int, ...]
    parent_id: int | None
    token_ids: tuple[int, ...]
    block_size: int
    medium: str | None = MEDIUM_GPU
    extra_keys: tuple[Any, ...] | None = None
    group_idx: int | None = None
    lora_name: str | None = None
    session_id: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks evicted from `medium`."""

    block_ids: tuple[int, ...]
    medium: str | None = MEDIUM_GPU
    group_idx: int | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The engine dropped its whole cache (a reset, or the first event after a start)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class DecodedBatch:
    ts: float
    events: tuple[KVEvent, ...]
    data_parallel_rank: int | None = None
    unknown: int = 0  # events of a type not known here, skipped


def _is_map(raw: bytes) -> bool:
    first = raw[0] if raw else 0
    return 0x80 <= first <= 0x8F or first in (0xDE, 0xDF)


_KNOWN_TAGS: Final = frozenset({"BlockStored", "BlockRemoved", "AllBlocksCleared"})


def _tag(raw: msgspec.Raw) -> str | None:
    """The type an event names, read only to tell an unknown type from a malformed event."""
    try:
        value = msgspec.msgpack.decode(raw)
    except msgspec.DecodeError:
        return None
    tag = value.get("type") if isinstance(value, dict) else (value[0] if value else None)
    return tag if isinstance(tag, str) else None


def _ids(hashes: Sequence[BlockHash]) -> tuple[int, ...]:
    return tuple(external_id(h) for h in hashes)


def _to_view(event: Any) -> KVEvent:
    if isinstance(event, (_MapStored, _ArrayStored)):
        return BlockStored(
            block_ids=_ids(event.block_hashes),
            parent_id=None if event.parent_block_hash is None else external_id(event.parent_block_hash),
            token_ids=tuple(event.token_ids),
            block_size=event.block_size,
            medium=event.medium,
            extra_keys=None if event.extra_keys is None else tuple(event.extra_keys),
            group_idx=event.group_idx,
            lora_name=event.lora_name,
            session_id=event.session_id,
        )
    if isinstance(event, (_MapRemoved, _ArrayRemoved)):
        return BlockRemoved(
            block_ids=_ids(event.block_hashes), medium=event.medium, group_idx=event.group_idx
        )
    return AllBlocksCleared()


def decode_batch(payload: bytes) -> DecodedBatch:
    """One published batch, in either encoding. Raises EventFormatError on a malformed batch."""
    try:
        batch = _BATCH_DECODER.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise EventFormatError(f"not a KV event batch: {exc}") from exc
    events: list[KVEvent] = []
    unknown = 0
    for raw in batch.events:
        decoder = _MAP_DECODER if _is_map(bytes(raw)) else _ARRAY_DECODER
        try:
            decoded = decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            if _tag(raw) not in _KNOWN_TAGS:
                unknown += 1
                continue
            raise EventFormatError(f"malformed KV event: {exc}") from exc
        events.append(_to_view(decoded))
    return DecodedBatch(batch.ts, tuple(events), batch.data_parallel_rank, unknown)


def _to_wire(event: KVEvent, encoding: Encoding) -> Any:
    array = encoding == "array"
    if isinstance(event, BlockStored):
        stored = _ArrayStored if array else _MapStored
        return stored(
            block_hashes=list(event.block_ids),
            parent_block_hash=event.parent_id,
            token_ids=list(event.token_ids),
            block_size=event.block_size,
            lora_id=None,
            medium=event.medium,
            lora_name=event.lora_name,
            extra_keys=None if event.extra_keys is None else list(event.extra_keys),
            group_idx=event.group_idx,
            session_id=event.session_id,
        )
    if isinstance(event, BlockRemoved):
        removed = _ArrayRemoved if array else _MapRemoved
        return removed(block_hashes=list(event.block_ids), medium=event.medium, group_idx=event.group_idx)
    return _ArrayCleared() if array else _MapCleared()


def encode_batch(
    ts: float,
    events: Sequence[KVEvent],
    encoding: Encoding = "map",
    data_parallel_rank: int | None = None,
) -> bytes:
    """A batch as an engine of the given encoding publishes it."""
    if encoding not in ENCODINGS:
        raise ValueError(f"unknown KV event encoding {encoding!r}; one of {ENCODINGS}")
    wire = [msgspec.Raw(_ENCODER.encode(_to_wire(e, encoding))) for e in events]
    return _ENCODER.encode(_Batch(ts=ts, events=wire, data_parallel_rank=data_parallel_rank))


def seq_bytes(seq: int) -> bytes:
    """A batch's sequence number frame."""
    return seq.to_bytes(8, "big", signed=True)


def seq_of(frame: bytes) -> int:
    """The sequence number in a frame (-1 for the replay's end marker)."""
    if len(frame) != 8:
        raise EventFormatError(f"a sequence number is 8 bytes, not {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)
