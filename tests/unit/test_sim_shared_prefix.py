"""Prompts of different conversations that share leading blocks share them in P's prefix cache."""

from __future__ import annotations

from kvplane.bench.sim import BASELINES, ClusterSpec, SimConfig, simulator_for
from kvplane.bench.workloads.turns import Turn

ONE_P = SimConfig(cluster=ClusterSpec(prefill_nodes=1, decode_nodes=1))


def _first_turn(at: float, conversation: str, tokens: int, ids: tuple[int, ...]) -> Turn:
    return Turn(at, conversation, 0, tokens, 10, block_ids=ids, block_id_tokens=512)


def test_a_shared_system_prompt_is_a_prefix_cache_hit_in_another_conversation() -> None:
    turns = [_first_turn(0.0, "a", 2_000, (0, 1, 2)), _first_turn(5.0, "b", 3_000, (0, 7, 8, 9, 10))]
    for policy in ("no-reuse", "prefix-affinity", "kvplane"):
        summary = simulator_for(BASELINES[policy], ONE_P).run(turns).summary
        assert summary.cached_tokens == 512, policy


def test_a_shared_document_is_a_hit_as_far_as_the_ids_agree() -> None:
    turns = [
        _first_turn(0.0, "a", 4_000, (0, 1, 2, 3, 4, 5, 6)),
        _first_turn(5.0, "b", 3_000, (0, 1, 2, 3, 9)),
    ]
    summary = simulator_for(BASELINES["no-reuse"], ONE_P).run(turns).summary
    assert summary.cached_tokens == 4 * 512


def test_prompts_without_named_blocks_share_nothing_across_conversations() -> None:
    turns = [Turn(0.0, "a", 0, 2_000, 10), Turn(5.0, "b", 0, 2_000, 10)]
    assert simulator_for(BASELINES["no-reuse"], ONE_P).run(turns).summary.cached_tokens == 0
