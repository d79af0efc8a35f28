"""The router's record of what each prefill node was sent: a digest-checked hint of its prefix cache."""

from __future__ import annotations

from kvplane.connector.digests import chain, digest_tokens
from kvplane.services.common.model.nodes import NodeRole
from kvplane.services.routing.policy.snapshot import Prompt
from kvplane.services.routing.state.prefill_record import PrefillCacheRecord, SentReceipt, prompt_digests
from kvplane.services.routing.state.prompt_chains import PromptChains
from tests.unit.routing_policy_fixtures import history, mk_node

P0 = mk_node("p0", NodeRole.PREFILL)
P1 = mk_node("p1", NodeRole.PREFILL)
H = history(4000)
KEY = ("t", "c")


def sent(record: PrefillCacheRecord, node: object, prompt: list[int], key: object = KEY) -> None:
    record.sent(key, node, len(prompt), chain(prompt, 16), 16)  # type: ignore[arg-type]


def held(record: PrefillCacheRecord, prompt: list[int], key: object = KEY) -> dict[str, int]:
    return dict(record.cached_tokens(key, len(prompt), chain(prompt, 16), 16))


def test_a_continued_prompt_finds_the_previous_prompt_on_its_node() -> None:
    record = PrefillCacheRecord()
    sent(record, P0, H)
    assert held(record, [*H, *history(300, seed=5)]) == {"p0": 4000}


def test_an_edited_prompt_counts_only_the_prefix_it_shares() -> None:
    record = PrefillCacheRecord()
    sent(record, P0, H)
    edited = [*H[:2000], 7, *H[2001:], *history(300, seed=5)]
    tokens = held(record, edited)["p0"]
    assert 0 < tokens <= 2000


def test_another_conversation_or_other_tokens_find_nothing() -> None:
    record = PrefillCacheRecord()
    sent(record, P0, H)
    assert held(record, H, key=("t", "other")) == {}
    assert held(record, history(4000, seed=8)) == {}


def test_the_conversation_remembers_its_last_nodes_newest_first() -> None:
    record = PrefillCacheRecord(nodes_per_conversation=2)
    p2 = mk_node("p2", NodeRole.PREFILL)
    sent(record, P0, H[:1000])
    sent(record, P1, H[:2000])
    sent(record, p2, H[:3000])
    assert held(record, H) == {"p1": 2000, "p2": 2992}  # whole blocks only


def test_a_node_forgets_its_oldest_prompts_beyond_its_kv_capacity() -> None:
    small = mk_node("p0", NodeRole.PREFILL, kv_capacity_bytes=2 * 4000 * 4096, kv_bytes_per_token=4096)
    record = PrefillCacheRecord()
    for i in range(3):
        sent(record, small, history(4000, seed=i), key=("t", f"c{i}"))
    assert held(record, history(4000, seed=0), key=("t", "c0")) == {}
    assert held(record, history(4000, seed=2), key=("t", "c2")) == {"p0": 4000}


def test_a_prompt_known_by_length_only_is_a_hint_by_length() -> None:
    record = PrefillCacheRecord()
    record.sent(KEY, P0, 4000)
    assert record.cached_tokens(KEY, 4500) == {"p0": 4000}
    assert record.cached_tokens(KEY, 3000) == {"p0": 3000}


def test_the_record_is_bounded_and_forgets_on_request() -> None:
    record = PrefillCacheRecord(max_conversations=2)
    for i in range(5):
        sent(record, P0, H[:64], key=("t", f"c{i}"))
    assert len(record) == 2
    record.forget(("t", "c4"))
    assert held(record, H, key=("t", "c4")) == {}


def test_a_sent_prompt_whose_chain_was_lost_is_unproven() -> None:
    from kvplane.services.routing.policy import Prompt
    from kvplane.services.routing.state.prompt_chains import PromptChains

    chains = PromptChains(max_tokens=5000)
    record = PrefillCacheRecord()
    lazy = chains.with_chain(KEY, Prompt(len(H), H), 16)
    record.sent(KEY, P0, len(H), lazy.block_digests, 16)
    chains.with_chain(("t", "other"), Prompt(4000, history(4000, seed=2)), 16)  # pushes it out
    assert held(record, [*H, *history(100, seed=5)]) == {}


def test_checkpoints_from_a_lazy_chain_equal_the_digests_of_the_tokens() -> None:
    tokens = history(4160)
    lazy = PromptChains().with_chain("c", Prompt(len(tokens), tokens, (), 0), 16).block_digests
    assert prompt_digests(lazy, 16) == prompt_digests(chain(tokens, 16), 16) == digest_tokens(tokens, 16)


# -- P's reports correct the record --------------------------------------------------------------


def sent_turn(record: PrefillCacheRecord, node: object, prompt: list[int], key: object = KEY) -> SentReceipt:
    """A route as the service makes it: the record is asked what P holds, then told what was sent."""
    held(record, prompt, key)
    return record.sent(key, node, len(prompt), chain(prompt, 16), 16)  # type: ignore[arg-type]


def test_a_miss_p_reports_shrinks_what_the_record_believes_it_holds_at_once() -> None:
    big = mk_node("p0", NodeRole.PREFILL, kv_capacity_bytes=100_000 * 4096, kv_bytes_per_token=4096)
    record = PrefillCacheRecord()
    sent_turn(record, big, H, key=("t", "c0"))
    for i in range(1, 4):  # 12,000 tokens of other conversations after it
        sent_turn(record, big, history(4000, seed=i), key=("t", f"c{i}"))
    assert held(record, history(4000, seed=1), key=("t", "c1")) == {"p0": 4000}
    receipt = sent_turn(record, big, [*H, *history(300, seed=9)], key=("t", "c0"))
    assert (receipt.age_tokens, receipt.shared_tokens, receipt.believed_tokens) == (12_000, 4000, 4000)
    # P found none of c0's history in its cache: it holds less than 12,000 tokens' worth, whatever
    # it registered. c1's prompt, sent longer ago than that, is given up too.
    record.observed(big, receipt, 0, 16)
    assert record.capacity_tokens("p0") == 12_000
    assert held(record, history(4000, seed=1), key=("t", "c1")).get("p0", 0) < 4000
    assert held(record, history(4000, seed=3), key=("t", "c3")) == {"p0": 4000}


def test_with_p_prefix_caching_off_the_record_soon_believes_nothing() -> None:
    record = PrefillCacheRecord()
    prompt = H[:1000]
    receipt = sent_turn(record, P0, prompt)
    assert receipt.shared_tokens == 0  # a first turn: nothing to learn from its report
    record.observed(P0, receipt, 0, 16)
    assert record.capacity_tokens("p0") is None
    for turn in range(3):
        prompt = [*prompt, *history(200, seed=10 + turn)]
        receipt = sent_turn(record, P0, prompt)
        record.observed(P0, receipt, 0, 16)  # P computed everything again
        assert held(record, [*prompt, 5]) == {}


def test_a_hit_the_record_had_given_up_raises_the_capacity_again() -> None:
    record = PrefillCacheRecord()
    prompt = H[:1000]
    sent_turn(record, P0, prompt)
    prompt = [*prompt, *history(200, seed=3)]
    record.observed(P0, sent_turn(record, P0, prompt), 0, 16)  # a miss: the record gives up
    assert held(record, [*prompt, 5]) == {}
    prompt = [*prompt, *history(200, seed=4)]
    receipt = sent_turn(record, P0, prompt)
    assert receipt.believed_tokens == 0
    # P had it all the same (the miss was a restart, say): the record believes it again, as far
    # as P showed it (1,200 tokens held at age 0).
    record.observed(P0, receipt, 1200, 16)
    assert record.capacity_tokens("p0") == 1200
    assert held(record, [*prompt, 5]) == {"p0": 1200}


def test_a_report_that_matches_the_record_changes_nothing() -> None:
    record = PrefillCacheRecord()
    prompt = H[:1000]
    sent_turn(record, P0, prompt)
    prompt = [*prompt, *history(200, seed=3)]
    record.observed(P0, sent_turn(record, P0, prompt), 992, 16)
    assert record.capacity_tokens("p0") is None
    assert held(record, [*prompt, 5]) == {"p0": 1200}


def test_a_node_is_trusted_to_keep_a_prompt_to_the_next_turn_only_once_its_reports_show_it() -> None:
    big = mk_node("p0", NodeRole.PREFILL, kv_capacity_bytes=100_000 * 4096, kv_bytes_per_token=4096)
    record = PrefillCacheRecord()
    prompt = H[:1000]
    first = sent_turn(record, big, prompt)
    # A first turn: no previous prompt on the node, nothing shown yet.
    assert not record.keeps_until_next_turn(big, first, len(prompt))
    prompt = [*prompt, *history(200, seed=3)]
    second = sent_turn(record, big, prompt)
    assert not record.keeps_until_next_turn(big, second, len(prompt))
    # P's report shows the previous prompt kept: from now on the node is trusted.
    record.observed(big, second, 992, 16)
    assert record.keeps_until_next_turn(big, second, len(prompt))
    # Another node, or a turn that did not follow this conversation's last prompt there, is not.
    assert not record.keeps_until_next_turn(P1, second, len(prompt))
    other = sent_turn(record, big, history(500, seed=8), key=("t", "other"))
    assert not record.keeps_until_next_turn(big, other, 500)


def test_a_miss_or_a_prompt_that_would_not_fit_behind_the_intake_loses_the_trust() -> None:
    small = mk_node("p0", NodeRole.PREFILL, kv_capacity_bytes=5_000 * 4096, kv_bytes_per_token=4096)
    record = PrefillCacheRecord()
    prompt = H[:1000]
    sent_turn(record, small, prompt)
    prompt = [*prompt, *history(200, seed=3)]
    receipt = sent_turn(record, small, prompt)
    record.observed(small, receipt, 992, 16)
    assert record.keeps_until_next_turn(small, receipt, len(prompt))
    # 2,000 tokens of other conversations since its last turn: twice that, plus the prompt, is
    # more than the node holds.
    sent_turn(record, small, history(2000, seed=5), key=("t", "busy"))
    prompt = [*prompt, *history(200, seed=4)]
    receipt = sent_turn(record, small, prompt)
    assert receipt.age_tokens == 2000
    assert not record.keeps_until_next_turn(small, receipt, len(prompt))
    # A miss takes the node out until a hit shows it keeping prompts again.
    record.observed(small, receipt, 0, 16)
    quiet = [*prompt, *history(100, seed=6)]
    assert not record.keeps_until_next_turn(small, sent_turn(record, small, quiet), len(quiet))


def test_other_conversations_cache_hits_count_against_keeping_a_prompt() -> None:
    # Four conversations share a node that holds 16,000 tokens. Each of their later turns takes in
    # only its new 300 tokens, but touches its whole history: an LRU keeps the most recently
    # touched blocks, so by a conversation's next turn the other three have pushed it out.
    node = mk_node("p0", NodeRole.PREFILL, kv_capacity_bytes=16_000 * 4096, kv_bytes_per_token=4096)
    record = PrefillCacheRecord()
    prompts = {f"c{i}": history(3000, seed=60 + i) for i in range(4)}
    receipts = {}
    for turn in range(2):
        for name, prompt in prompts.items():
            prompt = [*prompt, *history(300, seed=70 + turn)]
            prompts[name] = prompt
            receipts[name] = receipt = sent_turn(record, node, prompt, key=("t", name))
            if turn:
                record.observed(node, receipt, receipt.shared_tokens // 16 * 16, 16)
    receipt = receipts["c3"]
    assert receipt.age_tokens < 1200  # the intake: the others' new tokens
    assert receipt.touched_tokens > 9000  # what they touched
    assert not record.keeps_until_next_turn(node, receipt, len(prompts["c3"]))
    # Alone on a node that size, the same conversation would be kept.
    alone = PrefillCacheRecord()
    prompt = history(3000, seed=60)
    sent_turn(alone, node, prompt)
    prompt = [*prompt, *history(300, seed=71)]
    receipt = sent_turn(alone, node, prompt)
    alone.observed(node, receipt, receipt.shared_tokens // 16 * 16, 16)
    assert alone.keeps_until_next_turn(node, receipt, len(prompt))


def test_a_busy_node_without_prefix_caching_is_soon_believed_to_hold_nothing() -> None:
    """Conversations take turns on one node: every miss is seen at the age of the other
    conversations' intake, so the capacity it shows stays large; never a hit says there is none."""
    record = PrefillCacheRecord()
    prompts = {f"c{i}": history(1000, seed=20 + i) for i in range(4)}
    for turn in range(3):
        for name, prompt in prompts.items():
            prompt = [*prompt, *history(300, seed=40 + turn)]
            prompts[name] = prompt
            receipt = sent_turn(record, P0, prompt, key=("t", name))
            record.observed(P0, receipt, 0, 16)  # P computed every token again
    for name, prompt in prompts.items():
        assert held(record, [*prompt, 5], key=("t", name)) == {}
    # A hit from any conversation shows a cache again.
    fresh = [*prompts["c0"], *history(100, seed=99)]
    record.observed(P0, sent_turn(record, P0, fresh, key=("t", "c0")), 1296, 16)
    assert held(record, [*prompts["c1"], 5], key=("t", "c1")).get("p0", 0) > 0
