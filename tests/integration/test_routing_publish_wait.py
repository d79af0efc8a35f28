"""Nothing on the turn path waits that need not: the next turn names the handle the last turn's
engine announced, and routing waits for its publish only when the turn needs it; ReportTurn never
waits and never writes a handle the engine announced (the engine is its one writer).

The replicas here wait up to 60 s for a publish, far past every deadline the tests poll with, so a
wait that should not happen fails a test instead of slowing it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest

from kvplane.services.client import RouteResult, RoutingClient
from kvplane.services.common.model.handles import KEY_HANDLE_ID
from kvplane.services.dev.local_etcd import LocalEtcd
from kvplane.services.routing.policy import PullSettings
from tests.support.polling import eventually
from tests.support.routing_cluster import (
    HISTORY_TOKENS,
    MODEL,
    RoutingCluster,
    decode_params,
    prefill_and_decode,
    tokens,
)

LONG_WAIT_S = 60.0
# Far below LONG_WAIT_S: a call that returns within it did not wait for a publish.
PROMPT_ANSWER_S = 20.0


@pytest.fixture
async def cluster(etcd: LocalEtcd, prefix: str) -> AsyncIterator[RoutingCluster]:
    async with prefill_and_decode(etcd, prefix, routing={"publish_wait_s": LONG_WAIT_S}) as c:
        yield c


@pytest.fixture
async def client(cluster: RoutingCluster) -> AsyncIterator[RoutingClient]:
    async with cluster.client("acme", timeout_s=2 * LONG_WAIT_S) as c:
        yield c


def conv() -> str:
    return f"c-{uuid.uuid4().hex[:8]}"


def waiting(cluster: RoutingCluster) -> float:
    value = cluster.replicas[0].telemetry.registry.get_sample_value("kvplane_route_publish_waiting")
    return value or 0.0


async def test_a_route_awaiting_an_unpublished_handle_waits_for_it_and_pulls(
    cluster: RoutingCluster, client: RoutingClient
) -> None:
    c = conv()
    history = tokens(HISTORY_TOKENS)
    # The first turn's prompt was short and its answer long: P's prefix cache holds little of the
    # history, so the next turn needs D's handle.
    await client.route(c, MODEL, prompt_token_ids=history[:500])
    result = await route_that_waits_for_the_publish(cluster, client, c, history)
    assert result.decision == "pull"


async def route_that_waits_for_the_publish(
    cluster: RoutingCluster, client: RoutingClient, c: str, history: list[int]
) -> RouteResult:
    """The conversation's next Route, naming the handle D announced for `history`: it must be
    seen waiting before the engine's publish lands, and answer once it has."""
    params = decode_params(cluster.nodes["d0"], history)
    route = asyncio.create_task(
        client.route(
            c,
            MODEL,
            prompt_token_ids=[*history, 7, 8],
            awaited_handle_id=params[KEY_HANDLE_ID],
            awaited_handle_tokens=len(history),
        )
    )
    await eventually(lambda: _true(waiting(cluster) == 1), what="the Route waiting for the publish")
    await cluster.publish(cluster.handle_from_params("acme", c, params))
    result = await asyncio.wait_for(route, PROMPT_ANSWER_S)
    assert waiting(cluster) == 0
    return result


async def prove_keeping(cluster: RoutingCluster, client: RoutingClient) -> None:
    """p0's report of a later turn shows its prefix cache kept the earlier prompt: from then on
    routing knows, not guesses, what p0 holds of a prompt it was sent."""
    c = conv()
    first = tokens(1000, seed=9)
    await client.route(c, MODEL, prompt_token_ids=first)
    route = await client.route(c, MODEL, prompt_token_ids=[*first, *tokens(100, seed=10)])
    assert route.prefill.node_id == "p0"
    await cluster.report("acme", c, decode_params(cluster.nodes["d0"], first), route=route, cached_tokens=992)


async def test_a_route_whose_prefill_node_holds_the_history_does_not_wait(
    cluster: RoutingCluster, client: RoutingClient
) -> None:
    await prove_keeping(cluster, client)
    c = conv()
    history = tokens(HISTORY_TOKENS)
    # P was sent the whole history last turn: its prefix cache holds it, a pull adds nothing.
    await client.route(c, MODEL, prompt_token_ids=history)
    result = await asyncio.wait_for(
        client.route(
            c,
            MODEL,
            prompt_token_ids=[*history, 7, 8],
            awaited_handle_id=uuid.uuid4().hex,  # never published
            awaited_handle_tokens=len(history) + 1,
        ),
        PROMPT_ANSWER_S,
    )
    assert result.decision == "recompute_no_handle"
    assert result.prefill.node_id == "p0"
    registry = cluster.replicas[0].telemetry.registry
    assert not registry.get_sample_value("kvplane_route_publish_wait_seconds_count", {"outcome": "timeout"})


async def test_a_route_whose_prefill_node_lacks_only_what_is_cheaper_to_recompute_does_not_wait(
    cluster: RoutingCluster, client: RoutingClient
) -> None:
    await prove_keeping(cluster, client)
    c = conv()
    history = tokens(HISTORY_TOKENS)
    # P holds the last prompt; the handle would add only the last answer, a few tokens past the
    # pull threshold, whose transfer costs more than computing them.
    answer = PullSettings().threshold_tokens + 16
    await client.route(c, MODEL, prompt_token_ids=history[:-answer])
    result = await asyncio.wait_for(
        client.route(
            c,
            MODEL,
            prompt_token_ids=[*history, 7, 8],
            awaited_handle_id=uuid.uuid4().hex,  # never published
            awaited_handle_tokens=len(history),
        ),
        PROMPT_ANSWER_S,
    )
    assert result.decision == "recompute_no_handle"
    assert result.prefill.node_id == "p0"


async def test_a_guess_that_the_prefill_node_holds_the_history_does_not_spare_the_wait(
    cluster: RoutingCluster, client: RoutingClient
) -> None:
    # No report has shown p0's cache keeping anything (a fresh fleet, or P without prefix
    # caching): routing's record of what it sent p0 is a guess, and the announced handle is
    # waited for rather than the history recomputed on the guess's word.
    c = conv()
    history = tokens(HISTORY_TOKENS)
    await client.route(c, MODEL, prompt_token_ids=history)
    result = await route_that_waits_for_the_publish(cluster, client, c, history)
    assert result.decision != "recompute_no_handle", result.reason


async def test_report_turn_returns_at_once_and_never_writes_a_handle_the_engine_announced(
    cluster: RoutingCluster,
) -> None:
    c = conv()
    params = decode_params(cluster.nodes["d0"], tokens(HISTORY_TOKENS))
    # The engine has not published yet: the report neither waits for it nor writes it itself.
    handle_id = await asyncio.wait_for(
        cluster.report("acme", c, params, engine_publishes=False), PROMPT_ANSWER_S
    )
    assert handle_id == ""
    assert await cluster.store.get_handle("acme", c) is None


async def test_end_conversation_releases_a_handle_whose_publish_lands_while_it_waits(
    cluster: RoutingCluster, client: RoutingClient
) -> None:
    c = conv()
    params = decode_params(cluster.nodes["d0"], tokens(HISTORY_TOKENS))
    ended = asyncio.create_task(client.end_conversation(c, awaited_handle_id=params[KEY_HANDLE_ID]))
    await eventually(lambda: _true(waiting(cluster) == 1), what="EndConversation waiting for the publish")
    await cluster.publish(cluster.handle_from_params("acme", c, params))
    assert await asyncio.wait_for(ended, PROMPT_ANSWER_S) is True
    assert await cluster.store.get_handle("acme", c) is None


async def _true(value: bool) -> bool:
    return value


async def test_p_reporting_no_cache_hits_makes_the_next_turn_pull_what_it_lacks(
    cluster: RoutingCluster, client: RoutingClient
) -> None:
    """P runs without prefix caching: routing's record guesses it holds the history, and no guess
    declines a pull, so every later turn pulls D's handle instead of recomputing the whole
    history; P's reports never show the record right, so the guess never becomes knowledge."""
    c = conv()
    d0 = cluster.nodes["d0"]
    history = tokens(HISTORY_TOKENS + 200)
    prompt = history[:4000]
    decisions = []
    for _ in range(3):
        route = await client.route(c, MODEL, prompt_token_ids=prompt)
        decisions.append(route.decision)
        retained = history[: len(prompt) + 40]  # a short answer
        # P computed every token of the prompt (nothing from its own cache, nothing pulled).
        pulled = len(prompt) - 1 if route.decision == "pull" else 0
        await cluster.report(
            "acme", c, decode_params(d0, retained), route=route, cached_tokens=0, pulled_tokens=pulled
        )
        prompt = [*retained, *history[len(retained) : len(retained) + 20]]
    # Turn 2 does not trust the record (P would hold all but the answer: below the pull threshold)
    # before a report has shown it right; turn 3, after P's report of a miss, does not either.
    assert decisions == ["recompute_no_handle", "pull", "pull"]
