"""The simulator is checked against the live system.

A small workload runs through the live stack (gateway, services, 2 P and 2 D
sim-engines with real NIXL, P prefix caches on); the same turns, sent at the
same times, run through the discrete-event simulator running the same policy
code on the same fleet; the
decision mix, the share of prompt tokens pulled from D and the share found in
P's own prefix cache must agree within a stated tolerance.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from importlib import resources
from pathlib import Path

import aiohttp
import pytest

from kvplane.bench.live import TurnResult, Workload, drive
from kvplane.bench.sim import ClusterSpec, SimConfig, SimCosts
from kvplane.bench.sim.agreement import Profile, agree, profile
from kvplane.bench.workloads.turns import Turn
from kvplane.services.devstack.stack import DEMO_API_KEY, Stack, start_stack

pytestmark = pytest.mark.e2e

# Absolute difference allowed on each decision's share of turns and on each token share.
TOLERANCE = 0.05
PREFILL_NODES = DECODE_NODES = 2
# The dev stack's engines: 16,384 blocks of 16 tokens each, for running requests and cached prefixes.
ENGINE_KV_TOKENS = 16384 * 16

# 32 turns, so that one turn decided otherwise (3.1% of them) stays within the tolerance.
WORKLOAD = Workload(conversations=8, turns=4, first_tokens=4000, user_tokens=200, max_tokens=100, rate=2.0)


def simulated_turns(live: Sequence[TurnResult]) -> list[Turn]:
    """The live run's turns as turn records, sent when the live ones were: each prompt
    continues the previous context (prompt and answer) exactly."""
    turns = []
    previous: dict[str, TurnResult] = {}
    for t in sorted(live, key=lambda t: t.sent_s):
        before = previous.get(t.conversation)
        context = before.prompt_tokens + before.output_tokens if before is not None else 0
        turns.append(
            Turn(
                arrival_s=t.sent_s,
                conversation=t.conversation,
                turn_index=t.turn_index,
                prompt_tokens=t.prompt_tokens,
                output_tokens=t.output_tokens,
                reused_prefix_tokens=context,
                previous_context_tokens=context,
                tenant="demo",
            )
        )
        previous[t.conversation] = t
    return turns


# A turn whose P holds the history and recomputes only the tail is recorded as one of these,
# depending on whether the conversation's superseded handle was still visible when it was
# routed (D keeps no KV a pull would not pay for, and routing releases the handle it leaves
# behind off the turn's path): a race between live processes that discrete events do not
# reproduce. The shares of pulls and of tokens from each source are compared as they are.
TAIL_RECOMPUTES = ("recompute_no_handle", "recompute_below_threshold", "recompute_cost")


def tail_recomputes_as_one(p: Profile) -> Profile:
    shares = {k: v for k, v in p.decision_shares.items() if k not in TAIL_RECOMPUTES}
    shares["recompute (P holds the history, or nothing to pull)"] = sum(
        p.decision_shares.get(k, 0.0) for k in TAIL_RECOMPUTES
    )
    return Profile(shares, p.pulled_fraction, p.cached_fraction)


def simulated_fleet() -> SimConfig:
    kv = ENGINE_KV_TOKENS * SimCosts().kv_bytes_per_token
    cluster = ClusterSpec(
        prefill_nodes=PREFILL_NODES,
        decode_nodes=DECODE_NODES,
        decode_kv_capacity_bytes=kv,
        prefill_cache_bytes=kv,
        # What each P registers: the same pool its prefix cache lives in.
        prefill_kv_capacity_bytes=kv,
    )
    return SimConfig(cluster=cluster)


async def prompt_token_sources(urls: list[str]) -> dict[str, float]:
    """Prompt tokens by source (local_cache_hit, external_kv_transfer, local_compute) over the P engines."""
    out: dict[str, float] = {}
    async with aiohttp.ClientSession() as session:
        for url in urls:
            async with session.get(f"{url}/metrics") as resp:
                text = await resp.text()
            for line in text.splitlines():
                if line.startswith("vllm:prompt_tokens_by_source_total{"):
                    labels, _, value = line.rpartition(" ")
                    source = labels.split('source="', 1)[1].split('"', 1)[0]
                    out[source] = out.get(source, 0.0) + float(value)
    return out


# The packaged policy with its cost model held at the configured estimates (samples clamped to
# them): the check compares routing, caches and engines under the same costs on both sides. The
# live stack would otherwise learn this machine's timings, which under load are several times the
# engines' timing model, and decide on other costs than the simulator.
FIXED_COST_POLICY = (
    resources.files("kvplane.services.routing.policy")
    .joinpath("default_policy.yaml")
    .read_text(encoding="utf-8")
    .replace("handshake_ms: 20.0", "handshake_ms: 20.0\n  max_sample_factor: 1.0")
)


@pytest.fixture(scope="module")
def policy_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("agreement-policy") / "fixed_cost_policy.yaml"
    path.write_text(FIXED_COST_POLICY)
    return path


@pytest.fixture(scope="module")
async def stack(tmp_path_factory: pytest.TempPathFactory, policy_file: Path) -> AsyncIterator[Stack]:
    # `serve all` reads its settings from the environment it inherits.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("KVPLANE_ROUTING__POLICY_FILE", str(policy_file))
        running = await start_stack(
            tmp_path_factory.mktemp("agreement"),
            timeout_s=240,
            prefill_nodes=PREFILL_NODES,
            decode_nodes=DECODE_NODES,
        )
        try:
            yield running
        finally:
            running.stop()


async def test_simulator_and_live_stack_agree_on_decisions_and_reuse(stack: Stack, policy_file: Path) -> None:
    assert len(stack.prefill_urls) == PREFILL_NODES and len(stack.decode_urls) == DECODE_NODES
    before = await prompt_token_sources(stack.prefill_urls)
    live_run = await drive(stack.gateway_url, DEMO_API_KEY, WORKLOAD)
    after = await prompt_token_sources(stack.prefill_urls)
    seen = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    total = sum(seen.values())
    assert total > 0, "the prefill engines saw no prompt tokens"
    live = Profile(
        live_run.decision_shares(),
        seen.get("external_kv_transfer", 0.0) / total,
        seen.get("local_cache_hit", 0.0) / total,
    )
    # The stack's engines publish KV events and routing reads them: the simulated policy does too.
    simulated = profile(
        simulated_turns(live_run.gateway_turns()),
        simulated_fleet(),
        policy="kvplane-events",
        routing_policy=str(policy_file),
    )
    assert live.decision_shares, "no live turns"
    simulated, live = tail_recomputes_as_one(simulated), tail_recomputes_as_one(live)
    assert agree(simulated, live, TOLERANCE) == [], (simulated, live)
    # Not a vacuous agreement: most of the continuing turns' history was reused, one way or the other.
    assert live.cached_fraction is not None
    assert live.pulled_fraction + live.cached_fraction > 0.4


def test_stack_logs_exist(stack: Stack) -> None:
    assert all(Path(p.log_path).exists() for p in stack.processes)
