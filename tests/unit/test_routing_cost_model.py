"""The cost model: an affine prefill cost learned online, transfer and handshake estimates, queues."""

from __future__ import annotations

import random

import pytest

from kvplane.services.common.model.nodes import NodeRole
from kvplane.services.routing.policy import NodeState, policy_from_yaml
from kvplane.services.routing.policy.affine_fit import AffineFit
from kvplane.services.routing.policy.cost_model import CostModel, TurnObservation
from kvplane.services.routing.policy.registry import PolicyConfigError
from tests.unit.routing_policy_fixtures import mk_node, state

KVB = 64 * 8 * 128 * 2 * 2
P0 = mk_node("p0", NodeRole.PREFILL)


def truth(computed: int, reused: int) -> float:
    """An engine unlike the prior: 40 ms fixed, 0.05 ms per computed token, 0.004 per reused one."""
    return 40.0 + 0.05 * computed + 0.004 * reused


def observed(computed: int, reused: int, *, pulled: int = 0) -> TurnObservation:
    """P's leg for a turn: the pull's transfer (as the model estimates it), then the prefill."""
    return TurnObservation(
        prompt_tokens=computed + reused,
        pulled_tokens=pulled,
        cached_tokens=reused - pulled,
        prefill_ms=CostModel().transfer_ms(pulled) + truth(computed, reused),
    )


def test_the_default_model_reproduces_the_published_figures() -> None:
    model = CostModel()
    assert model.prefill_ms(2_000) == pytest.approx(158, rel=0.01)
    assert model.prefill_ms(24_000) == pytest.approx(778, rel=0.01)
    assert 25 <= model.transfer_ms(4_000) <= 40
    assert 120 <= model.transfer_ms(24_000) <= 140
    # A pull of a 24k-token history followed by a 512-token message: TTFT 460 ms.
    pulled = 24_000 - 512
    assert model.transfer_ms(pulled) + model.prefill_ms(512, pulled) == pytest.approx(460, rel=0.01)


def test_the_packaged_policy_holds_the_same_prior_as_the_code() -> None:
    packaged = policy_from_yaml(
        "decode: {}\nprefill: {}\ncost_model: {prefill_fixed_ms: 101.6, recompute_ms_per_token: 0.0282,"
        " reused_ms_per_token: 0.0092}"
    )
    assert packaged.cost_model == CostModel()


def test_the_fit_converges_to_an_affine_truth_from_reported_turns() -> None:
    rng = random.Random(7)
    model = CostModel()
    for _ in range(300):
        computed = rng.randrange(1, 8_000)
        reused = rng.choice((0, rng.randrange(0, 30_000)))
        model = model.observe(observed(computed, reused, pulled=reused // 2))
    # Every coefficient keeps a small pull toward its prior (min_prior_weight): the intercept,
    # the weakest-measured, stays within a tenth of the truth.
    assert model.prefill_fixed_ms == pytest.approx(40.0, rel=0.1)
    assert model.recompute_ms_per_token == pytest.approx(0.05, rel=0.02)
    assert model.reused_ms_per_token == pytest.approx(0.004, rel=0.1)
    assert model.prefill_samples == 300


def test_a_burst_of_small_turns_teaches_the_fixed_cost_a_per_token_rate_would_miss() -> None:
    model = CostModel(prefill_fixed_ms=0.0)
    rng = random.Random(3)
    for _ in range(100):
        model = model.observe(observed(rng.randrange(16, 256), 0))
    # Fifty 100-token turns: the queue is mostly their fixed costs.
    assert 50 * model.prefill_ms(100) == pytest.approx(50 * truth(100, 0), rel=0.1)


def test_the_prior_moves_at_the_rate_of_a_moving_average() -> None:
    prior = CostModel(alpha=0.1)
    one = prior.observe(observed(2_000, 0))
    # One turn weighs alpha against the prior's 1 - alpha: the prediction for it moves
    # by at most alpha of the way to the observation, and in the observation's direction.
    before, after, seen = prior.prefill_ms(2_000), one.prefill_ms(2_000), truth(2_000, 0)
    assert before > seen and seen < after < before
    assert before - after <= prior.alpha * (before - seen) * 1.01
    # A coefficient the turns cannot tell apart stays at its prior: no turn reused a token.
    model = prior
    for _ in range(200):
        model = model.observe(observed(2_000, 0))
    assert model.prefill_ms(2_000) == pytest.approx(seen, rel=0.01)
    assert model.reused_ms_per_token == pytest.approx(prior.reused_ms_per_token, rel=0.05)


def test_one_absurd_report_moves_the_estimate_by_a_bounded_step() -> None:
    model = CostModel()
    wild = model.observe(TurnObservation(prompt_tokens=10_000, prefill_ms=1e9))
    bound = model.prefill_ms(10_000) * (1 + model.alpha * model.max_sample_factor)
    assert model.prefill_ms(10_000) < wild.prefill_ms(10_000) <= bound
    assert model.observe(TurnObservation(prompt_tokens=10_000, prefill_ms=640.0, success=False)) is model


def test_a_sample_factor_of_one_holds_the_model_at_its_configured_estimates() -> None:
    held = CostModel(max_sample_factor=1.0)
    model = held
    for computed in (10, 500, 20_000):
        model = model.observe(
            TurnObservation(prompt_tokens=computed + 100, cached_tokens=100, prefill_ms=1.0)
        )
    assert model.prefill_ms(3_000, 1_000) == pytest.approx(held.prefill_ms(3_000, 1_000))
    assert model.prefill_samples == 3


def test_a_turn_without_a_prefill_time_teaches_from_its_ttft_only_when_it_reused_nothing() -> None:
    model = CostModel()
    assert model.observe(TurnObservation(prompt_tokens=5_000, cached_tokens=4_000, ttft_ms=9.0)) == model
    assert model.observe(TurnObservation(prompt_tokens=5_000, ttft_ms=400.0)).prefill_samples == 1


def test_the_transfer_rate_learns_from_warm_pulls_and_the_handshake_from_first_pulls_only() -> None:
    model = CostModel()
    fast = model.observe(
        TurnObservation(prompt_tokens=5000, pulled_tokens=4096, transfer_ms=20.0, kv_bytes_per_token=KVB)
    )
    assert fast.transfer_bytes_per_ms > model.transfer_bytes_per_ms and fast.transfer_samples == 1
    warm = model.transfer_ms(4096, KVB)
    first = model.observe(
        TurnObservation(
            prompt_tokens=5000,
            pulled_tokens=4096,
            transfer_ms=warm + 60.0,
            kv_bytes_per_token=KVB,
            first_contact=True,
        )
    )
    assert first.handshake_ms == pytest.approx(model.handshake_ms + model.alpha * (60.0 - model.handshake_ms))
    assert first.handshake_samples == 1 and first.transfer_bytes_per_ms == model.transfer_bytes_per_ms


def test_the_wait_a_busy_prefill_node_queued_the_turn_is_not_learned_as_compute() -> None:
    rng = random.Random(11)
    model = CostModel()
    for _ in range(300):
        computed, reused = rng.randrange(1, 8_000), rng.randrange(0, 20_000)
        # A busy P: each leg waited behind earlier work, which the router expected (give or
        # take a fifth) when it routed the turn.
        wait = 0.5 * truth(computed, reused) * rng.uniform(0.0, 1.0)
        leg = TurnObservation(
            prompt_tokens=computed + reused,
            cached_tokens=reused,
            prefill_ms=truth(computed, reused) + wait,
            queued_ms=wait * rng.uniform(0.8, 1.2),
        )
        model = model.observe(leg)
    assert model.recompute_ms_per_token == pytest.approx(0.05, rel=0.1)
    assert model.prefill_fixed_ms == pytest.approx(40.0, rel=0.25)


def test_turns_that_all_compute_the_same_tokens_leave_the_per_token_rate_near_its_prior() -> None:
    """A chat whose every turn computes one message over a growing history cannot tell the fixed
    cost from the per-computed-token rate; noise that grows with the history must not drive the
    rate to nothing (recomputing a whole history would then look free)."""
    rng = random.Random(3)
    model = CostModel()
    for _ in range(400):
        computed, reused = rng.randrange(1_000, 1_050), rng.randrange(0, 5_000)
        truth_ms = 101.6 + 0.0282 * computed
        # What is left of P's queueing after the router's estimate: more on longer histories.
        residue = rng.uniform(0.0, 0.01) * reused
        leg = TurnObservation(
            prompt_tokens=computed + reused, cached_tokens=reused, prefill_ms=truth_ms + residue
        )
        model = model.observe(leg)
    assert model.recompute_ms_per_token >= CostModel().recompute_ms_per_token / 2
    assert model.reused_ms_per_token < model.recompute_ms_per_token
    assert model.prefill_ms(5_000) == pytest.approx(101.6 + 0.0282 * 5_000, rel=0.3)


def test_legs_timed_on_a_busy_machine_never_price_a_computed_token_below_a_quarter_of_its_figure() -> None:
    """Pulled turns that each compute about one message, whose legs carry a wait the router
    guessed wrong (as on a loaded machine at 32 conversations in flight): the fit once gave the
    fixed cost the whole leg and the per-token rate nothing, so a recompute of a 4,600-token
    history looked as cheap as its 5 ms pull, and routing stopped pulling."""
    rng = random.Random(1)
    prior = CostModel()
    model = prior
    for i in range(400):
        prompt = 1_400 + (i % 5) * 1_025 + rng.randint(-100, 100)
        computed = prompt if i % 5 == 0 else rng.randint(800, 1_000)
        pulled = prompt - computed
        wait = rng.expovariate(1 / 60)
        leg = TurnObservation(
            prompt_tokens=prompt,
            pulled_tokens=pulled,
            transfer_ms=5.0 if pulled else 0.0,
            prefill_ms=101.6 + 0.0282 * computed + 0.0092 * pulled + wait + (5.0 if pulled else 0.0),
            queued_ms=wait * rng.uniform(0.3, 1.5),
            kv_bytes_per_token=KVB,
        )
        model = model.observe(leg)
        assert model.recompute_ms_per_token >= prior.recompute_ms_per_token / prior.max_sample_factor, i
        # So a pull of a long history keeps paying for a short transfer.
        assert model.recompute_ms(4_600) - model.reused_ms(4_600) > 10.0, i


@pytest.mark.parametrize("share", [0.5, 0.25])
def test_a_reused_token_never_costs_more_than_its_share_of_a_computed_one(share: float) -> None:
    # Turns whose time grows with the history far faster than with what they compute (a host
    # whose CPU is shared, say, or pulls whose transfer was not all taken off) would fit a reused
    # token as dear as a computed one: a pull would then save nothing, routing would stop
    # pulling, and no later turn would correct it.
    model = CostModel(max_reused_share=share)
    for i in range(200):
        computed, reused = 1_000 + i % 7, 500 * (i % 10)
        leg = TurnObservation(
            prompt_tokens=computed + reused, cached_tokens=reused, prefill_ms=100 + 0.2 * reused
        )
        model = model.observe(leg)
    assert model.reused_ms_per_token == pytest.approx(model.recompute_ms_per_token * share)
    saved = model.recompute_ms(4_000) - model.reused_ms(4_000)
    assert saved == pytest.approx(model.recompute_ms(4_000) * (1 - share))


def test_the_reused_share_is_checked() -> None:
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="max_reused_share"):
            CostModel(max_reused_share=bad)


def test_a_pulls_transfer_is_not_learned_as_the_cost_of_attending_over_the_pulled_tokens() -> None:
    rng = random.Random(5)
    model = CostModel()
    for _ in range(300):
        computed, pulled = rng.randrange(200, 2_000), rng.choice((0, rng.randrange(1_000, 20_000)))
        transfer = model.transfer_ms(pulled, KVB) if pulled else 0.0
        # P's leg: the pull (unreported: the model's own estimate), then the prefill.
        leg = TurnObservation(
            prompt_tokens=computed + pulled,
            pulled_tokens=pulled,
            prefill_ms=transfer + truth(computed, pulled),
            kv_bytes_per_token=KVB,
        )
        model = model.observe(leg)
    assert model.reused_ms_per_token == pytest.approx(0.004, abs=0.002)
    assert model.recompute_ms_per_token == pytest.approx(0.05, rel=0.1)


def test_a_leg_that_waited_longer_than_it_computed_teaches_nothing() -> None:
    model = CostModel()
    waited = TurnObservation(prompt_tokens=4_000, prefill_ms=2_000.0, queued_ms=1_500.0)
    assert model.observe(waited).prefill_samples == 0
    assert model.observe(waited).recompute_ms_per_token == model.recompute_ms_per_token
    computed = TurnObservation(prompt_tokens=4_000, prefill_ms=2_000.0, queued_ms=900.0)
    assert model.observe(computed).prefill_samples == 1


def test_a_wait_p_measured_is_taken_off_however_long_and_every_leg_teaches() -> None:
    """P's own measure of the wait (and of the pull) leaves the compute exactly: a leg that waited
    longer than it computed teaches, and what it teaches is the compute, not the wait."""
    rng = random.Random(11)
    model = CostModel(prefill_fixed_ms=10.0, recompute_ms_per_token=0.1, reused_ms_per_token=0.0)
    for _ in range(300):
        computed, pulled = rng.randrange(200, 8_000), rng.choice([0, rng.randrange(1_000, 20_000)])
        wait, transfer = rng.uniform(0.0, 3_000.0), (0.004 * pulled if pulled else 0.0)
        leg = TurnObservation(
            prompt_tokens=computed + pulled,
            pulled_tokens=pulled,
            transfer_ms=transfer,
            prefill_ms=101.6 + 0.0282 * computed + 0.0092 * pulled + wait + transfer,
            queued_ms=wait,
            queued_measured=True,
        )
        model = model.observe(leg)
    assert model.prefill_samples == 300
    assert model.recompute_ms_per_token == pytest.approx(0.0282, rel=0.15)
    assert model.prefill_ms(4_000) == pytest.approx(101.6 + 0.0282 * 4_000, rel=0.1)
    # The same legs with the wait an estimate: the ones that waited longest teach nothing.
    guessed = TurnObservation(prompt_tokens=4_000, prefill_ms=2_000.0, queued_ms=1_500.0)
    assert CostModel().observe(guessed).prefill_samples == 0
    measured = TurnObservation(
        prompt_tokens=4_000, prefill_ms=2_000.0, queued_ms=1_500.0, queued_measured=True
    )
    assert CostModel().observe(measured).prefill_samples == 1
    # A pull whose time P did not say is still an estimate: the rule for estimates holds.
    unsaid = TurnObservation(
        prompt_tokens=4_000, pulled_tokens=2_000, prefill_ms=2_000.0, queued_ms=1_500.0, queued_measured=True
    )
    assert CostModel().observe(unsaid).prefill_samples == 0


def test_the_marginal_costs_leave_the_fixed_cost_out() -> None:
    model = CostModel(prefill_fixed_ms=100.0, recompute_ms_per_token=0.03, reused_ms_per_token=0.01)
    assert model.recompute_ms(100) == pytest.approx(3.0)
    assert model.reused_ms(100) == pytest.approx(1.0)
    assert model.prefill_ms(100, 100) == pytest.approx(104.0)


def test_a_report_queue_costs_each_request_its_fixed_part_and_a_running_one_half() -> None:
    model = CostModel(prefill_fixed_ms=100.0, recompute_ms_per_token=0.03)
    busy = state(P0, queued_requests=4, running_requests=1, queued_prefill_tokens=1_000)
    assert model.queue_ms(busy) == pytest.approx(4.5 * 100.0 + 30.0)
    assert model.queue_ms(NodeState(P0)) == 0.0
    # The router's own estimate, when it has one, is the queue.
    assert model.queue_ms(NodeState(P0, busy.load, queued_prefill_ms=12.0)) == 12.0


@pytest.mark.parametrize(
    "section",
    [
        "{prefill_fixed_ms: -1}",
        "{reused_ms_per_token: -0.1}",
        "{recompute_ms_per_token: 0}",
        "{min_prior_weight: 0}",
        "{alpha: 0}",
        "{prefill_fit: {}}",
        "{prefill_samples: 3}",
    ],
)
def test_nonsense_cost_settings_are_rejected(section: str) -> None:
    with pytest.raises(PolicyConfigError):
        policy_from_yaml(f"decode: {{}}\nprefill: {{}}\ncost_model: {section}")


def test_the_fit_keeps_coefficients_at_their_floor_and_refits_the_rest() -> None:
    fit = AffineFit(prior=(10.0, 0.1), scale=(100.0,), floor=(0.0, 0.0), alpha=0.5)
    # A cost that falls with size (a stale, noisy engine): the slope stops at 0 and the level follows.
    for _ in range(5):
        fit = fit.update((0.0,), 100.0).update((100.0,), 50.0)
    c0, c1 = fit.coefficients
    assert c1 == 0.0 and 50.0 < c0 < 100.0


def _warm_pull(tokens: int, ms: float, kv_bytes_per_token: int = KVB) -> TurnObservation:
    return TurnObservation(
        prompt_tokens=tokens + 100,
        pulled_tokens=tokens,
        transfer_ms=ms,
        kv_bytes_per_token=kv_bytes_per_token,
    )


def test_pulls_of_several_sizes_teach_the_overhead_and_the_bandwidth_apart() -> None:
    # A link with a 15 ms overhead and 30 GB/s, where the prior says 10 ms and 52 GB/s.
    model = CostModel()
    for i in range(120):
        tokens = (1_024, 8_192)[i % 2]
        model = model.observe(_warm_pull(tokens, 15.0 + tokens * KVB / 30e6))
    assert model.transfer_overhead_ms == pytest.approx(15.0, abs=1.0)
    assert model.transfer_bytes_per_ms == pytest.approx(30e6, rel=0.1)
    assert model.transfer_ms(4_096, KVB) == pytest.approx(15.0 + 4_096 * KVB / 30e6, rel=0.05)
    assert model.transfer_samples == 120


def test_small_pulls_teach_their_overhead_and_leave_the_bandwidth_near_its_prior() -> None:
    # A small model's KV (2 KiB a token): every pull is a few MB, and it is the fixed part that is
    # wrong (25 ms where the prior says 10); per byte, these pulls say next to nothing.
    model = CostModel()
    for _ in range(60):
        model = model.observe(_warm_pull(3_000, 25.0, kv_bytes_per_token=2_048))
    assert model.transfer_ms(3_000, 2_048) == pytest.approx(25.0, abs=1.0)
    assert model.transfer_bytes_per_ms == pytest.approx(CostModel().transfer_bytes_per_ms, rel=0.05)
