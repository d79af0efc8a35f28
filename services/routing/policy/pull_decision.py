"""Pull the retained KV or recompute it: the rule, with a reason for every outcome.

Checked in this order, so the reason names the first thing that rules a
pull out:

1. no handle                                   -> RECOMPUTE_NO_HANDLE
2. holder gone, restarted, draining, or no
   prefill node compatible with it             -> RECOMPUTE_HOLDER_DOWN
3. life left < margin + P's queueing + transfer -> RECOMPUTE_EXPIRING
   (vLLM's prefill engine itself declines a read 5 s before D's deadline,
   so the margin must cover at least that)
4. the prompt does not continue the handle     -> RECOMPUTE_PREFIX_MISMATCH
5. reusable tokens < threshold                 -> RECOMPUTE_BELOW_THRESHOLD
6. transfer not well under recompute           -> RECOMPUTE_COST
7. otherwise                                   -> PULL
"""

from __future__ import annotations

from dataclasses import dataclass

from kvplane.services.common.nodes import Node
from kvplane.services.routing.policy.cost_model import CostModel
from kvplane.services.routing.policy.decision import Decision, PullVerdict
from kvplane.services.routing.policy.prefix_match import match_prefix
from kvplane.services.routing.policy.snapshot import NodeState, RouteSnapshot


@dataclass(frozen=True, slots=True)
class PullSettings:
    # vLLM's kv_recompute_threshold: fewer missing tokens are recomputed by P anyway.
    threshold_tokens: int = 64
    # Life a handle must keep beyond P's queueing and the transfer, in ms.
    # vLLM's P declines a read 5 s before D's deadline.
    expiry_margin_ms: int = 5_000
    # Pull only if the transfer takes at most this share of the recompute it saves.
    max_transfer_fraction: float = 0.5
    # Recompute when the handle has no digests (the prefill connector would refuse).
    require_digests: bool = True

    def __post_init__(self) -> None:
        if self.threshold_tokens < 0 or self.expiry_margin_ms < 0:
            raise ValueError("threshold_tokens and expiry_margin_ms must not be negative")
        if not 0 < self.max_transfer_fraction <= 1:
            raise ValueError("max_transfer_fraction must be in (0, 1]")


def decide_pull(
    snapshot: RouteSnapshot,
    holder: Node | None,
    prefill: NodeState,
    compatible: bool,
    costs: CostModel,
    settings: PullSettings,
) -> PullVerdict:
    """The verdict for pulling `snapshot.handle` from `holder` into `prefill`.

    `holder` is the handle's holder if it is registered with the handle's
    incarnation and not draining; `compatible` says whether `prefill` shares
    its fingerprint.
    """
    handle = snapshot.handle
    if handle is None:
        return PullVerdict(Decision.RECOMPUTE_NO_HANDLE, "no retained handle")
    life_left = handle.life_left_ms(snapshot.now_unix_ms)
    if holder is None:
        return PullVerdict(
            Decision.RECOMPUTE_HOLDER_DOWN,
            f"holder {handle.holder_node_id} is gone, restarted or draining",
            life_left_ms=life_left,
        )
    if not compatible:
        return PullVerdict(
            Decision.RECOMPUTE_HOLDER_DOWN,
            f"no prefill node shares holder {holder.node_id}'s compatibility fingerprint",
            life_left_ms=life_left,
        )
    if handle.model and handle.model != snapshot.model:
        return PullVerdict(
            Decision.RECOMPUTE_PREFIX_MISMATCH,
            f"handle is for model {handle.model!r}",
            life_left_ms=life_left,
        )
    match = match_prefix(handle, snapshot.prompt, require_digests=settings.require_digests)
    reusable = match.reusable_tokens if match.continues else 0
    first_contact = (prefill.node.node_id, handle.vllm.remote_engine_id) not in snapshot.contacted
    transfer = costs.transfer_ms(
        reusable or handle.num_tokens, holder.kv_bytes_per_token, first_contact=first_contact
    )
    queue = costs.queue_ms(prefill.load.queued_prefill_tokens if prefill.load else 0)
    needed = settings.expiry_margin_ms + queue + transfer
    if life_left < needed:
        return PullVerdict(
            Decision.RECOMPUTE_EXPIRING,
            f"{life_left} ms of life left, {needed:.0f} ms needed (margin, P queueing, transfer)",
            transfer_ms=transfer,
            life_left_ms=life_left,
        )
    if not match.continues:
        return PullVerdict(Decision.RECOMPUTE_PREFIX_MISMATCH, match.why, life_left_ms=life_left)
    if reusable < settings.threshold_tokens:
        return PullVerdict(
            Decision.RECOMPUTE_BELOW_THRESHOLD,
            f"{reusable} reusable tokens < threshold {settings.threshold_tokens}",
            reusable_tokens=reusable,
            life_left_ms=life_left,
        )
    recompute = costs.recompute_ms(reusable)
    if transfer > settings.max_transfer_fraction * recompute:
        return PullVerdict(
            Decision.RECOMPUTE_COST,
            f"transfer {transfer:.1f} ms vs recompute {recompute:.1f} ms",
            reusable_tokens=reusable,
            transfer_ms=transfer,
            recompute_ms=recompute,
            life_left_ms=life_left,
        )
    return PullVerdict(
        Decision.PULL,
        f"pull {reusable} tokens: transfer {transfer:.1f} ms vs recompute {recompute:.1f} ms ({match.why})",
        reusable_tokens=reusable,
        transfer_ms=transfer,
        recompute_ms=recompute,
        life_left_ms=life_left,
    )
