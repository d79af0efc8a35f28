"""Chained digests of token blocks, to check that a prompt continues a handle.

The decode engine digests the tokens whose KV it retains; the prefill side
(and the router) digest the new prompt the same way and compare. Each block's
digest chains the previous one, so equal digests after block k mean equal
tokens in blocks 0..k (to 64-bit collision odds).

A handle keeps the chain only at *checkpoints*, a pure function of the number
of blocks: about 64 evenly spaced ones, every one of the last 8 blocks, and
then blocks at powers of two back from the end. Edits near the end of a
conversation (a stripped reasoning trace, a retried or edited last turn) are
the common case, so resolution is finest there; a 32k-token handle stays near
700 bytes.

The tokens after the last whole block have no block digest: the decode engine adds a *tail
digest* of them (`tail_digest`, at `KEY_TAIL_DIGEST`), so a prompt that continues every token of
a handle verifies the partial last block too.
"""

from __future__ import annotations

import base64
import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

VERSION = 1
_LINEAR_CHECKPOINTS = 64
_DENSE_TAIL = 8
_SEED_TAG = b"kvplane-token-digest-v1"
# Digest of the handle's tokens after its last whole block, set by the decode side.
KEY_TAIL_DIGEST = "kvplane_tail_digest"
_TAIL_TAG = b"kvplane-tail-digest-v1"


class DigestFormatError(ValueError):
    """An encoded digest that cannot be decoded."""


@dataclass(frozen=True, slots=True)
class TokenDigests:
    """Chain values at `checkpoints(num_blocks)`, in that order."""

    block_size: int
    num_blocks: int
    values: tuple[int, ...]
    version: int = VERSION

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise DigestFormatError("block_size must be positive")
        if len(self.values) != len(checkpoints(self.num_blocks)):
            raise DigestFormatError("values do not match the checkpoints of num_blocks")


def checkpoints(num_blocks: int) -> tuple[int, ...]:
    """Prefix lengths, in blocks, at which the chain is kept. Ascending."""
    if num_blocks <= 0:
        return ()
    stride = 1
    while -(-num_blocks // stride) > _LINEAR_CHECKPOINTS:
        stride *= 2
    points = set(range(stride, num_blocks + 1, stride))
    points.update(range(max(1, num_blocks - _DENSE_TAIL + 1), num_blocks + 1))
    back = _DENSE_TAIL
    while num_blocks - back >= 1:
        points.add(num_blocks - back)
        back *= 2
    return tuple(sorted(points))


def _seed(block_size: int) -> bytes:
    return hashlib.blake2b(_SEED_TAG + struct.pack("<I", block_size), digest_size=8).digest()


def chain(token_ids: Sequence[int] | np.ndarray, block_size: int) -> list[int]:
    """The chained digest after every whole block of `token_ids`."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    tokens = np.asarray(token_ids, dtype="<u4")
    whole = len(tokens) // block_size
    return chain_from(None, tokens[: whole * block_size].tobytes(), block_size)


def chain_from(previous: int | None, raw: bytes, block_size: int) -> list[int]:
    """The chain over the whole blocks of `raw` (little-endian uint32 token ids), continuing
    from the digest `previous` of the blocks before them (None: from the start)."""
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    step = block_size * 4
    prev = _seed(block_size) if previous is None else previous.to_bytes(8, "little")
    chained: list[bytes] = []
    keep = chained.append
    blake2b = hashlib.blake2b
    for start in range(0, len(raw) - step + 1, step):
        prev = blake2b(prev + raw[start : start + step], digest_size=8).digest()
        keep(prev)
    # One conversion of all the digests to integers, not one call per block.
    values: list[int] = np.frombuffer(b"".join(chained), dtype="<u8").tolist()
    return values


def digest_tokens(token_ids: Sequence[int] | np.ndarray, block_size: int) -> TokenDigests:
    """Digests of the whole blocks of `token_ids` (a partial last block is ignored)."""
    full = chain(token_ids, block_size)
    points = checkpoints(len(full))
    return TokenDigests(block_size, len(full), tuple(full[p - 1] for p in points))


def verified_prefix_blocks_from_chain(digests: TokenDigests, prompt_chain: Sequence[int]) -> int:
    """Longest checkpoint prefix, in blocks, on which `prompt_chain` agrees."""
    values = dict(zip(checkpoints(digests.num_blocks), digests.values, strict=True))
    for point in sorted(values, reverse=True):
        if point <= len(prompt_chain) and prompt_chain[point - 1] == values[point]:
            return point
    return 0


def verified_prefix_blocks(digests: TokenDigests, prompt_token_ids: Sequence[int] | np.ndarray) -> int:
    """Whole blocks of the handle that the prompt provably starts with."""
    limit = min(digests.num_blocks, len(prompt_token_ids) // digests.block_size)
    prompt_chain = chain(np.asarray(prompt_token_ids)[: limit * digests.block_size], digests.block_size)
    return verified_prefix_blocks_from_chain(digests, prompt_chain)


def tail_digest(token_ids: Sequence[int], block_size: int) -> str:
    """Digest of the tokens after the last whole block (the block digests cover the rest)."""
    whole = len(token_ids) // block_size
    tail = token_ids[whole * block_size :]
    raw = struct.pack(f"<I{len(tail)}I", len(tail), *tail)
    return hashlib.blake2b(_TAIL_TAG + raw, digest_size=8).hexdigest()


_HEADER = struct.Struct("<BII")


def encode(digests: TokenDigests) -> str:
    """Compact URL-safe text for a JSON field (kv_transfer_params)."""
    body = _HEADER.pack(digests.version, digests.block_size, digests.num_blocks)
    body += struct.pack(f"<{len(digests.values)}Q", *digests.values)
    return base64.urlsafe_b64encode(body).decode("ascii")


def decode(text: str) -> TokenDigests:
    """Inverse of `encode`."""
    try:
        raw = base64.urlsafe_b64decode(text.encode("ascii"))
        version, block_size, num_blocks = _HEADER.unpack_from(raw)
    except (ValueError, struct.error, UnicodeEncodeError) as exc:
        raise DigestFormatError(f"undecodable digests: {exc}") from None
    if version != VERSION:
        raise DigestFormatError(f"unsupported digest version {version}")
    count, rest = divmod(len(raw) - _HEADER.size, 8)
    if rest:
        raise DigestFormatError("truncated digests")
    values = struct.unpack_from(f"<{count}Q", raw, _HEADER.size)
    return TokenDigests(block_size, num_blocks, tuple(values), version)
