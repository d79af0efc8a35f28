"""What simulated work costs, calibrated to published Qwen3-32B figures (seconds, bytes).

- Prefill of n uncached tokens: the engine simulator's `TimingModel`, the line
  through the published TTFT points (158 ms at 2k tokens, 778 ms at 24k).
  That curve is end-to-end TTFT of a recomputed turn, P->D hand-off included.
- A pull: `transfer_overhead_s` + bytes / `link_bytes_per_s`, plus
  `handshake_s` the first time a prefill node reads from a given engine.
  10 ms + 52 GB/s spans the published 30-130 ms transfers (4k-24k tokens).
- The published pull TTFT, 460 ms at 24k tokens, is more than a transfer
  plus a short suffix's prefill: the suffix attends over the whole pulled
  context. That remainder is charged per pulled token (`pulled_token_s`, on
  P's compute), fitted so a 24k-token turn adding `CALIBRATION_SUFFIX_TOKENS`
  takes 460 ms.
- Decode: the timing model's step time, once per output token.
- KV: 256 KiB per token (64 layers x 8 KV heads x 128 dims x K,V x bf16).
- A spill of retained KV from D's accelerators to D's host memory (the tiered
  engine model): `host_copy_bytes_per_s`, 25 GB/s, about what a pinned
  device-to-host copy sustains over one PCIe Gen4 x16 link (CUDA's
  `bandwidthTest` on such hosts); Gen5 hosts double it. An assumption, not a
  measurement here: no GPU has run this project. A pull from D's host memory
  costs what a pull from its accelerators does: NIXL reads registered DRAM
  over the same NIC, which bounds both.
- D's read of the prompt's KV from P (the hand-off) is inside those curves:
  `handoff_s`, bytes / `link_bytes_per_s` per token (about 5 µs), is what a
  D that holds a prompt's leading blocks already does not wait for.
  `handoff_fixed_s` is 0 there; an engine whose prefill time is compute alone
  (the sim-engine) pays its hand-off on top, as measured.
- A turn D prefills itself runs in chunks in D's batch, each chunk a step
  with D's running decodes (`local_chunk_decode_step`); the sim-engine runs
  it as one compute of the prefill's time, and its first token comes from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvplane.connector.simengine.timing_model import TimingModel
from kvplane.services.routing.policy.cost_model import DEFAULT_KV_BYTES_PER_TOKEN

# Published: TTFT with a pull of a 24k-token history (Qwen3-32B, one P and one D).
QWEN3_32B_PULL_POINT: tuple[int, float] = (24_000, 0.460)
# The published figure does not give the new turn's length; one 512-token message is assumed.
CALIBRATION_SUFFIX_TOKENS = 512


def _transfer_s(tokens: int, kv_bytes_per_token: int, link: float, overhead: float) -> float:
    return overhead + tokens * kv_bytes_per_token / link


def fit_pulled_token_s(
    timing: TimingModel,
    kv_bytes_per_token: int,
    link_bytes_per_s: float,
    transfer_overhead_s: float,
    point: tuple[int, float] = QWEN3_32B_PULL_POINT,
    suffix_tokens: int = CALIBRATION_SUFFIX_TOKENS,
) -> float:
    """P's compute per pulled token that makes a pull of `point[0]` tokens take `point[1]` s."""
    total, ttft = point
    pulled = total - suffix_tokens
    rest = ttft - timing.prefill_s(suffix_tokens)
    rest -= _transfer_s(pulled, kv_bytes_per_token, link_bytes_per_s, transfer_overhead_s)
    return max(0.0, rest / pulled)


@dataclass(frozen=True, slots=True)
class SimCosts:
    timing: TimingModel = field(default_factory=TimingModel)
    kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN
    link_bytes_per_s: float = 52e9
    transfer_overhead_s: float = 0.010
    handshake_s: float = 0.020
    host_copy_bytes_per_s: float = 25e9
    # The fixed time a turn through P spends on D before D's first step, beyond the prefill
    # curve: D's NIXL read of the prompt's blocks from P, their check, the request's way into
    # D's loop. 0 where the curves are end-to-end TTFT (they hold it).
    handoff_fixed_s: float = 0.0
    # Whether each chunk of a prefill on D also takes one of D's decode steps (vLLM's mixed
    # batches); the sim-engine's local prefill is its compute alone.
    local_chunk_decode_step: bool = True
    # Negative: fitted to QWEN3_32B_PULL_POINT on construction.
    pulled_token_s: float = -1.0

    def __post_init__(self) -> None:
        if self.pulled_token_s < 0:
            fitted = fit_pulled_token_s(
                self.timing, self.kv_bytes_per_token, self.link_bytes_per_s, self.transfer_overhead_s
            )
            object.__setattr__(self, "pulled_token_s", fitted)

    def prefill_s(self, computed_tokens: int) -> float:
        return self.timing.prefill_s(computed_tokens)

    def transfer_s(self, tokens: int, first_contact: bool) -> float:
        if tokens <= 0:
            return 0.0
        s = _transfer_s(tokens, self.kv_bytes_per_token, self.link_bytes_per_s, self.transfer_overhead_s)
        return s + (self.handshake_s if first_contact else 0.0)

    def handoff_s(self, tokens: int) -> float:
        """The share of a turn's TTFT that D's read of `tokens` prompt tokens from P takes: part of
        the published curves (`prefill_s`, `pulled_token_s`), saved where D holds them already."""
        return max(0, tokens) * self.kv_bytes_per_token / self.link_bytes_per_s

    def spill_s(self, nbytes: int) -> float:
        """Seconds to copy `nbytes` of KV from D's accelerators to its host memory."""
        return nbytes / self.host_copy_bytes_per_s

    def pulled_compute_s(self, pulled_tokens: int) -> float:
        return self.pulled_token_s * pulled_tokens

    def decode_s(self, output_tokens: int, running: int) -> float:
        return output_tokens * self.timing.decode_s(running)

    def decode_step_s(self, running: int) -> float:
        """One step of D's batch of `running` decodes: where a turn through P gets its first token."""
        return self.timing.decode_s(running)

    def kv_bytes(self, tokens: int) -> int:
        return tokens * self.kv_bytes_per_token
