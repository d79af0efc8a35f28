"""Wrong-prefix accounting: a pull into a prompt that differs from the handle is never reuse."""

from __future__ import annotations

import pytest

from kvplane.bench.sim import BASELINES, ClusterSpec, SimConfig, SimSummary, simulator_for
from kvplane.bench.workloads.turns import Turn

CONFIG = SimConfig(cluster=ClusterSpec(prefill_nodes=1, decode_nodes=1))
# Turn 0: a 4,000-token prompt and a 200-token answer: D retains a 4,200-token context.
FIRST = Turn(0.0, "c", 0, 4000, 200)


def _second(prompt: int, reused: int) -> list[Turn]:
    return [FIRST, Turn(60.0, "c", 1, prompt, 100, reused_prefix_tokens=reused, previous_context_tokens=4200)]


def _run(name: str, turns: list[Turn]) -> SimSummary:
    return simulator_for(BASELINES[name], CONFIG).run(turns, name).summary


# (the next prompt, its tokens equal to the retained context, P's cache hit, tokens the proxy pulls)
CASES = {
    # The answer is cut (reasoning stripped) and a message added: equal up to the old prompt.
    "shortened prompt": (4100, 4000, 4000, 99),
    # A message in the middle of the history was edited: equal up to token 2,000.
    "edited message": (4600, 2000, 2000, 2200),
    # The join between the answer and the new message re-tokenized: one token differs.
    "re-tokenized join": (4400, 4199, 4000, 200),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_unchecked_proxy_counts_the_pull_as_a_wrong_prefix_turn(case: str) -> None:
    prompt, reused, cached, pulled = CASES[case]
    s = _run("vllm-proxy", _second(prompt, reused))
    assert s.decisions["pull_wrong_prefix"] == 1
    assert s.wrong_prefix_turns == 1 and s.wrong_prefix_tokens == pulled
    # Only P's own cache hit counts as reuse; nothing pulled does.
    assert s.pulled_tokens == 0 and s.reused_tokens == s.cached_tokens == cached


@pytest.mark.parametrize("case", list(CASES))
def test_the_checked_proxy_recomputes_instead(case: str) -> None:
    prompt, reused, cached, _ = CASES[case]
    s = _run("vllm-proxy-checked", _second(prompt, reused))
    assert s.decisions["recompute_prefix_mismatch"] == 1
    assert s.wrong_prefix_turns == 0 and s.wrong_prefix_tokens == 0
    assert s.reused_tokens == cached


def test_a_prompt_that_is_a_prefix_of_the_handle_is_correct_reuse() -> None:
    # A retry of the same conversation cut at token 3,000: every pulled position matches.
    s = _run("vllm-proxy", _second(3000, 3000))
    assert s.decisions["pull"] == 1 and s.wrong_prefix_turns == 0
    assert s.reused_tokens == 2999


@pytest.mark.parametrize("case", list(CASES))
def test_the_checked_proxy_frees_the_handle_that_did_not_match(case: str) -> None:
    prompt, reused, _, _ = CASES[case]
    s = _run("vllm-proxy-checked", _second(prompt, reused))
    # The first turn's handle went when P took the second turn; only the second's lived to D's TTL.
    assert s.releases.get("engine_ttl", 0) == 1
    assert s.consumed_handles == 0 and s.pulled_tokens == 0
