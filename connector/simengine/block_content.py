"""What the bytes of a simulated KV block are, so any reader can check them.

A block's payload is a pure function of (chain hash of the token prefix up to
and including the block's valid tokens, block index). A reader that knows the
tokens it expects can therefore recompute every byte it pulled and compare.

The last 16 bytes of every block are a *lease trailer*: the holder writes a
stamp derived from (engine id, incarnation, request id) while the block is
retained for a remote reader and clears it when it frees the block. Freed
blocks keep their payload (they stay in the prefix cache, as in vLLM), so the
trailer is what lets a reader tell a live handle from a consumed, expired or
restarted one.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

TRAILER_BYTES = 16
TRAILER_WORDS = TRAILER_BYTES // 8
MIN_BLOCK_BYTES = 64

_GOLDEN = 0x9E3779B97F4A7C15
_WORD_STEP = 0xD6E8FEB86659FD93
_TRAILER_MAGIC = 0x6B76706C616E6521  # ascii "kvplane!"
_POISON = 0xDEADBEEFDEADBEEF
_MASK64 = (1 << 64) - 1
# Blocks written or checked per vectorized step (bounds the temporary arrays).
_BATCH = 256

Words = npt.NDArray[np.uint64]


class BlockCheck(enum.Enum):
    """Outcome of checking one pulled block."""

    OK = "ok"
    # Payload does not match the reader's tokens: a different prefix, or a
    # block that was reused for other tokens.
    WRONG_PREFIX = "wrong_prefix"
    # Payload may be right but the holder no longer leases the block to this
    # handle: already read (single use), expired, released, or a restart.
    NOT_LEASED = "not_leased"


def mix64(x: int) -> int:
    """splitmix64 finaliser: a cheap, well-spread 64-bit mix."""
    x &= _MASK64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    return x


def root_hash(salt: str) -> int:
    """Hash that starts every chain; engines with different salts (models) never match."""
    return int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8).digest(), "little")


def salt_key(cache_salt: str | None) -> int:
    """The prefix-cache key of a request's `cache_salt`: 0 (none) or a 64-bit hash of it."""
    if not cache_salt:
        return 0
    digest = hashlib.blake2b(cache_salt.encode(), digest_size=8, person=b"cache_salt").digest()
    return int.from_bytes(digest, "little") or 1


def chain_hash(parent: int, tokens: Sequence[int] | npt.NDArray[np.int64]) -> int:
    """Hash of one block's tokens chained on its parent's hash."""
    data = np.asarray(tokens, dtype="<i8").tobytes()
    return _chain(parent, data, len(data) // 8)


def _chain(parent: int, data: bytes | memoryview, count: int) -> int:
    h = hashlib.blake2b(parent.to_bytes(8, "little") + count.to_bytes(4, "little"), digest_size=8)
    h.update(data)
    return int.from_bytes(h.digest(), "little")


def block_hashes(
    tokens: Sequence[int],
    block_size: int,
    root: int,
    num_tokens: int | None = None,
    known_full: Sequence[int] = (),
) -> list[int]:
    """Chain hash of each block covering tokens[:num_tokens].

    Full blocks chain on the previous full block; a final partial block is
    hashed over its valid tokens only, so its hash differs from the hash the
    same block gets once it is full. ``known_full`` are hashes of leading
    whole blocks already computed for the same tokens; they are reused.
    """
    n = len(tokens) if num_tokens is None else num_tokens
    if n > len(tokens):
        raise ValueError(f"num_tokens {n} exceeds the {len(tokens)} tokens given")
    known = list(known_full[: n // block_size])
    start_block = len(known)
    raw = memoryview(np.asarray(tokens[start_block * block_size : n], dtype="<i8").tobytes())
    out = known
    parent = known[-1] if known else root
    for start in range(0, n - start_block * block_size, block_size):
        chunk = raw[start * 8 : (start + block_size) * 8]
        h = _chain(parent, chunk, len(chunk) // 8)
        out.append(h)
        parent = h
    return out


def full_block_hashes(tokens: Sequence[int], block_size: int, root: int) -> list[int]:
    """Chain hashes of the whole blocks only (what a prefix cache can match)."""
    n = (len(tokens) // block_size) * block_size
    return block_hashes(tokens, block_size, root, n)


class ContentModel:
    """Computes and checks block bytes for one pool geometry."""

    def __init__(self, bytes_per_block: int) -> None:
        if bytes_per_block < MIN_BLOCK_BYTES or bytes_per_block % 8:
            raise ValueError(f"bytes_per_block must be a multiple of 8 and >= {MIN_BLOCK_BYTES}")
        self.bytes_per_block = bytes_per_block
        self.words = bytes_per_block // 8
        self.payload_words = self.words - TRAILER_WORDS
        # Precomputed once: payload word i is seed ^ (i * step), one vector XOR per block.
        self._ramp = np.arange(self.payload_words, dtype=np.uint64) * np.uint64(_WORD_STEP)

    def payload(self, block_hash: int, block_index: int) -> Words:
        seed = mix64(block_hash ^ ((block_index * _GOLDEN) & _MASK64))
        return self._ramp ^ np.uint64(seed)

    def write_payload(self, block: Words, block_hash: int, block_index: int) -> None:
        np.bitwise_xor(
            self._ramp,
            np.uint64(mix64(block_hash ^ ((block_index * _GOLDEN) & _MASK64))),
            out=block[: self.payload_words],
        )

    def seeds(self, hashes: Sequence[int], first_index: int) -> Words:
        """Per-block payload seeds of consecutive blocks starting at position ``first_index``."""
        return np.array(
            [mix64(h ^ (((first_index + k) * _GOLDEN) & _MASK64)) for k, h in enumerate(hashes)],
            dtype=np.uint64,
        )

    def write_many(
        self, array: Words, block_ids: Sequence[int], hashes: Sequence[int], first_index: int
    ) -> None:
        """Write the payloads of consecutive blocks (positions first_index...) into ``array`` rows."""
        seeds = self.seeds(hashes, first_index)
        for lo in range(0, len(block_ids), _BATCH):
            ids = np.asarray(block_ids[lo : lo + _BATCH], dtype=np.int64)
            array[ids, : self.payload_words] = self._ramp[None, :] ^ seeds[lo : lo + _BATCH, None]

    def check_many(
        self, array: Words, block_ids: Sequence[int], hashes: Sequence[int], first_index: int, stamp: int
    ) -> tuple[int, BlockCheck]:
        """(offset of the first bad block, why); (-1, OK) when every block checks."""
        seeds = self.seeds(hashes, first_index)
        for lo in range(0, len(block_ids), _BATCH):
            rows = array[np.asarray(block_ids[lo : lo + _BATCH], dtype=np.int64)]
            leased = (rows[:, -2] == np.uint64(stamp)) & (rows[:, -1] == np.uint64(stamp ^ _TRAILER_MAGIC))
            if not leased.all():
                return lo + int(np.argmin(leased)), BlockCheck.NOT_LEASED
            good = (
                (rows[:, : self.payload_words] ^ self._ramp[None, :]) == seeds[lo : lo + _BATCH, None]
            ).all(axis=1)
            if not good.all():
                return lo + int(np.argmin(good)), BlockCheck.WRONG_PREFIX
        return -1, BlockCheck.OK

    def poison(self, block: Words) -> None:
        block[:] = np.uint64(_POISON)

    @staticmethod
    def set_trailer(block: Words, stamp: int) -> None:
        block[-2] = np.uint64(stamp)
        block[-1] = np.uint64(stamp ^ _TRAILER_MAGIC)

    @staticmethod
    def clear_trailer(block: Words) -> None:
        block[-2:] = np.uint64(0)

    def check(self, block: Words, block_hash: int, block_index: int, stamp: int) -> BlockCheck:
        if int(block[-2]) != stamp or int(block[-1]) != stamp ^ _TRAILER_MAGIC:
            return BlockCheck.NOT_LEASED
        if not np.array_equal(block[: self.payload_words], self.payload(block_hash, block_index)):
            return BlockCheck.WRONG_PREFIX
        return BlockCheck.OK


def lease_stamp(engine_id: str, incarnation: str, request_id: str) -> int:
    """Non-zero stamp a holder writes into the trailers of a handle's blocks."""
    h = hashlib.blake2b(f"{engine_id}\0{incarnation}\0{request_id}".encode(), digest_size=8)
    return int.from_bytes(h.digest(), "little") | 1
