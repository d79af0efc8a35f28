"""Estimates of prefill, pull and queueing times, learned online from reported turns.

A prefill on P costs a fixed part per request (scheduling, the forward
passes' own overhead, the hand-off to D), plus a part per token it computes,
plus a smaller part per token it does not compute but attends over (found in
its own prefix cache, or pulled): an affine model, not a rate per token. A
queue of many small turns is then mostly fixed costs, which a per-token rate
cannot see.

The prior is the published figures in DESIGN.md (Qwen3-32B, one P and one D):

- prefill: TTFT 158 ms at 2k tokens and 778 ms at 24k, so the line through
  them: 101.6 ms fixed plus 0.0282 ms per computed token;
- transfer: 30-130 ms per pull. Qwen3-32B's KV in bf16 is 64 layers x 8 KV
  heads x 128 dims x 2 (K, V) x 2 bytes = 256 KiB per token; a fixed 10 ms
  plus 52 GB/s gives 31 ms at 4k tokens and 131 ms at 24k, which spans them;
- with a pull, TTFT 460 ms at 24k tokens. Take away the transfer and the
  prefill of a 512-token suffix and 0.0092 ms per pulled token is left: the
  suffix attends over the whole pulled context.

Learning (every successful reported turn with a prefill time):

- the three prefill coefficients are one least-squares fit over the turns'
  (computed, reused) token counts (`affine_fit`): each turn weighs `alpha`
  (0.1: a memory of about 10 turns), and the prior weighs as a moving
  average's start does, (1 - alpha)^n after n turns (0.1: a third after 10
  turns, 4% after 30), never under a hundredth of each coefficient's own
  weight in the samples, so a part the turns cannot tell from another (a
  chat whose every turn computes one message's worth over a longer history
  cannot tell the fixed cost from the per-token rate) stays near its prior
  instead of drifting on noise to a rate of nothing;
- P's leg includes its wait behind the turns routed there before and, for a
  pull, the transfer: the wait (`TurnObservation.queued_ms`: as P measured
  it, else the router's expectation) and the transfer (reported, else
  estimated) are taken off. Where either is an estimate, a leg that spent
  longer on them than computing teaches nothing (the estimate's error would
  be most of the sample); where P measured both, every leg teaches;
- a warm pull's fixed overhead and its cost per byte are one least-squares
  fit over the pulls' (bytes, ms) as P measured them, weighted as the
  prefill's is, with the configured figures as its prior: pulls of a few
  sizes separate the two (pulls whose time does not grow with their size
  take the per-byte cost to its floor), and where every pull is about one
  size the fit moves the part the samples measure and leaves the other near
  its prior, so a pull's estimate follows what pulls of its size take; an
  engine that reports no pull time leaves both at the prior (the gateway
  reports `kvplane_pull_ms` as the turn's `transfer_ms`); the handshake is
  an exponentially weighted average of what first pulls between two
  engines took beyond a warm pull;
- each sample is clamped to `max_sample_factor` of the current estimate, so
  that one odd report (a cold engine, a stalled link) cannot swing
  decisions; a factor of 1 holds the model at its configured estimates;
- the learned cost of a computed token is held to at least its configured
  figure divided by `max_sample_factor` (4: a quarter of it). Measured live
  (2 P + 2 D, P's caches off, 32 conversations in flight), turns that each
  compute about one message over a longer history, timed on a busy machine,
  drove the fitted rate to nothing within a few hundred turns: the fixed
  cost took the whole leg, a 4,600-token recompute was priced as saving
  0.0 ms against a 5 ms pull, and the last turns of the run recomputed
  their whole histories at up to 3.9 times the median turn's TTFT. The
  compute a model's token costs on given accelerators does not fall
  fourfold while it serves; a configured figure that far off is the
  operator's to correct (`kvplane_cost_recompute_seconds_per_token`
  shows the fitted rate);
- the learned cost of a reused token is held to at most `max_reused_share`
  of a computed one's (0.5). A reused token skips its projections and MLP;
  only the new tokens' attention over it remains, which computing it pays
  too. A fit that says more is a pull's transfer or wait that was not fully
  taken off, on a busy machine; believed, it makes every pull look like a
  loss, and once routing stops pulling no turn corrects it (a turn that
  reuses nothing says nothing about reused tokens).

The model is a frozen value: `observe` returns the updated model, so the
simulator replays reports through the same code deterministically.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from kvplane.services.common.model.nodes import NodeLoad
from kvplane.services.routing.policy.affine_fit import AffineFit

if TYPE_CHECKING:
    from kvplane.services.routing.policy.snapshot import NodeState

# Qwen3-32B bf16, the model the default figures were measured with.
DEFAULT_KV_BYTES_PER_TOKEN = 64 * 8 * 128 * 2 * 2
# Turns of this many tokens hold a coefficient as firmly as the prior does (affine_fit's scale).
_SCALE_TOKENS = 1_000.0
# Every computed token costs something: the per-token rate never learns its way to zero.
_MIN_MS_PER_TOKEN = 1e-6
# Pulls of this many bytes (4,096 tokens of the default model) hold the per-byte cost as firmly as
# the prior does.
_SCALE_BYTES = 4096.0 * DEFAULT_KV_BYTES_PER_TOKEN
# Every byte costs something (10 TB/s at most): the learned bandwidth stays finite.
_MIN_MS_PER_BYTE = 1e-10


@dataclass(frozen=True, slots=True)
class TurnObservation:
    """What ReportTurn says about one finished turn (ms, tokens, bytes)."""

    prompt_tokens: int
    pulled_tokens: int = 0
    transfer_ms: float = 0.0
    prefill_ms: float = 0.0
    ttft_ms: float = 0.0
    kv_bytes_per_token: int = 0
    success: bool = True
    # The pull was the first between its prefill engine and the holder, so it
    # paid the handshake.
    first_contact: bool = False
    # Prompt tokens P found in its own prefix cache: neither pulled nor computed.
    cached_tokens: int = 0
    # The turn's wait on P for its compute, its pull left out (ms): as P measured it
    # (`queued_measured`), else the wait the router expected when it routed it (the work routed
    # there before it). `prefill_ms` is P's whole leg, so it includes that wait.
    queued_ms: float = 0.0
    queued_measured: bool = False


@dataclass(frozen=True, slots=True)
class CostModel:
    """Prefill, pull and queue time estimates, in milliseconds."""

    # A prefill's cost on P: fixed per request, per computed token, per token reused
    # (cached or pulled) that the computed ones attend over.
    prefill_fixed_ms: float = 101.6
    recompute_ms_per_token: float = 0.0282
    reused_ms_per_token: float = 0.0092
    transfer_bytes_per_ms: float = 52e6
    transfer_overhead_ms: float = 10.0
    # A first pull between two engines pays the NIXL handshake (metadata
    # exchange and memory registration lookup).
    handshake_ms: float = 20.0
    default_kv_bytes_per_token: int = DEFAULT_KV_BYTES_PER_TOKEN
    # Weight of a new sample (in the prefill fit and the moving averages).
    alpha: float = 0.1
    # Samples further than this factor from the estimate are clamped to it.
    max_sample_factor: float = 4.0
    # The learned cost of a reused token is at most this share of a computed token's.
    max_reused_share: float = 0.5
    # The least weight each prefill coefficient's prior keeps, as a share of that coefficient's
    # weight in the samples (`affine_fit`): a ridge where the turns cannot tell coefficients apart.
    min_prior_weight: float = 0.01
    prefill_samples: int = 0
    transfer_samples: int = 0
    handshake_samples: int = 0
    # The prefill fit so far (None: no sample yet; the three prefill figures above are its prior).
    prefill_fit: AffineFit | None = None
    # The warm pulls' fit so far: overhead and ms per byte (None: no sample yet; the transfer
    # figures above are its prior).
    transfer_fit: AffineFit | None = None

    def __post_init__(self) -> None:
        if self.recompute_ms_per_token <= 0 or self.transfer_bytes_per_ms <= 0:
            raise ValueError("rates must be positive")
        if self.prefill_fixed_ms < 0 or self.reused_ms_per_token < 0:
            raise ValueError("prefill_fixed_ms and reused_ms_per_token must not be negative")
        if not 0 < self.alpha <= 1:
            raise ValueError("alpha must be in (0, 1]")
        if self.max_sample_factor < 1:
            raise ValueError("max_sample_factor must be at least 1")
        if not 0 < self.max_reused_share <= 1:
            raise ValueError("max_reused_share must be in (0, 1]")
        if not 0 < self.min_prior_weight <= 1:
            raise ValueError("min_prior_weight must be in (0, 1]")

    def bytes_for(self, tokens: int, kv_bytes_per_token: int = 0) -> int:
        return tokens * (kv_bytes_per_token or self.default_kv_bytes_per_token)

    def transfer_ms(self, tokens: int, kv_bytes_per_token: int = 0, *, first_contact: bool = False) -> float:
        """Time for P to pull `tokens` tokens of KV from the holder."""
        if tokens <= 0:
            return 0.0
        ms = (
            self.transfer_overhead_ms
            + self.bytes_for(tokens, kv_bytes_per_token) / self.transfer_bytes_per_ms
        )
        return ms + (self.handshake_ms if first_contact else 0.0)

    def prefill_ms(self, computed_tokens: int, reused_tokens: int = 0) -> float:
        """One prefill on P: its fixed cost, `computed_tokens` computed and `reused_tokens` reused."""
        return (
            self.prefill_fixed_ms
            + max(0, computed_tokens) * self.recompute_ms_per_token
            + max(0, reused_tokens) * self.reused_ms_per_token
        )

    def recompute_ms(self, tokens: int) -> float:
        """What computing `tokens` more adds to a prefill that runs anyway (no fixed cost)."""
        return max(0, tokens) * self.recompute_ms_per_token

    def reused_ms(self, tokens: int) -> float:
        """What reusing `tokens` (cached or pulled) adds to a prefill that runs anyway."""
        return max(0, tokens) * self.reused_ms_per_token

    def reported_queue_ms(self, load: NodeLoad | None) -> float:
        """The prefill work a load report shows: each request's fixed cost and each token's.

        A request already running is, on average, half done when a report samples it.
        """
        if load is None:
            return 0.0
        requests = load.queued_requests + 0.5 * load.running_requests
        return requests * self.prefill_fixed_ms + self.recompute_ms(load.queued_prefill_tokens)

    def queue_ms(self, state: NodeState) -> float:
        """Expected wait on a prefill node: the router's current estimate, else its last report."""
        if state.queued_prefill_ms is not None:
            return state.queued_prefill_ms
        return self.reported_queue_ms(state.load)

    def observe(self, obs: TurnObservation) -> CostModel:
        """The model updated with one reported turn."""
        if not obs.success:
            return self
        model = self
        reused = max(0, obs.pulled_tokens) + max(0, obs.cached_tokens)
        # P computes at least the prompt's last token.
        computed = max(1, obs.prompt_tokens - reused)
        # prefill_ms is P's leg; without it, a recompute turn's TTFT bounds it from above.
        spent = obs.prefill_ms or (obs.ttft_ms if reused == 0 else 0.0)
        # A pulled turn's leg holds the pull too: the reported one, else the model's estimate.
        pull_ms = 0.0
        if obs.pulled_tokens > 0:
            pull_ms = obs.transfer_ms or self.transfer_ms(
                obs.pulled_tokens, obs.kv_bytes_per_token, first_contact=obs.first_contact
            )
        measured = obs.queued_measured and (obs.pulled_tokens <= 0 or obs.transfer_ms > 0)
        spent = self._compute_share(spent, obs.queued_ms + pull_ms, measured)
        if spent > 0 and obs.prompt_tokens > 0:
            fit = self.prefill_fit or self._prior_fit()
            counts = (float(computed), float(reused))
            fit = fit.update(counts, self._clamp(spent, fit.predict(counts)))
            fixed, per_token, per_reused = fit.coefficients
            # Attending over a reused token is a part of what computing it costs (see the
            # module's docstring).
            per_reused = min(per_reused, per_token * self.max_reused_share)
            model = replace(
                model,
                prefill_fit=fit,
                prefill_fixed_ms=fixed,
                recompute_ms_per_token=per_token,
                reused_ms_per_token=per_reused,
                prefill_samples=model.prefill_samples + 1,
            )
        if obs.pulled_tokens > 0 and obs.transfer_ms > 0:
            moved = self.bytes_for(obs.pulled_tokens, obs.kv_bytes_per_token)
            if obs.first_contact:
                # A first pull teaches the handshake: what it took beyond a warm pull.
                warm_ms = self.transfer_ms(obs.pulled_tokens, obs.kv_bytes_per_token)
                handshake = min(
                    max(obs.transfer_ms - warm_ms, 0.0), max(self.handshake_ms, 1.0) * self.max_sample_factor
                )
                return replace(
                    model,
                    handshake_ms=_ewma(model.handshake_ms, handshake, self.alpha),
                    handshake_samples=model.handshake_samples + 1,
                )
            pulls = self.transfer_fit or self._transfer_prior()
            size = (float(moved),)
            pulls = pulls.update(size, self._clamp(obs.transfer_ms, pulls.predict(size)))
            overhead, per_byte = pulls.coefficients
            model = replace(
                model,
                transfer_fit=pulls,
                transfer_overhead_ms=overhead,
                transfer_bytes_per_ms=1.0 / per_byte,
                transfer_samples=model.transfer_samples + 1,
            )
        return model

    def _compute_share(self, leg_ms: float, other_ms: float, measured: bool = False) -> float:
        """P's compute in a leg that also spent `other_ms` waiting behind earlier work and
        pulling (`measured`: as P measured both); 0: unknown.

        Learned from the whole leg, the waits of a busy P would read as compute: the
        per-token rate would grow with load, every queue estimate built on it would grow
        again, and recomputing would look dearer than it is; a pull's transfer would read
        as the cost of attending over the pulled tokens, and pulls would be charged their
        transfer twice. The wait and transfer are taken off; where either is an estimate, a
        leg that spent longer on them than on the rest teaches nothing, as the estimate's own
        error would then be most of the sample.
        """
        if other_ms <= 0:
            return leg_ms
        compute = leg_ms - other_ms
        if measured:
            return max(0.0, compute)
        return compute if compute >= other_ms else 0.0

    def _prior_fit(self) -> AffineFit:
        return AffineFit(
            prior=(self.prefill_fixed_ms, self.recompute_ms_per_token, self.reused_ms_per_token),
            scale=(_SCALE_TOKENS, _SCALE_TOKENS),
            floor=(0.0, max(_MIN_MS_PER_TOKEN, self.recompute_ms_per_token / self.max_sample_factor), 0.0),
            alpha=self.alpha,
            min_prior_weight=self.min_prior_weight,
        )

    def _transfer_prior(self) -> AffineFit:
        return AffineFit(
            prior=(self.transfer_overhead_ms, 1.0 / self.transfer_bytes_per_ms),
            scale=(_SCALE_BYTES,),
            floor=(0.0, _MIN_MS_PER_BYTE),
            alpha=self.alpha,
            min_prior_weight=self.min_prior_weight,
        )

    def _clamp(self, sample: float, current: float) -> float:
        return min(max(sample, current / self.max_sample_factor), current * self.max_sample_factor)


def _ewma(current: float, sample: float, alpha: float) -> float:
    return current + alpha * (sample - current)
