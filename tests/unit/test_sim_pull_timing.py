"""When a pull starts: as in vLLM, when P's scheduler takes the turn, not when the turn arrives.

One prefill node without a prefix cache, one decode node, vLLM's example
proxy: conversation "c" leaves a 48,000-token handle on D, and its next turn
pulls all of it (a read of about 0.27 s).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from kvplane.bench.sim import BASELINES, ClusterSpec, SimConfig, SimCosts, SimResult, Simulator, simulator_for
from kvplane.bench.workloads.turns import Turn

# vLLM's example proxy without its hop before P: the times here are P's scheduling alone.
PROXY = dataclasses.replace(BASELINES["vllm-proxy"], control_path_s=0.0)
CONFIG = SimConfig(cluster=ClusterSpec(prefill_nodes=1, decode_nodes=1, prefill_cache_bytes=0))
COSTS = SimCosts()
# D's first step, where a turn through P gets its first token, in a batch of one.
STEP = COSTS.decode_step_s(1)
HISTORY = Turn(0.0, "c", 0, 47_800, 200)
CONTEXT = 48_000


def _pulling(at: float) -> Turn:
    return Turn(at, "c", 1, CONTEXT + 400, 100, reused_prefix_tokens=CONTEXT, previous_context_tokens=CONTEXT)


def _ttft_by_prompt(result: SimResult) -> dict[int, float]:
    return dict(zip(result.prompt_tokens, result.ttft_s, strict=True))


def _pull_s() -> float:
    """The read of the whole handle (first contact) and the prefill after it."""
    return COSTS.transfer_s(CONTEXT, True) + COSTS.prefill_s(400) + COSTS.pulled_compute_s(CONTEXT)


def test_a_pull_behind_a_queued_prompt_starts_its_read_only_when_the_prefill_node_takes_it() -> None:
    ahead = Turn(60.0, "x", 0, 24_000, 10)
    pulling = _pulling(60.001)
    result = simulator_for(PROXY, CONFIG).run([HISTORY, ahead, pulling])
    assert result.summary.decisions["pull"] == 1 and result.summary.pulled_tokens == CONTEXT
    taken = ahead.arrival_s + COSTS.prefill_s(ahead.prompt_tokens)
    # The read did not overlap the prompt ahead of it: P took the turn when that prompt was done.
    assert _ttft_by_prompt(result)[pulling.prompt_tokens] == pytest.approx(
        taken + _pull_s() + STEP - pulling.arrival_s
    )


def test_the_prefill_node_serves_another_turn_while_a_read_is_in_flight() -> None:
    pulling = _pulling(60.0)
    short = Turn(60.001, "x", 0, 1_000, 10)
    assert COSTS.prefill_s(short.prompt_tokens) < COSTS.transfer_s(CONTEXT, True)
    result = simulator_for(PROXY, CONFIG).run([HISTORY, pulling, short])
    ttft = _ttft_by_prompt(result)
    # The short turn ran while P waited for the read: it waited for nothing.
    assert ttft[short.prompt_tokens] == pytest.approx(COSTS.prefill_s(short.prompt_tokens) + STEP)
    # The pulling turn computed as soon as its read landed (P was free by then).
    assert ttft[pulling.prompt_tokens] == pytest.approx(_pull_s() + STEP)


def test_a_landed_read_is_computed_before_turns_that_arrived_after_it_was_taken() -> None:
    pulling = _pulling(60.0)
    long_one = Turn(60.001, "x", 0, 20_000, 10)
    later = Turn(60.002, "y", 0, 1_000, 10)
    result = simulator_for(PROXY, CONFIG).run([HISTORY, pulling, long_one, later])
    ttft = _ttft_by_prompt(result)
    long_done = long_one.arrival_s + COSTS.prefill_s(long_one.prompt_tokens)
    pulled_done = long_done + COSTS.prefill_s(400) + COSTS.pulled_compute_s(CONTEXT)
    # The read landed while P computed the long prompt; then it went first, before `later`.
    assert ttft[pulling.prompt_tokens] == pytest.approx(pulled_done + STEP - pulling.arrival_s)
    assert ttft[later.prompt_tokens] == pytest.approx(
        # Its first step is in a batch of two: the pulled turn is still decoding.
        pulled_done + COSTS.prefill_s(later.prompt_tokens) + COSTS.decode_step_s(2) - later.arrival_s
    )


def test_the_decode_node_keeps_the_handle_pinned_until_the_read_is_done() -> None:
    sim: Simulator = simulator_for(PROXY, CONFIG)
    pulling = _pulling(60.0)
    mid_read = pulling.arrival_s + 0.5 * COSTS.transfer_s(CONTEXT, True)
    seen: list[tuple[int, int]] = []

    def turns() -> Iterator[Turn]:
        yield HISTORY
        yield pulling
        # Asked for after the turn at `mid_read` arrived: D and P as they are mid-read.
        yield Turn(mid_read, "probe", 0, 16, 1)
        seen.append((sim.fleet.decode[0].retained, sim.fleet.prefill[0].reading))
        yield Turn(pulling.arrival_s + 5.0, "probe-2", 0, 16, 1)
        seen.append((sim.fleet.decode[0].retained, sim.fleet.prefill[0].reading))

    sim.run(turns())
    handle_bytes = COSTS.kv_bytes(CONTEXT)
    assert seen[0] == (handle_bytes, 1)
    # Read done: the handle's blocks are free; D retains the two later turns' contexts only.
    later = COSTS.kv_bytes(pulling.context_tokens) + COSTS.kv_bytes(17)
    assert seen[1] == (later, 0)
