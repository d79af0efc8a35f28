"""Each baseline's routing rule, on one conversation whose next prompt is given exactly."""

from __future__ import annotations

from kvplane.bench.sim import ClusterSpec, SimConfig
from kvplane.bench.sim.block_chain import BlockChain, BlockIds
from kvplane.bench.sim.cluster import PrefillState, SimHandle
from kvplane.bench.sim.fleet import Conversation, Fleet
from kvplane.bench.sim.routers import ExampleProxyRouter, OracleRouter, PrefixAffinityRouter
from kvplane.bench.workloads.turns import Turn

BLOCK = 16
CONFIG = SimConfig(cluster=ClusterSpec(prefill_nodes=3, decode_nodes=2, prefill_cache_bytes=8 << 30))


def _fleet() -> Fleet:
    c = CONFIG
    return Fleet(c.cluster, c.costs, c.epoch_unix_ms, c.load_report_interval_s, block_tokens=BLOCK)


def _handle(fleet: Fleet, conversation: Conversation, tokens: int) -> SimHandle:
    chain = BlockChain().extended(tokens // BLOCK, BlockIds())
    handle = SimHandle(1, "t", "c", fleet.decode[1], tokens, tokens * 1024, chain, 0.0, 480.0)
    conversation.chain = chain
    conversation.handle = handle
    return handle


def _turn(prompt: int, reused: int, previous: int = 4000) -> Turn:
    return Turn(10.0, "c", 1, prompt, 100, reused_prefix_tokens=reused, previous_context_tokens=previous)


def _proxy_choice(checked: bool, turn: Turn) -> tuple[str, int, bool]:
    fleet = _fleet()
    conversation = Conversation()
    router = ExampleProxyRouter(fleet, checked=checked)
    router.on_publish(conversation, _handle(fleet, conversation, 4000), 0.0)
    choice = router.route(turn, conversation, BlockChain(), 10.0)
    return choice.decision, choice.pulled_tokens, choice.prefix_ok


def test_the_proxy_pulls_a_prompt_that_extends_the_handle() -> None:
    assert _proxy_choice(False, _turn(4200, 4000)) == ("pull", 4000, True)
    assert _proxy_choice(True, _turn(4200, 4000)) == ("pull", 4000, True)


def test_the_unchecked_proxy_pulls_an_edited_history_as_a_wrong_prefix() -> None:
    assert _proxy_choice(False, _turn(4200, 2500)) == ("pull_wrong_prefix", 4000, False)


def test_the_checked_proxy_recomputes_an_edited_history() -> None:
    assert _proxy_choice(True, _turn(4200, 2500)) == ("recompute_prefix_mismatch", 0, True)


def test_the_proxy_forgets_its_entry_after_its_lifetime() -> None:
    fleet = _fleet()
    conversation = Conversation()
    router = ExampleProxyRouter(fleet, cache_ttl_s=450.0)
    router.on_publish(conversation, _handle(fleet, conversation, 4000), 0.0)
    assert (
        router.route(_turn(4200, 4000), conversation, BlockChain(), 451.0).decision == "recompute_no_handle"
    )


def test_prefix_affinity_sends_a_turn_to_the_prefill_node_that_holds_its_prefix() -> None:
    fleet = _fleet()
    ids = BlockIds()
    history = BlockChain().extended(4000 // BLOCK, ids)
    fleet.prefill[2].cache.insert(history)
    prompt = history.extended(200 // BLOCK, ids)
    choice = PrefixAffinityRouter(fleet).route(
        _turn(prompt_tokens(prompt), 4000), Conversation(), prompt, 0.0
    )
    assert choice.prefill is fleet.prefill[2] and choice.decision == "prefill_cache_hit"
    assert choice.pull is None


def _queue_on(fleet: Fleet, index: int, tokens: int, now: float) -> None:
    """Puts a turn of `tokens` prompt tokens in prefill node `index`'s queue at `now` (its real queue)."""
    p = fleet.prefill[index]
    p.changing(now)
    p.jobs += 1
    p.queued_tokens += tokens


def _affinity_turn(fleet: Fleet, router: PrefixAffinityRouter, ids: BlockIds, now: float) -> PrefillState:
    history = BlockChain().extended(4000 // BLOCK, ids)
    fleet.prefill[2].cache.insert(history)
    prompt = history.extended(200 // BLOCK, ids)
    return router.route(_turn(prompt_tokens(prompt), 4000), Conversation(), prompt, now).prefill


def test_prefix_affinity_leaves_a_holder_whose_reported_queue_costs_more_than_the_prefill() -> None:
    fleet = _fleet()
    _queue_on(fleet, 2, 2_000_000, 0.0)  # a minute of queued work, in P's load report of t=0.5
    choice = _affinity_turn(fleet, PrefixAffinityRouter(fleet), BlockIds(), 0.6)
    assert choice is not fleet.prefill[2]


def test_prefix_affinity_does_not_see_a_queue_its_load_reports_do_not_show_yet() -> None:
    fleet = _fleet()
    router = PrefixAffinityRouter(fleet)
    # The report of t=0.0 is read first: the queue that builds at t=0.1 is in no report until t=0.5.
    fleet.node_state(2, 0.0)
    _queue_on(fleet, 2, 2_000_000, 0.1)
    assert _affinity_turn(fleet, router, BlockIds(), 0.1) is fleet.prefill[2]
    assert _affinity_turn(fleet, router, BlockIds(), 0.6) is not fleet.prefill[2]


def test_prefix_affinity_counts_the_work_it_routed_since_the_last_report() -> None:
    fleet = _fleet()
    router = PrefixAffinityRouter(fleet)
    ids = BlockIds()
    history = BlockChain().extended(40_000 // BLOCK, ids)
    for p in fleet.prefill:
        p.cache.insert(history)
    picked = []
    for _ in range(3):
        prompt = history.extended(8000 // BLOCK, ids)
        turn = _turn(prompt_tokens(prompt), 40_000)
        picked.append(router.route(turn, Conversation(), prompt, 0.1).prefill.index)
    # Equal holders, no report shows any of the burst: each turn goes where the last ones are not.
    assert sorted(picked) == [0, 1, 2]


def test_the_oracle_pulls_the_verified_whole_blocks_of_an_edited_history() -> None:
    fleet = _fleet()
    conversation = Conversation()
    handle = _handle(fleet, conversation, 4000)
    choice = OracleRouter(fleet, BLOCK).route(_turn(4200, 2500), conversation, BlockChain(), 0.0)
    assert choice.decision == "pull" and choice.pull is handle
    assert choice.pulled_tokens == 2496 and choice.decode is handle.decode


def prompt_tokens(chain: BlockChain) -> int:
    return len(chain) * BLOCK
