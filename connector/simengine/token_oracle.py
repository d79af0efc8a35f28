"""The simulated model: the next token is a pure function of the whole prefix.

Greedy output therefore depends only on the token sequence, never on which
engine computed it or where its KV came from, so a disaggregated turn must
produce exactly what a single engine produces.

The state after a prefix is the fold of its tokens past the last whole
block, started from ``base(chain hash of the whole blocks)``: the engine has
the block chain anyway, so a 24k-token prompt costs one short fold, not 24k
Python steps.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvplane.connector.simengine.block_content import mix64
from kvplane.connector.simengine.toy_tokenizer import BYTE_OFFSET, EOS_ID

# Generated text is lowercase words, so it re-tokenizes to the same ids.
_ALPHABET = [BYTE_OFFSET + c for c in b"abcdefghijklmnopqrstuvwxyz     "]
_MASK64 = (1 << 64) - 1


class TokenOracle:
    """Deterministic next-token function, seeded."""

    def __init__(self, seed: int, eos_probability: float = 0.0) -> None:
        if not 0.0 <= eos_probability <= 1.0:
            raise ValueError("eos_probability must be within [0, 1]")
        self._seed = mix64(seed ^ 0x5EED)
        self._eos_threshold = int(eos_probability * (1 << 32))

    def base(self, chain_hash: int) -> int:
        """State at a block boundary whose chain hash is ``chain_hash``."""
        return mix64(self._seed ^ chain_hash)

    def state_after(self, tokens: Sequence[int], state: int | None = None) -> int:
        s = self._seed if state is None else state
        for t in tokens:
            s = mix64(s ^ ((t + 1) * 0x9E3779B97F4A7C15 & _MASK64))
        return s

    def next_token(self, state: int) -> int:
        r = mix64(state + 0x632BE59BD9B4E019)
        if (r >> 32) < self._eos_threshold:
            return EOS_ID
        return _ALPHABET[r % len(_ALPHABET)]
