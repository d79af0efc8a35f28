"""Prefill on decode: the holder D computes a short turn itself, with no P leg.

D keeps each conversation's KV after a turn (the handle); its blocks sit in D's own prefix
cache. A later turn that continues them and adds few tokens can be prefilled on D itself: D's
cache covers the history, D computes the rest, and the turn skips P's queue, P's compute and the
P-to-D hand-off of the whole prompt's KV. Dynamo's conditional disaggregation makes the same call
(there, from the decode worker's prefix cache, up to `--max-local-prefill-length` 1,000 tokens).

The cost: D's running decodes wait while D prefills (vLLM mixes a prefill's chunks into the
decode batch), so the new tokens are capped (`max_new_tokens`), and the turn goes to D only when
its estimated time there (the prefills waiting on D, then its own) is at most its time through
the chosen P: P's queue, pull and prefill, then the hand-off to D and D's step that computes the
first token over the whole prompt. The cost model prices that step as a one-token prefill, its
fixed cost included; where D folds it into a decode step it costs less, and the rule leans
towards D by the difference.

And only where the time it saves is worth what it costs the others (`running_delay_weight`):
every request running on D waits out the step that carries the prefill, so the turn's saving
(its time through P less its time on D) must be at least the prefill's time on D for each of
them. On a D that streams nothing that costs nothing; on a D that streams four answers, a
900-token prefill that saves the turn the 25 ms of a hand-off would hold up the four answers by
well over 100 ms each, and the turn goes through P. Without this rule, prefilling on D measured
live (2 P + 2 D, P's caches off, 32 conversations in flight) gave the lowest TTFT of every front
and a TPOT p50 a quarter above the router's (`docs/benchmarks.md`).

Only where it saves the fleet enough (`min_history_per_new_token`): through P, the turn would pull
or recompute the part of D's history that the chosen P's prefix cache lacks, and D must save at
least that many tokens of history per new token it computes itself (default 1). The cost model
prices the turn's own first token, not what D's prefill costs the others on D: the legs bound for
it through P wait behind that prefill, and so do its decodes. Where P's cache holds the history
but for the last answer, D saves little more than the hand-off; measured live that way (2 P + 2
D, P's caches holding the histories, 32 conversations in flight, each turn adding 898 tokens to a
history of which P lacked the 128-token answer), prefilling on D gave TTFT p99 1.38x the zero-hop
client's against 1.02x through P (`docs/benchmarks.md`). Where P's cache lacks the history (P's
cache off, or evicted), D saves the pull or the recompute as well; measured that way with P's
caches off, prefilling on D had the lowest TTFT p50 and p99 of every front at 1, 8 and 32
conversations in flight.

A D that runs and queues nothing holds nobody up: there the rule is waived
(`idle_decode_skips_history_rule`), and the turn goes to D wherever the cost model finds it no
slower, since it saves P's leg and the hand-off at no one's expense. D's load is the latest it
reported plus the turns routed to it since (`NodeState`); a D whose load is unknown is not idle.

Only for callers that said they can run a turn on D alone (`RouteSnapshot.prefill_on_decode_ok`).
D's history is then either the handle, on its live holder where the decode leg chose it and for a
prompt that continues the whole handle, or what D's own prefix cache holds as its engine's
KV-cache events show it (`RouteSnapshot.decode_cached_tokens`, `from_decode_cache`). A handle
released under memory pressure leaves its blocks in D's prefix cache until D reuses the memory,
as vLLM frees them; and a conversation that moved to another D (or never had a handle) may still
share a prefix there. A prefill on D reads nothing remote, so a view that is wrong costs time (D
computes what its cache lacks), never correctness. Anything else is routed through P as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from kvplane.services.common.model.nodes import Node
from kvplane.services.routing.policy.cost_model import CostModel
from kvplane.services.routing.policy.decision import Decision, PullVerdict
from kvplane.services.routing.policy.prefix_match import PrefixMatch
from kvplane.services.routing.policy.snapshot import NodeState, RouteSnapshot

# Tokens of output a decode node must have room for beyond the prompt's new tokens, as the
# decode leg's `holder-affinity` scorer asks of the holder.
_OUTPUT_RESERVE_TOKENS = 1024


@dataclass(frozen=True, slots=True)
class PrefillOnDecodeSettings:
    # The most prompt tokens D may compute for a turn it prefills itself; 0: never.
    max_new_tokens: int = 1000
    # Life the handle must have left: D's prefix cache finds its blocks only while they are held
    # (afterwards they may be evicted, and D computes them: slower, never wrong).
    expiry_margin_ms: int = 5_000
    # Tokens of history the chosen P's prefix cache must lack (that the turn through P would
    # pull or recompute) per new token D computes itself; 0: wherever the cost model finds D
    # no slower (see the module's docstring).
    min_history_per_new_token: float = 1.0
    # D's own prefix cache, as its engine's KV-cache events show it, also counts as history D
    # holds (the handle's holder or not); False: only a handle D holds does.
    from_decode_cache: bool = True
    # On a D with nothing running or queued, `min_history_per_new_token` does not apply: its
    # prefill holds up no other request there (see the module's docstring).
    idle_decode_skips_history_rule: bool = True
    # What a millisecond that each request running on D waits for the turn's prefill weighs
    # against a millisecond the turn itself saves: the turn goes to D only when the time it saves
    # is at least this times the delay it adds to the answers streaming from D. 0: their delay
    # is not weighed (see the module's docstring).
    running_delay_weight: float = 1.0

    def __post_init__(self) -> None:
        if (
            self.max_new_tokens < 0
            or self.expiry_margin_ms < 0
            or self.min_history_per_new_token < 0
            or self.running_delay_weight < 0
        ):
            raise ValueError(
                "max_new_tokens, expiry_margin_ms, min_history_per_new_token and running_delay_weight"
                " must not be negative"
            )
        for name in ("from_decode_cache", "idle_decode_skips_history_rule"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false")


def decode_idle(decode: NodeState) -> bool:
    """Whether the decode node runs and queues no request, as far as its load is known."""
    load = decode.load
    return load is not None and load.running_requests == 0 and load.queued_requests == 0


def handle_could_serve_on_decode(
    handle_tokens: int,
    prompt_tokens: int,
    prefill_held_tokens: int,
    decodes: Callable[[], Iterable[NodeState]],
    settings: PrefillOnDecodeSettings,
) -> bool:
    """Whether a handle of `handle_tokens` of the prompt, not yet seen, could let its holder D
    prefill the turn itself, by the rules on the new tokens and on the history D spares P
    (`_token_rules_allow`, without the cost model): for a caller that must decide before the
    handle is known whether to wait for its publish. A decode node counts as idle when any is:
    the holder is not known before the handle is. `decodes()` gives the decode nodes with their
    loads; it is called only where the idle waiver decides."""
    return _token_rules_allow(
        handle_tokens,
        prompt_tokens,
        prefill_held_tokens,
        lambda: any(decode_idle(d) for d in decodes()),
        settings,
    )


def _token_rules_allow(
    held: int,
    prompt_tokens: int,
    prefill_held_tokens: int,
    idle: Callable[[], bool],
    settings: PrefillOnDecodeSettings,
) -> bool:
    """Whether D, holding `held` tokens of the prompt, may prefill the rest itself by the rules
    on tokens alone: at most `max_new_tokens` new ones, and D's history sparing P enough of
    what it lacks per new token, unless D is idle (`idle()`, asked only then) and
    `idle_decode_skips_history_rule` waives that."""
    new = prompt_tokens - held
    if settings.max_new_tokens <= 0 or new <= 0 or new > settings.max_new_tokens:
        return False
    if held - prefill_held_tokens >= settings.min_history_per_new_token * new:
        return True
    return settings.idle_decode_skips_history_rule and idle()


def decode_queue_ms(decode: NodeState, costs: CostModel) -> float:
    """The prefill work queued on a decode node ahead of a turn it would prefill: the requests
    waiting there (reported, plus the local prefills routed to it since) at their prefill cost.
    Its running decodes are not ahead of it: a prefill joins their batch."""
    load = decode.load
    if load is None:
        return 0.0
    return load.queued_requests * costs.prefill_fixed_ms + costs.recompute_ms(load.queued_prefill_tokens)


def decide_prefill_on_decode(
    snapshot: RouteSnapshot,
    holder: Node | None,
    decode: NodeState,
    prefix: PrefixMatch | None,
    through_prefill_ms: float,
    prefill_cached_tokens: int,
    costs: CostModel,
    settings: PrefillOnDecodeSettings,
) -> PullVerdict | None:
    """PREFILL_ON_DECODE when the chosen D holds the handle and prefilling there is no slower
    than `through_prefill_ms` (the turn's estimate through the chosen P, queue to first
    compute, without the hand-off or D's first step), and the chosen P's cache, believed to hold
    `prefill_cached_tokens` of the prompt, lacks enough of the history D holds (see
    `PrefillOnDecodeSettings.min_history_per_new_token`); None: route through P."""
    handle = snapshot.handle
    if (
        not snapshot.prefill_on_decode_ok
        or handle is None
        or holder is None
        or prefix is None
        or not prefix.continues
        or decode.node.node_id != holder.node_id
    ):
        return None
    life_left = handle.life_left_ms(snapshot.now_unix_ms)
    if life_left < settings.expiry_margin_ms:
        return None
    held = prefix.reusable_tokens
    verdict = _local_verdict(
        snapshot, decode, held, through_prefill_ms, prefill_cached_tokens, costs, settings
    )
    if verdict is None:
        return None
    local_ms, routed_ms = verdict
    return PullVerdict(
        Decision.PREFILL_ON_DECODE,
        f"{holder.node_id} holds {held} tokens and prefills the"
        f" {snapshot.prompt.tokens - held} new ones itself:"
        f" {local_ms:.1f} ms against {routed_ms:.1f} ms through P and the hand-off",
        reusable_tokens=held,
        recompute_ms=costs.recompute_ms(snapshot.prompt.tokens - held),
        life_left_ms=life_left,
    )


def decide_from_decode_cache(
    snapshot: RouteSnapshot,
    decodes: list[NodeState],
    through_prefill_ms: float,
    prefill_cached_tokens: int,
    costs: CostModel,
    settings: PrefillOnDecodeSettings,
) -> tuple[NodeState, PullVerdict] | None:
    """The decode node, among `decodes` (eligible for the turn, best first), whose own prefix
    cache holds the most of the prompt as its KV-cache events show it, and PREFILL_ON_DECODE
    there when prefilling on it passes the rules `decide_prefill_on_decode` applies to a handle;
    None: route as before."""
    if not snapshot.prefill_on_decode_ok or not settings.from_decode_cache:
        return None
    cached = snapshot.decode_cached_tokens
    if not cached:
        return None
    best: NodeState | None = None
    best_held = 0
    for state in decodes:
        held = min(cached.get(state.node.node_id, 0), snapshot.prompt.tokens - 1)
        # A D without room for the turn would make it wait for memory.
        if held > best_held and state.fits(snapshot.prompt.tokens - held + _OUTPUT_RESERVE_TOKENS):
            best, best_held = state, held
    if best is None:
        return None
    verdict = _local_verdict(
        snapshot, best, best_held, through_prefill_ms, prefill_cached_tokens, costs, settings
    )
    if verdict is None:
        return None
    local_ms, routed_ms = verdict
    new = snapshot.prompt.tokens - best_held
    return best, PullVerdict(
        Decision.PREFILL_ON_DECODE,
        f"{best.node.node_id}'s prefix cache holds {best_held} tokens (its KV events) and it"
        f" prefills the {new} new ones itself: {local_ms:.1f} ms against {routed_ms:.1f} ms"
        " through P and the hand-off",
        reusable_tokens=best_held,
        recompute_ms=costs.recompute_ms(new),
    )


def _local_verdict(
    snapshot: RouteSnapshot,
    decode: NodeState,
    held: int,
    through_prefill_ms: float,
    prefill_cached_tokens: int,
    costs: CostModel,
    settings: PrefillOnDecodeSettings,
) -> tuple[float, float] | None:
    """(ms on D, ms through P) when D, holding `held` tokens of the prompt, should prefill the
    rest itself; None when the new tokens are too many, D's history spares P too little (on a
    D that is not idle, or always without `idle_decode_skips_history_rule`), or D would be
    slower."""
    if not _token_rules_allow(
        held, snapshot.prompt.tokens, prefill_cached_tokens, lambda: decode_idle(decode), settings
    ):
        return None
    new = snapshot.prompt.tokens - held
    prefill_ms = costs.prefill_ms(new, held)
    local_ms = decode_queue_ms(decode, costs) + prefill_ms
    # Through P, D then reads the whole prompt's KV from P, and computes the first token in a step
    # of its own (one token over the whole prompt).
    handoff_ms = costs.transfer_ms(snapshot.prompt.tokens, decode.node.kv_bytes_per_token)
    first_step_ms = costs.prefill_ms(1, snapshot.prompt.tokens - 1)
    routed_ms = through_prefill_ms + handoff_ms + first_step_ms
    if local_ms > routed_ms:
        return None
    if routed_ms - local_ms < settings.running_delay_weight * running_delay_ms(decode, prefill_ms):
        return None
    return local_ms, routed_ms


def running_delay_ms(decode: NodeState, prefill_ms: float) -> float:
    """What a prefill of `prefill_ms` on a decode node adds, summed, to the answers running there:
    the step that carries it lasts that much longer, for each of them. A node whose load is
    unknown counts as running nothing (the history rule still holds there: it is not idle)."""
    load = decode.load
    return (load.running_requests if load is not None else 0) * prefill_ms
