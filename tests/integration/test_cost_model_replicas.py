"""The cost model learns from every reported turn, whichever replica the client's calls rotate to."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest

from kvplane.services.client.routing_client import home_replica
from kvplane.services.dev.local_etcd import LocalEtcd
from kvplane.services.process import ServiceProcess
from tests.support.routing_cluster import MODEL, RoutingCluster, prefill_and_decode, tokens

GAUGE = "kvplane_cost_recompute_seconds_per_token"
FIXED = "kvplane_cost_prefill_fixed_seconds"


@pytest.fixture
async def cluster(etcd: LocalEtcd, prefix: str) -> AsyncIterator[RoutingCluster]:
    async with prefill_and_decode(etcd, prefix, replicas=2) as c:
        yield c


def _estimate(replica: ServiceProcess, gauge: str = GAUGE) -> float:
    value = replica.telemetry.registry.get_sample_value(gauge)
    assert value is not None
    return value


async def test_both_replicas_learn_from_reports_of_a_client_that_rotates_between_them(
    cluster: RoutingCluster,
) -> None:
    prior = [_estimate(r) for r in cluster.replicas]
    prompt = 2048
    # Prefill four times slower than the prior says: its fixed part and its part per token.
    observed_s = 4 * max(_estimate(r, FIXED) + _estimate(r) * prompt for r in cluster.replicas)
    # Four conversations homed at each replica: random ones all land on one replica now and then.
    run = uuid.uuid4().hex[:8]
    candidates = (f"c-{run}-{i}" for i in range(1000))
    homes = [(c, home_replica("acme", c, 2)) for c in candidates]
    conversations = [c for c, home in homes if home == 0][:4] + [c for c, home in homes if home == 1][:4]
    async with cluster.gateway() as gateway:
        for conversation in conversations:
            route = await gateway.route(conversation, MODEL, prompt_token_ids=tokens(prompt), tenant="acme")
            await gateway.report_turn(
                route,
                conversation,
                success=True,
                prompt_tokens=prompt,
                prefill_ms=observed_s * 1000,
                ttft_ms=observed_s * 1000,
                tenant="acme",
            )
    learned = [_estimate(r) for r in cluster.replicas]
    for before, after in zip(prior, learned, strict=True):
        assert after > before * 1.5, f"a replica stayed near its prior: {prior} -> {learned}"
