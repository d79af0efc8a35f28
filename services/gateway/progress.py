"""What a turn is and what it learns on the way, for the answer and for ReportTurn."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvplane.services.gateway.identity import Identity


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
    pulled_tokens: int = 0
    error: str = ""

    def retained_token_ids(self) -> list[int]:
        """D retains prompt + output - 1 tokens (the last output token has no KV yet)."""
        if not self.prompt_ids or not self.output_ids:
            return []
        return [*self.prompt_ids, *self.output_ids[:-1]]


def cached_tokens(answer: Mapping[str, Any]) -> int:
    """Prompt tokens P did not compute, from its usage (`prompt_tokens_details.cached_tokens`)."""
    usage = answer.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, Mapping) else None
    cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
    return cached if isinstance(cached, int) and not isinstance(cached, bool) else 0


def absorb(payload: dict[str, Any], progress: TurnProgress, keep_token_ids: bool) -> bool:
    """Takes D's handle and the token ids out of a chunk or answer; True if `payload` changed."""
    changed = False
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
        if isinstance(ids, list):
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
