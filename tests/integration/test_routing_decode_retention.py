"""Routing tells D to keep a turn's KV for the next turn only where a pull of it could pay: once P's
reports show it keeping the conversation's prompts, a turn with a short, bounded output is answered
with skip_decode_retention."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from importlib import resources
from pathlib import Path

import pytest

from kvplane.services.client import RoutingClient
from kvplane.services.dev.local_etcd import LocalEtcd
from tests.support.polling import eventually
from tests.support.routing_cluster import (
    HISTORY_TOKENS,
    MODEL,
    RoutingCluster,
    decode_params,
    prefill_and_decode,
    tokens,
)

ANSWER = 40  # tokens each turn generates here


@pytest.fixture
async def cluster(etcd: LocalEtcd, prefix: str) -> AsyncIterator[RoutingCluster]:
    async with prefill_and_decode(etcd, prefix) as c:
        yield c


@pytest.fixture
async def client(cluster: RoutingCluster) -> AsyncIterator[RoutingClient]:
    async with cluster.client("acme") as c:
        yield c


async def chat(
    cluster: RoutingCluster,
    client: RoutingClient,
    turns: int,
    *,
    max_output: int | None,
    cached: bool = True,
    on_decode_ok: bool = False,
) -> list[bool]:
    """`turns` turns of one conversation; what routing answered each in skip_decode_retention."""
    c = f"c-{uuid.uuid4().hex[:8]}"
    return await chat_in(
        cluster, client, c, turns, max_output=max_output, cached=cached, on_decode_ok=on_decode_ok
    )


async def chat_in(
    cluster: RoutingCluster,
    client: RoutingClient,
    c: str,
    turns: int,
    *,
    max_output: int | None,
    cached: bool = True,
    on_decode_ok: bool = False,
    published: list[str] | None = None,
) -> list[bool]:
    """`turns` turns of conversation `c`; the ids of the handles D published go to `published`."""
    history = tokens(HISTORY_TOKENS)
    prompt = history[:1000]
    skipped = []
    previous = 0
    for _ in range(turns):
        route = await client.route(
            c, MODEL, prompt_token_ids=prompt, max_output_tokens=max_output, prefill_on_decode_ok=on_decode_ok
        )
        skipped.append(route.skip_decode_retention)
        retained = history[: len(prompt) + ANSWER]
        # P found the previous prompt in its own cache (whole blocks), when it keeps prompts.
        hit = previous // 16 * 16 if cached else 0
        if route.skip_decode_retention:
            # D kept nothing and announced nothing: the report carries no handle.
            await cluster.report("acme", c, {}, route=route, cached_tokens=hit, pulled_tokens=0)
        else:
            params = decode_params(cluster.nodes["d0"], retained)
            handle_id = await cluster.report(
                "acme", c, params, route=route, cached_tokens=hit, pulled_tokens=0
            )
            if published is not None:
                published.append(handle_id)
        previous = len(prompt)
        prompt = [*retained, *history[len(retained) : len(retained) + 200]]
    return skipped


async def test_once_p_shows_it_keeps_prompts_a_short_output_is_not_kept_on_d(
    cluster: RoutingCluster, client: RoutingClient
) -> None:
    # Turns 1 and 2: nothing shown yet. Turn 2's report shows P keeping turn 1's prompt.
    assert await chat(cluster, client, 4, max_output=ANSWER) == [False, False, True, True]
    registry = cluster.replicas[0].telemetry.registry
    assert registry.get_sample_value("kvplane_route_decode_retention_total", {"outcome": "skipped"}) == 2


async def test_the_handle_d_kept_before_is_released_once_p_holds_more_than_it(
    cluster: RoutingCluster, client: RoutingClient
) -> None:
    c = f"c-{uuid.uuid4().hex[:8]}"
    # Turn 2's handle is the last D keeps; turn 3 is told to keep nothing, and P holds turn 2's
    # whole prompt: nothing will supersede that handle, so routing frees D's blocks.
    published: list[str] = []
    assert await chat_in(cluster, client, c, 3, max_output=ANSWER, published=published) == [
        False,
        False,
        True,
    ]
    stale = published[-1]

    async def released() -> bool:
        # (Turn 2 pulled turn 1's handle: what P held was a guess until turn 2's report showed
        # it. That handle stays checked out here, as no D reports P's read.)
        record = await cluster.store.get_handle("acme", c)
        return record is None or record.handle.handle_id != stale

    await eventually(released, what="the stale handle released")


async def test_an_unbounded_or_long_output_is_kept(cluster: RoutingCluster, client: RoutingClient) -> None:
    assert not any(await chat(cluster, client, 4, max_output=None))
    assert not any(await chat(cluster, client, 4, max_output=32_000))


async def test_a_prefill_node_that_keeps_nothing_gets_every_turns_kv_kept_on_d(
    cluster: RoutingCluster, client: RoutingClient
) -> None:
    assert not any(await chat(cluster, client, 4, max_output=ANSWER, cached=False))


async def test_a_caller_that_lets_d_prefill_turns_is_answered_as_any_other_once_p_keeps_prompts(
    cluster: RoutingCluster, client: RoutingClient
) -> None:
    # P keeps the prompts: the next turn's P lacks only the 40-token answer, fewer tokens than
    # the 200 the turn adds, so it goes through P (policy `min_history_per_new_token`), and D's KV
    # is kept only where a pull of it could pay.
    assert await chat(cluster, client, 4, max_output=ANSWER, on_decode_ok=True) == [False, False, True, True]


async def test_a_caller_that_lets_d_prefill_turns_gets_every_turns_kv_kept_where_p_keeps_nothing(
    cluster: RoutingCluster, client: RoutingClient
) -> None:
    # P lacks the whole history: the next turn may be prefilled on D.
    assert not any(await chat(cluster, client, 4, max_output=ANSWER, cached=False, on_decode_ok=True))


async def test_with_the_cost_model_alone_a_caller_that_lets_d_prefill_gets_every_turns_kv_kept(
    etcd: LocalEtcd, prefix: str, tmp_path: Path
) -> None:
    # With no history weighed against the new tokens, the next turn may skip P whatever P keeps:
    # D keeps every turn.
    default = resources.files("kvplane.services.routing.policy").joinpath("default_policy.yaml").read_text()
    weighed = "  min_history_per_new_token: 1.0\n"
    assert weighed in default
    policy = tmp_path / "policy.yaml"
    policy.write_text(default.replace(weighed, "  min_history_per_new_token: 0\n"))
    async with prefill_and_decode(etcd, prefix, replicas=0) as cluster:
        await cluster.add_replica(policy_file=str(policy))
        await cluster.wait_nodes()
        async with cluster.client("acme") as client:
            assert not any(await chat(cluster, client, 4, max_output=ANSWER, on_decode_ok=True))
