"""The prefill-side prefix check on kv_transfer_params alone (no vLLM needed)."""

from __future__ import annotations

from typing import Any

import pytest

from kvplane.connector import digests as token_digests
from kvplane.connector.digests import KEY_TAIL_DIGEST, tail_digest
from kvplane.connector.prefix_check import CHECKED_KEY, PullOutcome, check_pull

BLOCK = 16
HELD = [1, *range(5000, 5000 + 258)]  # 259 tokens: 16 whole blocks and 3 more


def handle_params(held: list[int] = HELD, groups: int = 1, digests: bool = True) -> dict[str, Any]:
    blocks = -(-len(held) // BLOCK)
    params: dict[str, Any] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": "d",
        "remote_request_id": "r",
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "remote_block_ids": [list(range(100 * g, 100 * g + blocks)) for g in range(groups)],
        "remote_num_tokens": len(held),
    }
    if digests:
        params["kvplane_digests"] = token_digests.encode(token_digests.digest_tokens(held, BLOCK))
        params[KEY_TAIL_DIGEST] = tail_digest(held, BLOCK)
    return params


def test_exact_continuation_keeps_the_whole_handle_including_the_partial_block() -> None:
    params = handle_params()
    check = check_pull(params, [*HELD, 7, 8, 9])
    assert check.outcome is PullOutcome.VERIFIED
    assert params["remote_num_tokens"] == 259 and len(params["remote_block_ids"][0]) == 17


def test_change_in_the_partial_block_clips_to_the_last_whole_block() -> None:
    params = handle_params()
    check = check_pull(params, [*HELD[:-1], 31000, 9, 9])
    assert (check.outcome, check.verified_tokens) == (PullOutcome.CLIPPED, 256)
    assert params["remote_num_tokens"] == 256 and len(params["remote_block_ids"][0]) == 16


def test_edit_in_an_early_block_clips_before_it() -> None:
    params = handle_params()
    prompt = list(HELD)
    prompt[40] = 4242  # block 2
    check = check_pull(params, [*prompt, 1, 2, 3])
    assert (check.outcome, check.verified_tokens) == (PullOutcome.CLIPPED, 32)
    assert params["remote_block_ids"] == [list(range(0, 2))]


def test_prompt_shorter_than_the_handle_keeps_at_least_its_last_token_for_p() -> None:
    # A retried turn: the prompt is D's prompt again, without D's output.
    params = handle_params()
    check = check_pull(params, HELD[:64])
    # All 64 prompt tokens are verified, but P computes token 63 itself.
    assert (check.outcome, check.verified_tokens) == (PullOutcome.CLIPPED, 63)
    assert len(params["remote_block_ids"][0]) == 4


def test_nothing_shared_drops_the_pull_but_keeps_the_blocks_named_for_the_notification() -> None:
    params = handle_params()
    check = check_pull(params, list(range(9000, 9300)))
    assert check.outcome is PullOutcome.DROPPED
    assert params["remote_num_tokens"] == 0 and len(params["remote_block_ids"][0]) == 17


@pytest.mark.parametrize("require", [True, False])
def test_handle_without_digests_follows_the_policy(require: bool) -> None:
    params = handle_params(digests=False)
    check = check_pull(params, [*HELD, 1], require_digests=require)
    if require:
        assert check.outcome is PullOutcome.NO_DIGESTS and params["remote_num_tokens"] == 0
    else:
        assert check.outcome is PullOutcome.VERIFIED and params["remote_num_tokens"] == 259


def test_undecodable_digests_drop_the_pull() -> None:
    params = handle_params()
    params["kvplane_digests"] = "not-base64-digests!"
    assert check_pull(params, [*HELD, 1]).outcome is PullOutcome.DROPPED


def test_several_kv_cache_groups_are_not_cut_at_one_index() -> None:
    params = handle_params(groups=2)
    prompt = list(HELD)
    prompt[40] = 4242
    assert check_pull(params, prompt).outcome is PullOutcome.DROPPED


def test_second_check_returns_the_first_outcome_without_editing_again() -> None:
    params = handle_params()
    prompt = list(HELD)
    prompt[40] = 4242
    first = check_pull(params, prompt)
    snapshot = {k: (list(map(list, v)) if k == "remote_block_ids" else v) for k, v in params.items()}
    # Even with another prompt, the recorded outcome stands: vLLM re-asks for the same request.
    second = check_pull(params, [*HELD, 1])
    assert first == second
    assert params == snapshot
    assert params[CHECKED_KEY] == ["clipped", 259, 32]


def test_params_that_are_not_a_pull_are_left_alone() -> None:
    params: dict[str, Any] = {"do_remote_decode": True, "remote_block_ids": None}
    assert check_pull(params, HELD).outcome is PullOutcome.NOT_A_PULL
    assert params == {"do_remote_decode": True, "remote_block_ids": None}
    assert check_pull(None, HELD).outcome is PullOutcome.NOT_A_PULL
