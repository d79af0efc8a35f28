"""Pull the retained KV or recompute it: the rule, with a reason for every outcome.

What a pull must bring is what the prefill node lacks: the handle's tokens
that the prompt provably shares (all of them for a continuation, the
verified prefix otherwise), minus what P's own prefix cache is believed to
hold (`RouteSnapshot.prefill_cached_tokens`, a hint: vLLM uses P's cache
first and pulls only the rest, so a wrong hint costs time, never
correctness). Only a belief that is known (`prefill_cache_known`: P's KV
events, or reports that showed the router's record right) is taken off. A
guess would decline the pull of a history P may not hold, and P would then
recompute all of it (its prefix cache off, or a restart), where pulling what
P does hold costs only the transfer's overhead, as P loads only what it
lacks. Measured live with P's prefix cache off and 8 conversations in
flight: the first wave of second turns, routed before any report, recomputed
their 1.5k-token histories on the guess and were the slowest turns of their
block.

Checked in this order, so the reason names the first thing that rules a
pull out:

1. no handle                                   -> RECOMPUTE_NO_HANDLE
2. holder gone, restarted, draining, or no
   prefill node compatible with it             -> RECOMPUTE_HOLDER_DOWN
3. life left < margin + P's queueing + transfer -> RECOMPUTE_EXPIRING
   (vLLM's prefill engine itself declines a read 5 s before D's deadline,
   so the margin must cover at least that)
4. the prompt shares no verified prefix        -> RECOMPUTE_PREFIX_MISMATCH
5. missing tokens < threshold                  -> RECOMPUTE_BELOW_THRESHOLD
6. transfer not well under the compute it saves -> RECOMPUTE_COST
7. otherwise                                   -> PULL (a continuation), or
                                                  PULL_PREFIX (a verified prefix
                                                  of a prompt that diverges)

For a prompt that does not continue the handle, 5 and 6 answer
RECOMPUTE_PREFIX_MISMATCH: the prefix it shares does not pay for a pull.

The compute a pull saves is the missing tokens' marginal cost
(`CostModel.recompute_ms`) less what attending over them still costs once
pulled (`CostModel.reused_ms`). The prefill's fixed cost is paid either way,
so it is on neither side. Check 6 weighs a warm transfer: the first pull between
two engines also pays NIXL's handshake, once for as long as both run, which
lengthens the verdict's `transfer_ms` (what the turn is expected to take) but
does not decline the pull.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvplane.services.common.model.nodes import Node
from kvplane.services.routing.policy.cost_model import CostModel
from kvplane.services.routing.policy.decision import Decision, PullVerdict
from kvplane.services.routing.policy.prefix_match import PrefixMatch, match_prefix
from kvplane.services.routing.policy.snapshot import NodeState, RouteSnapshot


@dataclass(frozen=True, slots=True)
class PullSettings:
    # vLLM's kv_recompute_threshold: fewer missing tokens are recomputed by P anyway.
    threshold_tokens: int = 64
    # Life a handle must keep beyond P's queueing and the transfer, in ms.
    # vLLM's P declines a read 5 s before D's deadline.
    expiry_margin_ms: int = 5_000
    # Pull only if the transfer takes at most this share of the compute it saves. Both sides
    # are modelled (the pulled tokens' own share of P's compute included), so 1 is break-even;
    # less keeps a margin for estimates the reports have not corrected yet.
    max_transfer_fraction: float = 1.0
    # And only if it saves at least this much (ms) beyond its estimated transfer. The estimate is
    # the fitted mean of P's measured pulls; one pull's READ waits on the holder's NIXL progress
    # and the verify, and measured at 32 conversations in flight on the sim-engine, P's pulls took
    # 6 ms at the median and up to 17. A pull also has D keep its blocks until P reads them and
    # costs a check-out in etcd. Without the margin, pulls of a turn's last answer (about 140
    # tokens) that P's cache lacked were judged to save 1-3 ms, and were among the slowest turns.
    min_saving_ms: float = 10.0
    # Recompute when the handle has no digests (the prefill connector would refuse).
    require_digests: bool = True
    # Pull the verified prefix of a prompt that diverges from the handle (clipped pulls).
    pull_prefixes: bool = True

    def __post_init__(self) -> None:
        if self.threshold_tokens < 0 or self.expiry_margin_ms < 0:
            raise ValueError("threshold_tokens and expiry_margin_ms must not be negative")
        if not 0 < self.max_transfer_fraction <= 1:
            raise ValueError("max_transfer_fraction must be in (0, 1]")
        if self.min_saving_ms < 0:
            raise ValueError("min_saving_ms must not be negative")


def decide_pull(
    snapshot: RouteSnapshot,
    holder: Node | None,
    prefill: NodeState,
    compatible: bool,
    costs: CostModel,
    settings: PullSettings,
    match: PrefixMatch | None = None,
) -> PullVerdict:
    """The verdict for pulling `snapshot.handle` from `holder` into `prefill`.

    `holder` is the handle's holder if it is registered with the handle's
    incarnation and not draining; `compatible` says whether `prefill` shares
    its fingerprint. `match` is the prompt matched against the handle, when
    the caller has it already (it hashes the prompt: once per route).
    """
    handle = snapshot.handle
    cached = cached_tokens(snapshot, prefill)
    # A guess of what P holds does not decline a pull (see the module's docstring).
    known = cached if prefill.node.node_id in snapshot.prefill_cache_known else 0
    ruled_out = _no_source(snapshot, holder, compatible, cached)
    if ruled_out is not None:
        return ruled_out
    assert handle is not None and holder is not None  # _no_source answers without either
    life_left = handle.life_left_ms(snapshot.now_unix_ms)
    if match is None:
        match = match_prefix(handle, snapshot.prompt, require_digests=settings.require_digests)
    # A clipped pull cuts every KV-cache group at one index, which only a single
    # full-attention group allows (the prefill connector drops it otherwise).
    clippable = settings.pull_prefixes and len(handle.vllm.remote_block_ids) == 1
    reusable = match.reusable_tokens if match.continues or clippable else 0
    # vLLM pulls only what P's prefix cache lacks.
    missing = max(0, reusable - known)
    first_contact = (prefill.node.node_id, handle.vllm.remote_engine_id) not in snapshot.contacted
    transfer = costs.transfer_ms(
        missing or reusable or handle.num_tokens, holder.kv_bytes_per_token, first_contact=first_contact
    )
    queue = costs.queue_ms(prefill)
    needed = settings.expiry_margin_ms + queue + transfer
    if life_left < needed:
        return PullVerdict(
            Decision.RECOMPUTE_EXPIRING,
            f"{life_left} ms of life left, {needed:.0f} ms needed (margin, P queueing, transfer)",
            transfer_ms=transfer,
            life_left_ms=life_left,
            cached_tokens=cached,
        )
    if reusable <= 0:
        return PullVerdict(
            Decision.RECOMPUTE_PREFIX_MISMATCH, match.why, life_left_ms=life_left, cached_tokens=cached
        )
    return _pull_or_cost(match, reusable, missing, cached, life_left, holder, first_contact, costs, settings)


def _no_source(
    snapshot: RouteSnapshot, holder: Node | None, compatible: bool, cached: int
) -> PullVerdict | None:
    """Checks 1 and 2, and a handle made for another model: the verdict when there is nothing to
    pull from; None when the handle's holder can serve a pull."""
    handle = snapshot.handle
    if handle is None:
        return PullVerdict(Decision.RECOMPUTE_NO_HANDLE, "no retained handle", cached_tokens=cached)
    life_left = handle.life_left_ms(snapshot.now_unix_ms)
    if holder is None:
        return PullVerdict(
            Decision.RECOMPUTE_HOLDER_DOWN,
            f"holder {handle.holder_node_id} is gone, restarted or draining",
            life_left_ms=life_left,
            cached_tokens=cached,
        )
    if not compatible:
        return PullVerdict(
            Decision.RECOMPUTE_HOLDER_DOWN,
            f"no prefill node shares holder {holder.node_id}'s compatibility fingerprint",
            life_left_ms=life_left,
            cached_tokens=cached,
        )
    if handle.model and handle.model != snapshot.model:
        return PullVerdict(
            Decision.RECOMPUTE_PREFIX_MISMATCH,
            f"handle is for model {handle.model!r}",
            life_left_ms=life_left,
            cached_tokens=cached,
        )
    return None


def _pull_or_cost(
    match: PrefixMatch,
    reusable: int,
    missing: int,
    cached: int,
    life_left: int,
    holder: Node,
    first_contact: bool,
    costs: CostModel,
    settings: PullSettings,
) -> PullVerdict:
    """Checks 5 to 7, for a handle whose reusable tokens outlive the transfer: enough missing
    tokens, and a transfer well under the compute it saves, make a pull."""
    # A prompt that diverges recomputes for its prefix's sake; say so whatever the detail.
    declined = Decision.RECOMPUTE_PREFIX_MISMATCH if not match.continues else None
    held = f"; P holds {cached}" if cached else ""
    if missing < settings.threshold_tokens:
        return PullVerdict(
            declined or Decision.RECOMPUTE_BELOW_THRESHOLD,
            f"{missing} of {reusable} reusable tokens missing on P{held}: < threshold"
            f" {settings.threshold_tokens} ({match.why})",
            reusable_tokens=reusable,
            life_left_ms=life_left,
            cached_tokens=cached,
        )
    recompute = costs.recompute_ms(missing)
    saved = recompute - costs.reused_ms(missing)
    transfer = costs.transfer_ms(missing, holder.kv_bytes_per_token, first_contact=first_contact)
    # The NIXL handshake is paid once per pair of engines, for as long as both run: it lengthens
    # this turn's estimate, but a pull declined for it leaves the pair cold, and every turn after
    # it judged the same way. In a wave of turns (chats that advance in step) that is every turn
    # routed before the first pull: each recomputes its history on P, and P's queue grows by all
    # of them. So the choice weighs a warm transfer against the compute saved.
    warm = transfer - costs.handshake_ms if first_contact else transfer
    if not _transfer_pays(warm, saved, settings):
        return PullVerdict(
            declined or Decision.RECOMPUTE_COST,
            f"{missing} missing tokens{held}: transfer {transfer:.1f} ms vs {saved:.1f} ms of compute saved"
            f" ({match.why})",
            reusable_tokens=reusable,
            transfer_ms=transfer,
            recompute_ms=recompute,
            life_left_ms=life_left,
            cached_tokens=cached,
        )
    return PullVerdict(
        Decision.PULL if match.continues else Decision.PULL_PREFIX,
        f"pull {missing} tokens{held}: transfer {transfer:.1f} ms vs {saved:.1f} ms of compute saved"
        f" ({match.why})",
        reusable_tokens=reusable,
        transfer_ms=transfer,
        recompute_ms=recompute,
        life_left_ms=life_left,
        cached_tokens=cached,
    )


def pull_could_pay(
    missing_tokens: int, kv_bytes_per_token: int, costs: CostModel, settings: PullSettings
) -> bool:
    """Whether pulling `missing_tokens` that P lacks could beat recomputing them (rules 5 and 6).

    For a caller that must decide before the handle is known (whether to wait for
    its publish): a warm pull, with the bytes per token the holder is expected to have.
    """
    if missing_tokens < settings.threshold_tokens:
        return False
    saved = costs.recompute_ms(missing_tokens) - costs.reused_ms(missing_tokens)
    return _transfer_pays(costs.transfer_ms(missing_tokens, kv_bytes_per_token), saved, settings)


def _transfer_pays(transfer_ms: float, saved_ms: float, settings: PullSettings) -> bool:
    return (
        transfer_ms <= settings.max_transfer_fraction * saved_ms
        and saved_ms - transfer_ms >= settings.min_saving_ms
    )


def cached_tokens(snapshot: RouteSnapshot, prefill: NodeState) -> int:
    """Prompt tokens `prefill`'s prefix cache is believed to hold (P computes the last one itself)."""
    held = snapshot.prefill_cached_tokens.get(prefill.node.node_id, 0)
    return max(0, min(held, snapshot.prompt.tokens - 1))
