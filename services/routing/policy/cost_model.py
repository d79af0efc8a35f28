"""Estimates of pull and recompute times, learned online from reported turns.

Defaults are calibrated to the published figures in DESIGN.md (Qwen3-32B, one
P and one D node):

- recompute: TTFT 778 ms for a 24k-token prompt, so at most 778 / 24,000 =
  0.032 ms per token;
- transfer: 30-130 ms per pull. Qwen3-32B's KV in bf16 is 64 layers x 8 KV
  heads x 128 dims x 2 (K, V) x 2 bytes = 256 KiB per token; a fixed 10 ms
  plus 52 GB/s gives 31 ms at 4k tokens and 131 ms at 24k, which spans them;
- with pull, TTFT 460 ms at 24k tokens: 318 ms saved. The model's transfer
  estimate (131 ms) leaves more than that; the published TTFT also holds the
  new suffix's compute and the pull path's fixed costs, which the figures do
  not break down. `max_transfer_fraction` (0.5) in the pull rule is the
  margin for them, and reported turns correct both rates.

Learning is an exponentially weighted average of per-token and per-byte
samples, and of the handshake from first pulls between two engines; each
sample is clamped to a factor of the current estimate so that one odd
report (a cold engine, a stalled link) cannot swing decisions. The
model is a frozen value: `observe` returns the updated model, so the
simulator can replay reports through the same code deterministically.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

# Qwen3-32B bf16, the model the default figures were measured with.
DEFAULT_KV_BYTES_PER_TOKEN = 64 * 8 * 128 * 2 * 2


@dataclass(frozen=True, slots=True)
class TurnObservation:
    """What ReportTurn says about one finished turn (ms, tokens, bytes)."""

    prompt_tokens: int
    pulled_tokens: int = 0
    transfer_ms: float = 0.0
    prefill_ms: float = 0.0
    ttft_ms: float = 0.0
    kv_bytes_per_token: int = 0
    success: bool = True
    # The pull was the first between its prefill engine and the holder, so it
    # paid the handshake.
    first_contact: bool = False
    # Prompt tokens P found in its own prefix cache: neither pulled nor computed.
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class CostModel:
    """Pull and recompute time estimates, in milliseconds."""

    recompute_ms_per_token: float = 0.032
    transfer_bytes_per_ms: float = 52e6
    transfer_overhead_ms: float = 10.0
    # A first pull between two engines pays the NIXL handshake (metadata
    # exchange and memory registration lookup).
    handshake_ms: float = 20.0
    default_kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN
    # Weight of a new sample in the moving averages.
    alpha: float = 0.1
    # Samples further than this factor from the estimate are clamped to it.
    max_sample_factor: float = 4.0
    # Turns that computed fewer tokens than this say little about per-token cost.
    min_sample_tokens: int = 256
    recompute_samples: int = 0
    transfer_samples: int = 0
    handshake_samples: int = 0

    def __post_init__(self) -> None:
        if self.recompute_ms_per_token <= 0 or self.transfer_bytes_per_ms <= 0:
            raise ValueError("rates must be positive")
        if not 0 < self.alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        if self.max_sample_factor < 1:
            raise ValueError("max_sample_factor must be at least 1")

    def bytes_for(self, tokens: int, kv_bytes_per_token: int = 0) -> int:
        return tokens * (kv_bytes_per_token or self.default_kv_bytes_per_token)

    def transfer_ms(self, tokens: int, kv_bytes_per_token: int = 0, *, first_contact: bool = False) -> float:
        """Time for P to pull `tokens` tokens of KV from the holder."""
        if tokens <= 0:
            return 0.0
        ms = (
            self.transfer_overhead_ms
            + self.bytes_for(tokens, kv_bytes_per_token) / self.transfer_bytes_per_ms
        )
        return ms + (self.handshake_ms if first_contact else 0.0)

    def recompute_ms(self, tokens: int) -> float:
        """Time for P to compute `tokens` prompt tokens."""
        return max(0, tokens) * self.recompute_ms_per_token

    def queue_ms(self, queued_prefill_tokens: int) -> float:
        """Expected wait on a prefill node with this many prompt tokens queued."""
        return self.recompute_ms(queued_prefill_tokens)

    def observe(self, obs: TurnObservation) -> CostModel:
        """The model updated with one reported turn."""
        if not obs.success:
            return self
        model = self
        computed = obs.prompt_tokens - obs.pulled_tokens - obs.cached_tokens
        if computed >= self.min_sample_tokens:
            # prefill_ms is P's own compute time; without it, a recompute
            # turn's TTFT bounds it from above.
            spent = obs.prefill_ms or (obs.ttft_ms if obs.pulled_tokens == obs.cached_tokens == 0 else 0.0)
            if spent > 0:
                sample = self._clamp(spent / computed, self.recompute_ms_per_token)
                model = replace(
                    model,
                    recompute_ms_per_token=_ewma(model.recompute_ms_per_token, sample, self.alpha),
                    recompute_samples=model.recompute_samples + 1,
                )
        if obs.pulled_tokens > 0 and obs.transfer_ms > 0:
            moved = self.bytes_for(obs.pulled_tokens, obs.kv_bytes_per_token)
            if obs.first_contact:
                # A first pull teaches the handshake: what it took beyond a warm pull.
                warm_ms = self.transfer_ms(obs.pulled_tokens, obs.kv_bytes_per_token)
                handshake = min(
                    max(obs.transfer_ms - warm_ms, 0.0), max(self.handshake_ms, 1.0) * self.max_sample_factor
                )
                return replace(
                    model,
                    handshake_ms=_ewma(model.handshake_ms, handshake, self.alpha),
                    handshake_samples=model.handshake_samples + 1,
                )
            # The fixed overhead is configured, not learned: with one size of
            # pull the two cannot be told apart.
            wire_ms = max(obs.transfer_ms - self.transfer_overhead_ms, obs.transfer_ms * 0.1)
            sample = self._clamp(moved / wire_ms, self.transfer_bytes_per_ms)
            model = replace(
                model,
                transfer_bytes_per_ms=_ewma(model.transfer_bytes_per_ms, sample, self.alpha),
                transfer_samples=model.transfer_samples + 1,
            )
        return model

    def _clamp(self, sample: float, current: float) -> float:
        return min(max(sample, current / self.max_sample_factor), current * self.max_sample_factor)


def _ewma(current: float, sample: float, alpha: float) -> float:
    return current + alpha * (sample - current)
