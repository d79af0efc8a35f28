"""P's answer tells pulled tokens, its own prefix-cache hits and computed tokens apart."""

from __future__ import annotations

from typing import Any

from kvplane.services.common.model.handles import KEY_PULL_MS, KEY_PULLED_TOKENS, KEY_QUEUED_MS
from kvplane.services.gateway.progress import PromptSources, prompt_sources


def _answer(prompt: int, cached: int, pulled: Any = None) -> dict[str, Any]:
    answer: dict[str, Any] = {
        "usage": {"prompt_tokens": prompt, "prompt_tokens_details": {"cached_tokens": cached}},
        "kv_transfer_params": {"do_remote_prefill": True},
    }
    if pulled is not None:
        answer["kv_transfer_params"][KEY_PULLED_TOKENS] = pulled
    return answer


def test_reported_pull_splits_cached_tokens_into_pulled_and_prefill_cache() -> None:
    sources = prompt_sources(_answer(prompt=1000, cached=960, pulled=320))
    assert sources == PromptSources(prompt=1000, pulled=320, prefill_cache=640, computed=40)
    assert sources.counts() == {"pulled": 320, "prefill_cache": 640, "computed": 40}
    assert sum(sources.counts().values()) == 1000


def test_an_engine_that_does_not_report_its_pull_leaves_cached_tokens_unattributed() -> None:
    sources = prompt_sources(_answer(prompt=1000, cached=960))
    assert sources.pulled is None
    assert sources.counts() == {"prefill_cache": 0, "computed": 40, "unattributed": 960}
    assert sum(sources.counts().values()) == 1000


def test_a_reported_pull_larger_than_the_cached_tokens_is_clipped_to_them() -> None:
    assert prompt_sources(_answer(prompt=100, cached=50, pulled=80)).counts() == {
        "pulled": 50,
        "prefill_cache": 0,
        "computed": 50,
    }


def test_a_malformed_report_counts_as_no_report() -> None:
    assert prompt_sources(_answer(prompt=100, cached=50, pulled="50")).pulled is None
    assert prompt_sources(_answer(prompt=100, cached=50, pulled=True)).pulled is None


def test_an_answer_without_usage_counts_nothing() -> None:
    assert sum(prompt_sources({"choices": []}).counts().values()) == 0


def test_p_cache_hits_are_reported_to_routing_only_when_p_said_them() -> None:
    from kvplane.services.gateway.progress import TurnProgress

    said = TurnProgress("pull", sources=prompt_sources(_answer(prompt=1000, cached=0, pulled=0)))
    assert said.cached_tokens == 0  # P said: none of the prompt was in its cache
    silent = {"usage": {"prompt_tokens": 1000}, "kv_transfer_params": {KEY_PULLED_TOKENS: 0}}
    # vLLM without --enable-prompt-tokens-details says nothing: routing must not read it as a miss.
    assert TurnProgress("pull", sources=prompt_sources(silent)).cached_tokens is None
    unattributed = TurnProgress("pull", sources=prompt_sources(_answer(prompt=1000, cached=960)))
    assert unattributed.cached_tokens is None  # pulled and cached cannot be told apart


def _timed(pulled: int, took: Any) -> dict[str, Any]:
    answer = _answer(prompt=1000, cached=960, pulled=pulled)
    answer["kv_transfer_params"][KEY_PULL_MS] = took
    return answer


def test_how_long_p_says_its_pull_took_goes_to_routing_as_the_turns_transfer_time() -> None:
    from kvplane.services.gateway.progress import TurnProgress

    sources = prompt_sources(_timed(pulled=320, took=23.5))
    assert sources.pull_ms == 23.5
    assert TurnProgress("pull", sources=sources).pull_ms == 23.5
    # Said of no pull, or not said at all: nothing to learn from.
    assert prompt_sources(_timed(pulled=0, took=23.5)).pull_ms is None
    assert (
        TurnProgress("pull", sources=prompt_sources(_answer(prompt=1000, cached=960, pulled=320))).pull_ms
        == 0
    )


def test_a_malformed_pull_time_is_not_learned_from() -> None:
    for took in ("23", True, -1, float("nan"), float("inf"), 1e12, None):
        assert prompt_sources(_timed(pulled=320, took=took)).pull_ms is None, took


def test_how_long_p_says_the_prompt_waited_goes_to_routing_with_the_turn() -> None:
    """P's own measure of the prompt's wait for its compute, pull or none; malformed, none."""
    from kvplane.services.gateway.progress import TurnProgress

    for pulled in (320, 0, None):
        answer = _answer(prompt=1000, cached=960, pulled=pulled)
        answer["kv_transfer_params"][KEY_QUEUED_MS] = 412.5
        assert TurnProgress("pull", sources=prompt_sources(answer)).queued_ms == 412.5, pulled
    assert (
        TurnProgress("pull", sources=prompt_sources(_answer(prompt=1000, cached=0, pulled=0))).queued_ms
        is None
    )
    assert TurnProgress("pull").queued_ms is None
    for took in ("23", True, -1, float("nan"), float("inf"), 1e12, None):
        answer = _answer(prompt=1000, cached=960, pulled=320)
        answer["kv_transfer_params"][KEY_QUEUED_MS] = took
        assert prompt_sources(answer).queued_ms is None, took
