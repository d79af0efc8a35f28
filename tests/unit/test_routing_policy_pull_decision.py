"""The pull-or-recompute rule: one row per reason, and the order between them."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest

from kvplane.connector.digests import chain
from kvplane.services.common.model.nodes import NodeRole
from kvplane.services.routing.policy import CostModel, Decision, Prompt, PullSettings, decide_pull
from kvplane.services.routing.policy.prefix_match import match_prefix
from kvplane.services.routing.policy.pull_decision import pull_could_pay
from tests.unit.routing_policy_fixtures import history, mk_handle, mk_node, snap, state

HOLDER = mk_node("d0")
P = state(mk_node("p0", NodeRole.PREFILL), queued_prefill_tokens=0)
H = history(4096)
NEW = history(50, seed=9)


def verdict(
    *,
    handle: Any = "default",
    prompt: Prompt | None = None,
    holder: Any = HOLDER,
    compatible: bool = True,
    prefill: Any = P,
    costs: CostModel | None = None,
    settings: PullSettings | None = None,
    **snap_kw: Any,
) -> Any:
    h = mk_handle(HOLDER, H) if handle == "default" else handle
    s = snap(handle=h, prompt=prompt or Prompt(len(H) + len(NEW), [*H, *NEW]), **snap_kw)
    return decide_pull(s, holder, prefill, compatible, costs or CostModel(), settings or PullSettings())


@pytest.mark.parametrize(
    ("case", "kwargs", "decision"),
    [
        ("continuation", {}, Decision.PULL),
        ("no handle", {"handle": None}, Decision.RECOMPUTE_NO_HANDLE),
        ("holder gone", {"holder": None}, Decision.RECOMPUTE_HOLDER_DOWN),
        ("no compatible P", {"compatible": False}, Decision.RECOMPUTE_HOLDER_DOWN),
        ("4 s of life", {"handle": mk_handle(HOLDER, H, life_ms=4_000)}, Decision.RECOMPUTE_EXPIRING),
        ("just enough life", {"handle": mk_handle(HOLDER, H, life_ms=5_200)}, Decision.PULL),
        (
            "life eaten by P's queue",
            {
                "handle": mk_handle(HOLDER, H, life_ms=8_000),
                "prefill": state(mk_node("p0", NodeRole.PREFILL), queued_prefill_tokens=200_000),
            },
            Decision.RECOMPUTE_EXPIRING,
        ),
        (
            "edited",
            {"prompt": Prompt(4146, [*H[:99], 0, *H[100:], *NEW])},
            Decision.RECOMPUTE_PREFIX_MISMATCH,
        ),
        ("retried: a verified prefix", {"prompt": Prompt(4000, H[:4000])}, Decision.PULL_PREFIX),
        ("same length: a verified prefix", {"prompt": Prompt(4096, H)}, Decision.PULL_PREFIX),
        (
            "retried, prefixes off",
            {"prompt": Prompt(4000, H[:4000]), "settings": PullSettings(pull_prefixes=False)},
            Decision.RECOMPUTE_PREFIX_MISMATCH,
        ),
        ("retried, length only", {"prompt": Prompt(4000)}, Decision.RECOMPUTE_PREFIX_MISMATCH),
        ("no digests", {"handle": mk_handle(HOLDER, H, digests=False)}, Decision.RECOMPUTE_PREFIX_MISMATCH),
        (
            "no digests, not required",
            {"handle": mk_handle(HOLDER, H, digests=False), "settings": PullSettings(require_digests=False)},
            Decision.PULL,
        ),
        ("length only", {"prompt": Prompt(5000)}, Decision.PULL),
        ("block digests", {"prompt": Prompt(4146, (), chain([*H, *NEW], 16), 16)}, Decision.PULL),
        (
            "block digests of other tokens",
            {"prompt": Prompt(4146, (), chain(history(4146, seed=3), 16), 16)},
            Decision.RECOMPUTE_PREFIX_MISMATCH,
        ),
        ("other model", {"model": "other"}, Decision.RECOMPUTE_PREFIX_MISMATCH),
        (
            "below threshold",
            {"handle": mk_handle(HOLDER, H[:48]), "prompt": Prompt(60, H[:60])},
            Decision.RECOMPUTE_BELOW_THRESHOLD,
        ),
        (
            "slow link",
            {"costs": CostModel(transfer_bytes_per_ms=1_000.0)},
            Decision.RECOMPUTE_COST,
        ),
        (
            "small and first contact",
            {"handle": mk_handle(HOLDER, H[:512]), "prompt": Prompt(600, H[:600])},
            Decision.RECOMPUTE_COST,
        ),
    ],
)
def test_pull_decision(case: str, kwargs: dict[str, Any], decision: Decision) -> None:
    assert verdict(**kwargs).decision is decision, case


def test_pull_reports_the_verified_whole_blocks_and_estimates() -> None:
    v = verdict()
    assert v.decision is Decision.PULL
    assert v.reusable_tokens == 4096
    assert 0 < v.transfer_ms < v.recompute_ms
    assert v.life_left_ms == 120_000


def test_partial_last_block_is_not_counted_as_reusable() -> None:
    h = mk_handle(HOLDER, H[:4100])
    v = verdict(handle=h, prompt=Prompt(4200, [*H[:4100], *NEW, *NEW]))
    assert v.decision is Decision.PULL and v.reusable_tokens == 4096


def test_expiry_is_checked_before_the_prefix_so_a_dying_handle_says_expiring() -> None:
    v = verdict(handle=mk_handle(HOLDER, H, life_ms=1_000), prompt=Prompt(10, H[:10]))
    assert v.decision is Decision.RECOMPUTE_EXPIRING


def test_the_handshake_lengthens_a_first_pull_but_does_not_decline_it() -> None:
    # 1,280 tokens to pull: warm, the transfer pays for the compute it saves; the first pull
    # between the two engines pays the handshake as well, once. Declined for it, the pair would
    # stay cold and every later turn would be judged the same way.
    handle = mk_handle(HOLDER, H[:1280])
    prompt = Prompt(1280 + 2 * len(NEW), [*H[:1280], *NEW, *NEW])
    cold = verdict(handle=handle, prompt=prompt)
    warm = verdict(handle=handle, prompt=prompt, contacted=frozenset({("p0", HOLDER.engine_id)}))
    costs = CostModel()
    saved = costs.recompute_ms(1280) - costs.reused_ms(1280)
    assert cold.transfer_ms > saved >= warm.transfer_ms + PullSettings().min_saving_ms
    assert cold.decision is Decision.PULL and warm.decision is Decision.PULL
    assert cold.transfer_ms - warm.transfer_ms == pytest.approx(costs.handshake_ms)


def test_a_pull_must_save_its_margin_beyond_its_estimated_transfer() -> None:
    # 1,024 tokens: the warm transfer (about 10 ms) is under the 19.5 ms of compute it saves, but
    # by less than the 10 ms margin that covers a pull's spread and its costs off the turn's path.
    handle = mk_handle(HOLDER, H[:1024])
    prompt = Prompt(1024 + 2 * len(NEW), [*H[:1024], *NEW, *NEW])
    warm = frozenset({("p0", HOLDER.engine_id)})
    costs = CostModel()
    saved = costs.recompute_ms(1024) - costs.reused_ms(1024)
    transfer = costs.transfer_ms(1024, HOLDER.kv_bytes_per_token)
    assert 0 < saved - transfer < PullSettings().min_saving_ms
    assert verdict(handle=handle, prompt=prompt, contacted=warm).decision is Decision.RECOMPUTE_COST
    no_margin = PullSettings(min_saving_ms=0)
    assert verdict(handle=handle, prompt=prompt, contacted=warm, settings=no_margin).decision is Decision.PULL
    with pytest.raises(ValueError, match="min_saving_ms"):
        PullSettings(min_saving_ms=-1)


def test_a_first_pull_that_would_not_pay_warm_is_still_declined() -> None:
    # 4,096 missing tokens whose reuse costs nearly what computing them does: no pull, cold or warm.
    dear_reuse = CostModel(recompute_ms_per_token=0.03, reused_ms_per_token=0.029)
    assert verdict(costs=dear_reuse).decision is Decision.RECOMPUTE_COST


def test_match_prefix_finds_divergence_late_in_the_handle() -> None:
    h = mk_handle(HOLDER, H)
    late_edit = [*H[:4090], 1, *H[4091:], *NEW]
    m = match_prefix(h, Prompt(len(late_edit), late_edit))
    assert not m.continues and m.reusable_tokens < 4096


def test_settings_reject_nonsense() -> None:
    with pytest.raises(ValueError):
        PullSettings(max_transfer_fraction=0)
    with pytest.raises(ValueError):
        PullSettings(threshold_tokens=-1)
    assert replace(PullSettings(), threshold_tokens=0).threshold_tokens == 0


def test_a_tail_cheaper_to_recompute_is_recomputed_without_counting_the_fixed_cost_against_it() -> None:
    # P holds all but the handle's last 96 tokens. Pulling them pays a transfer's 10 ms; computing
    # them adds ~2 ms to a prefill that runs anyway. Were the prefill's 100 ms fixed cost put on the
    # recompute side, the pull would look like a saving.
    costs = CostModel(prefill_fixed_ms=100.0, recompute_ms_per_token=0.03, reused_ms_per_token=0.01)
    cached = len(H) - 96
    v = verdict(costs=costs, prefill_cached_tokens={"p0": cached}, prefill_cache_known={"p0"})
    assert v.decision is Decision.RECOMPUTE_COST, v.reason
    assert v.recompute_ms == pytest.approx(96 * 0.03)
    assert v.transfer_ms > costs.recompute_ms(96) - costs.reused_ms(96)


def test_a_guess_of_what_p_holds_never_declines_a_pull() -> None:
    # The same belief, guessed from what the router sent P (no event, no report has shown it):
    # P may hold none of it (prefix caching off, a restart), and would then recompute the whole
    # history. The pull is offered; P loads only what its cache lacks.
    cached = len(H) - 96
    guessed = verdict(prefill_cached_tokens={"p0": cached})
    assert guessed.decision is Decision.PULL, guessed.reason
    assert guessed.reusable_tokens == len(H) and guessed.cached_tokens == cached
    # Known, the same belief leaves a tail that is cheaper to recompute.
    known = verdict(prefill_cached_tokens={"p0": cached}, prefill_cache_known={"p0"})
    assert known.decision is Decision.RECOMPUTE_COST


def test_a_pull_must_beat_the_compute_it_saves_net_of_attending_over_the_pulled_tokens() -> None:
    # 4,096 missing tokens: a 10.3 ms transfer against 4096 x 0.03 = 123 ms of compute, of which
    # attending over the pulled tokens still costs some.
    cheap_reuse = CostModel(recompute_ms_per_token=0.03, reused_ms_per_token=0.0)
    dear_reuse = CostModel(recompute_ms_per_token=0.03, reused_ms_per_token=0.029)
    contacted = frozenset({("p0", HOLDER.engine_id)})
    assert verdict(costs=cheap_reuse, contacted=contacted).decision is Decision.PULL
    assert verdict(costs=dear_reuse, contacted=contacted).decision is Decision.RECOMPUTE_COST


def test_a_pull_could_pay_only_past_the_threshold_and_the_break_even_of_its_transfer() -> None:
    costs, settings = CostModel(), PullSettings()
    kvb = 4096
    # Under the threshold: recomputed whatever the cost.
    assert not pull_could_pay(settings.threshold_tokens - 1, kvb, costs, settings)
    # A last answer's worth: the transfer's fixed overhead exceeds the compute it saves.
    assert not pull_could_pay(128, kvb, costs, settings)
    # A history: the compute saved dwarfs the transfer.
    assert pull_could_pay(8_000, kvb, costs, settings)
    # The same rule as the verdict's: where one pulls, so does the other; the pull saves its
    # margin beyond the transfer, and 16 tokens fewer would not.
    tokens = next(n for n in range(64, 20_000, 16) if pull_could_pay(n, kvb, costs, settings))
    saved = costs.recompute_ms(tokens) - costs.reused_ms(tokens)
    assert costs.transfer_ms(tokens, kvb) + settings.min_saving_ms <= saved
    fewer = costs.recompute_ms(tokens - 16) - costs.reused_ms(tokens - 16)
    assert costs.transfer_ms(tokens - 16, kvb) + settings.min_saving_ms > fewer
