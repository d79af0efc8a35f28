"""vLLM's prefix-cache block hashes, predicted from a prompt's token ids outside the engine.

vLLM keys every full block of its prefix cache by a hash chained through the previous block:
`hash_fn((parent_hash, tuple(block_tokens), extra_keys))`, where the first block's parent is
`NONE_HASH = hash_fn(seed)` and `hash_fn` is the engine's `--prefix-caching-hash-algo`
(`sha256`: SHA-256 over a pickle; `sha256_cbor`: SHA-256 over canonical CBOR). For the
cryptographic algorithms the seed is the fixed string "vllm-none-hash" (unless the engine runs
with PYTHONHASHSEED set, whose value is then the seed), so any process can compute the same
hashes. Its KV-cache events carry the low 64 bits of each hash, big-endian, as an integer: what
`external_id` returns, and what routing compares.

Extra keys: a request's `cache_salt` goes into the first block's extra keys only, as
`("cache_salt", salt)`. LoRA adapters, multimodal inputs and prompt embeddings add other keys;
kvplane predicts hashes for text prompts with an optional salt, and a prompt it cannot predict
(a LoRA or multimodal request) simply matches nothing: at worst a recompute, never a wrong
prefix, since the pull's own digest check (`kvplane.connector.digests`) is what proves a prefix.

Pure: no I/O.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from typing import Any, Final, Literal

import cbor2

HashAlgo = Literal["sha256", "sha256_cbor"]
HASH_ALGOS: Final[tuple[HashAlgo, ...]] = ("sha256", "sha256_cbor")
# vLLM's seed of the first block's parent for cryptographic hash algorithms.
DEFAULT_SEED: Final = "vllm-none-hash"
_LOW_64: Final = (1 << 64) - 1


class UnknownHashAlgo(ValueError):
    """A hash algorithm kvplane cannot predict (vLLM's xxhash ones use a per-process seed)."""


def _sha256_pickle(value: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(value: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(value, canonical=True)).digest()


_HASH_FNS: Final[dict[str, Callable[[Any], bytes]]] = {
    "sha256": _sha256_pickle,
    "sha256_cbor": _sha256_cbor,
}


def external_id(block_hash: bytes | int) -> int:
    """The 64-bit id a KV event carries for a block hash (events may also carry raw bytes)."""
    if isinstance(block_hash, int):
        return block_hash & _LOW_64
    return int.from_bytes(block_hash, "big") & _LOW_64


class BlockHasher:
    """Predicts the block hashes an engine configured with `algo` and `block_size` computes."""

    __slots__ = ("_fn", "algo", "block_size", "none_hash")

    def __init__(self, block_size: int, algo: str = "sha256", seed: str = DEFAULT_SEED) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, not {block_size}")
        fn = _HASH_FNS.get(algo)
        if fn is None:
            raise UnknownHashAlgo(
                f"cannot predict block hashes of algorithm {algo!r}: kvplane predicts "
                f"{', '.join(HASH_ALGOS)} (xxhash seeds differ per engine process)"
            )
        self.algo = algo
        self.block_size = block_size
        self._fn = fn
        self.none_hash = fn(seed)

    def full_hashes(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        """The whole hash of every full block of `token_ids` (the tokens after the last are not
        cached by vLLM and have none)."""
        size = self.block_size
        out: list[bytes] = []
        parent = self.none_hash
        salt_keys = (("cache_salt", cache_salt),) if cache_salt else None
        for start in range(0, len(token_ids) - len(token_ids) % size, size):
            extra = salt_keys if start == 0 else None
            parent = self._fn((parent, tuple(token_ids[start : start + size]), extra))
            out.append(parent)
        return out

    def ids(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[int]:
        """The 64-bit ids of every full block, as KV events carry them."""
        return [external_id(h) for h in self.full_hashes(token_ids, cache_salt)]

    def chain_from(self, parent: bytes, block_tokens: Sequence[int], extra: Any = None) -> bytes:
        """One block's hash given its parent's whole hash (to check an event's own blocks)."""
        return self._fn((parent, tuple(block_tokens), extra))
