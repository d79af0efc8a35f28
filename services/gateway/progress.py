"""What a turn is and what it learns on the way, for the answer and for ReportTurn."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvplane.services.common.model.handles import KEY_DIGESTS, KEY_PULL_MS, KEY_PULLED_TOKENS, KEY_QUEUED_MS
from kvplane.services.gateway.identity import Identity

# A pull or a wait P says took longer is not a measurement (an hour, in ms).
_MAX_P_MS = 3_600_000.0


@dataclass(frozen=True, slots=True)
class TurnRequest:
    identity: Identity
    # The client's body, with its conversation_id and kv_transfer_params removed.
    body: dict[str, Any]
    chat: bool
    stream: bool
    model: str
    # The client asked for token ids itself: leave them in what it sees.
    client_token_ids: bool
    # When the request arrived (time.perf_counter()).
    arrival: float


@dataclass
class TurnProgress:
    """What a turn has learned so far, for ReportTurn."""

    decision: str
    prompt_ids: list[int] | None = None
    output_ids: list[int] = field(default_factory=list)
    decode_params: dict[str, Any] | None = None
    ttft_s: float | None = None
    prefill_s: float = 0.0
    # Where P got the prompt's KV, as P reported it (None until P has answered).
    sources: PromptSources | None = None
    # What P returned: its blocks held for D's read, released at once if the turn fails.
    prefill_params: dict[str, Any] | None = None
    error: str = ""

    @property
    def pulled_tokens(self) -> int:
        """Prompt tokens P read from the holder over NIXL (0 when P did not say)."""
        return self.sources.pulled if self.sources is not None and self.sources.pulled is not None else 0

    @property
    def pull_ms(self) -> float:
        """How long P's pull took, as P measured it (0 when it did not say)."""
        took = self.sources.pull_ms if self.sources is not None else None
        return took if took is not None else 0.0

    @property
    def queued_ms(self) -> float | None:
        """How long the prompt waited on P before P computed it, its pull left out, as P measured
        it (None when it did not say)."""
        return self.sources.queued_ms if self.sources is not None else None

    @property
    def cached_tokens(self) -> int | None:
        """Prompt tokens P found in its own prefix cache (None when P did not say)."""
        if self.sources is None or not self.sources.cache_reported:
            return None
        return self.sources.prefill_cache

    def retained_token_ids(self) -> list[int]:
        """D retains prompt + output - 1 tokens (the last output token has no KV yet)."""
        if not self.prompt_ids or not self.output_ids:
            return []
        return [*self.prompt_ids, *self.output_ids[:-1]]

    def retained_ids_for_routing(self, success: bool) -> list[int]:
        """The retained token ids ReportTurn carries: routing digests them only for a handle
        whose params bring no digests of their own (D without kvplane's connector) and ignores
        them otherwise, and a long conversation's ids cost more to send than the rest of the report."""
        params = self.decode_params
        digests = params.get(KEY_DIGESTS) if params else None
        if not success or not params or (isinstance(digests, str) and digests):
            return []
        return self.retained_token_ids()


@dataclass(frozen=True, slots=True)
class PromptSources:
    """Where P got each prompt token's KV: pulled + prefill_cache + computed = prompt.

    `pulled` is None when P did not report its pull (an engine without kvplane's connector): its
    cached tokens are then `unattributed`, neither pulled nor P's own cache for certain.
    """

    prompt: int
    pulled: int | None
    prefill_cache: int
    computed: int
    # P's usage said how many prompt tokens it did not compute (`prompt_tokens_details`).
    cache_reported: bool = True
    # How long P's pull took, as P measured it (ms); None where it did not say.
    pull_ms: float | None = None
    # How long the prompt waited on P for its compute besides, as P measured it (ms); None where
    # it did not say.
    queued_ms: float | None = None

    @property
    def unattributed(self) -> int:
        return self.prompt - self.computed - self.prefill_cache - (self.pulled or 0)

    def counts(self) -> dict[str, int]:
        """Tokens by source, for metrics and spans."""
        out = {"prefill_cache": self.prefill_cache, "computed": self.computed}
        if self.pulled is None:
            out["unattributed"] = self.unattributed
        else:
            out["pulled"] = self.pulled
        return out

    def span_attributes(self) -> dict[str, int]:
        """`kvplane.tokens.{prompt,pulled,prefill_cache,computed}` (or `.unattributed`) for a span."""
        return {"kvplane.tokens.prompt": self.prompt} | {
            f"kvplane.tokens.{source}": tokens for source, tokens in self.counts().items()
        }


def prompt_sources(answer: Mapping[str, Any]) -> PromptSources:
    """P's answer read as a PromptSources: its usage, and the pull it reports in kv_transfer_params."""
    usage = answer.get("usage")
    prompt = _int(usage.get("prompt_tokens")) if isinstance(usage, Mapping) else 0
    cached = min(cached_tokens(answer), prompt)
    details = usage.get("prompt_tokens_details") if isinstance(usage, Mapping) else None
    said = isinstance(details, Mapping) and _is_count(details.get("cached_tokens"))
    params = answer.get("kv_transfer_params")
    reported = params.get(KEY_PULLED_TOKENS) if isinstance(params, Mapping) else None
    queued_ms = _duration(params.get(KEY_QUEUED_MS)) if isinstance(params, Mapping) else None
    if reported is None or isinstance(reported, bool) or not isinstance(reported, int):
        return PromptSources(prompt, None, 0, prompt - cached, cache_reported=False, queued_ms=queued_ms)
    pulled = max(0, min(reported, cached))
    pull_ms = _duration(params.get(KEY_PULL_MS)) if pulled and isinstance(params, Mapping) else None
    return PromptSources(
        prompt,
        pulled,
        cached - pulled,
        prompt - cached,
        cache_reported=said,
        pull_ms=pull_ms,
        queued_ms=queued_ms,
    )


def _duration(value: Any) -> float | None:
    """A duration in ms as P reported it, or None when it is not one (negative, or an hour or more)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < _MAX_P_MS:
        return None
    return float(value)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def cached_tokens(answer: Mapping[str, Any]) -> int:
    """Prompt tokens P did not compute, from its usage (`prompt_tokens_details.cached_tokens`)."""
    usage = answer.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, Mapping) else None
    cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
    return cached if isinstance(cached, int) and not isinstance(cached, bool) else 0


def _correct_usage(payload: dict[str, Any], progress: TurnProgress) -> bool:
    """D's usage says P's work: D computes no prompt token (its KV all came from P), so its own
    `cached_tokens` is the whole prompt; the client is told what P did not compute (its cache
    hits and what it pulled). True if `payload` changed; unchanged when P did not say."""
    usage = payload.get("usage")
    sources = progress.sources
    if not isinstance(usage, dict) or sources is None or not sources.cache_reported:
        return False
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict) or "cached_tokens" not in details:
        return False
    details["cached_tokens"] = sources.prompt - sources.computed
    return True


def absorb(
    payload: dict[str, Any], progress: TurnProgress, keep_token_ids: bool, *, collect_output_ids: bool = True
) -> bool:
    """Takes D's handle and the token ids out of a chunk or answer; True if `payload` changed.

    `collect_output_ids` False: the output's ids are not kept for the report (some events' alone
    would describe tokens D does not retain)."""
    changed = _correct_usage(payload, progress)
    if "kv_transfer_params" in payload:
        params = payload.pop("kv_transfer_params")
        if isinstance(params, dict) and params:
            progress.decode_params = params
        changed = True
    prompt_ids = payload.get("prompt_token_ids")
    if isinstance(prompt_ids, list):
        progress.prompt_ids = prompt_ids
        if not keep_token_ids:
            del payload["prompt_token_ids"]
            changed = True
    choices = payload.get("choices")
    for choice in choices if isinstance(choices, list) else ():
        if not isinstance(choice, dict):
            continue
        ids = choice.get("token_ids")
        if collect_output_ids and isinstance(ids, list):
            progress.output_ids.extend(ids)
        prompt_ids = choice.get("prompt_token_ids")
        if isinstance(prompt_ids, list):
            progress.prompt_ids = prompt_ids
        if not keep_token_ids:
            for key in ("token_ids", "prompt_token_ids"):
                if key in choice:
                    del choice[key]
                    changed = True
    return changed
