"""Whether D keeps a turn's KV for the next turn: only where a pull of it could pay."""

from __future__ import annotations

from kvplane.services.routing.policy import CostModel, PullSettings
from kvplane.services.routing.policy.retention import decode_retention_pays

KVB = 4096
COSTS, PULL = CostModel(), PullSettings()


def test_d_keeps_its_kv_when_the_prefill_node_may_not_keep_the_prompt() -> None:
    assert decode_retention_pays(False, 16, KVB, COSTS, PULL)


def test_d_keeps_its_kv_when_the_output_has_no_bound() -> None:
    assert decode_retention_pays(True, None, KVB, COSTS, PULL)


def test_d_keeps_its_kv_when_the_output_alone_could_be_worth_a_pull() -> None:
    assert decode_retention_pays(True, 16_000, KVB, COSTS, PULL)


def test_d_frees_its_kv_when_p_keeps_the_prompt_and_a_short_output_is_cheaper_recomputed() -> None:
    assert not decode_retention_pays(True, 128, KVB, COSTS, PULL)
    assert not decode_retention_pays(True, 0, KVB, COSTS, PULL)
