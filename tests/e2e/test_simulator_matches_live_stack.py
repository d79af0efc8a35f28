"""The simulator is checked against the live system.

The same small workload runs through the live stack (gateway, services, P and D
sim-engines with real NIXL) and through the discrete-event simulator running
the same policy code; the decision mix and the share of prompt tokens pulled
must agree within a stated tolerance. P runs without a prefix cache on both
sides (the simulator does not model one), so every pull moves the history.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvplane.bench.live import Workload, drive
from kvplane.bench.sim import ClusterSpec, SimConfig
from kvplane.bench.sim.agreement import Profile, agree, profile
from kvplane.bench.workloads.turns import Turn
from kvplane.services.devstack import DEMO_API_KEY, Stack, start_stack

pytestmark = pytest.mark.e2e

# Absolute difference allowed on each decision's share of turns and on the pulled-token share.
TOLERANCE = 0.05

WORKLOAD = Workload(conversations=4, turns=4, first_tokens=4000, user_tokens=200, max_tokens=100, rate=4.0)


def simulated_turns(w: Workload) -> list[Turn]:
    """The live workload as turn records: each prompt continues the previous context exactly."""
    turns = []
    for c in range(w.conversations):
        prompt, previous_context = w.first_tokens, 0
        for k in range(w.turns):
            turns.append(
                Turn(
                    arrival_s=c * 0.25 + k * 3.0,
                    conversation=f"c{c}",
                    turn_index=k,
                    prompt_tokens=prompt,
                    output_tokens=w.max_tokens,
                    reused_prefix_tokens=previous_context,
                    previous_context_tokens=previous_context,
                    tenant="demo",
                )
            )
            previous_context = prompt + w.max_tokens
            prompt = previous_context + w.user_tokens
    return sorted(turns, key=lambda t: t.arrival_s)


@pytest.fixture(scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Stack]:
    running = await start_stack(
        tmp_path_factory.mktemp("agreement"), timeout_s=240, prefill_args=("--no-enable-prefix-caching",)
    )
    try:
        yield running
    finally:
        running.stop()


async def test_simulator_and_live_stack_agree_on_decisions_and_reuse(stack: Stack) -> None:
    live_run = await drive(stack.gateway_url, DEMO_API_KEY, WORKLOAD, prefill=stack.prefill_url)
    live = Profile(live_run.decision_shares(), live_run.reused_fraction())
    simulated = profile(
        simulated_turns(WORKLOAD), SimConfig(cluster=ClusterSpec(prefill_nodes=1, decode_nodes=1))
    )
    assert live.decision_shares, "no live turns"
    assert agree(simulated, live, TOLERANCE) == [], (simulated, live)
    # Not a vacuous agreement: most continuing turns pulled on both sides.
    assert live.decision_shares.get("pull", 0.0) >= 0.5
    assert live.pulled_fraction > 0.4


def test_stack_logs_exist(stack: Stack) -> None:
    assert all(Path(p.log_path).exists() for p in stack.processes)
