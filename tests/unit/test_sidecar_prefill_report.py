"""The sidecar's account of its P leg, read by the picker as the gateway's P leg records it."""

from __future__ import annotations

import pytest

from kvplane.services.common.model.handles import KEY_PULLED_TOKENS
from kvplane.services.gateway.progress import TurnProgress
from kvplane.services.sidecar.prefill_report import PrefillReport


def test_a_report_survives_the_header_and_fills_the_progress() -> None:
    answer = {
        "usage": {"prompt_tokens": 100, "prompt_tokens_details": {"cached_tokens": 64}},
        "kv_transfer_params": {KEY_PULLED_TOKENS: 48, "remote_block_ids": [1]},
    }
    report = PrefillReport.decode(PrefillReport.of_answer(answer, 0.25).encode())
    progress = TurnProgress("pull")
    report.apply(progress)
    assert progress.sources is not None
    assert (progress.sources.pulled, progress.sources.prefill_cache, progress.sources.computed) == (
        48,
        16,
        36,
    )
    assert progress.prefill_params == answer["kv_transfer_params"]
    assert progress.prefill_s == 0.25 and progress.decision == "pull"


def test_a_failed_p_leg_changes_the_decision_and_says_why() -> None:
    progress = TurnProgress("pull")
    PrefillReport(None, None, 0.1, "retry_no_handle", "prefill leg: HTTP 500").apply(progress)
    assert (progress.decision, progress.error, progress.sources) == (
        "retry_no_handle",
        "prefill leg: HTTP 500",
        None,
    )


@pytest.mark.parametrize("value", ["", "not base64!", "e30="])
def test_an_unreadable_report_is_a_value_error(value: str) -> None:
    with pytest.raises(ValueError):
        PrefillReport.decode(value)
