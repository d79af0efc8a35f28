"""The simulator's costs hit the published Qwen3-32B figures they are fitted to."""

from __future__ import annotations

import pytest

from kvplane.bench.sim import SimCosts
from kvplane.bench.sim.costs import CALIBRATION_SUFFIX_TOKENS


def test_recompute_follows_the_published_ttft_curve() -> None:
    costs = SimCosts()
    assert costs.prefill_s(2_000) == pytest.approx(0.158, abs=1e-6)
    assert costs.prefill_s(24_000) == pytest.approx(0.778, abs=1e-6)


def test_transfers_span_the_published_30_to_130_ms() -> None:
    costs = SimCosts()
    assert 0.025 < costs.transfer_s(4_000, first_contact=False) < 0.035
    assert 0.125 < costs.transfer_s(24_000, first_contact=False) < 0.135
    assert costs.transfer_s(4_000, first_contact=True) == pytest.approx(
        costs.transfer_s(4_000, first_contact=False) + costs.handshake_s
    )


def test_a_pulled_24k_history_gives_the_published_460_ms() -> None:
    costs = SimCosts()
    pulled = 24_000 - CALIBRATION_SUFFIX_TOKENS
    ttft = (
        costs.transfer_s(pulled, first_contact=False)
        + costs.prefill_s(CALIBRATION_SUFFIX_TOKENS)
        + costs.pulled_compute_s(pulled)
    )
    assert ttft == pytest.approx(0.460, abs=1e-6)


def test_qwen3_32b_kv_is_256_kib_per_token() -> None:
    assert SimCosts().kv_bytes(1) == 64 * 8 * 128 * 2 * 2
