"""What the sidecar's P leg did, told to the picker in a response header, for ReportTurn.

The picker (`epp/response_phase.py`) reads it into the turn's progress exactly as the gateway's
own P leg records it (`prefill_leg.PrefillLeg.once`): where P got the prompt's KV, P's returned
params, the leg's time, and the decision when the P leg failed and D recomputed.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import orjson

from kvplane.services.gateway.progress import TurnProgress, prompt_sources


@dataclass(frozen=True, slots=True)
class PrefillReport:
    # P's answer's `usage` and `kv_transfer_params` (what `progress.prompt_sources` reads).
    usage: dict[str, Any] | None
    params: dict[str, Any] | None
    # The P leg's time, seconds.
    prefill_s: float
    # The decision the turn ran under when it is not the route's (the P leg failed).
    decision: str = ""
    error: str = ""

    @classmethod
    def of_answer(cls, answer: dict[str, Any], prefill_s: float) -> PrefillReport:
        usage, params = answer.get("usage"), answer.get("kv_transfer_params")
        return cls(
            usage if isinstance(usage, dict) else None,
            params if isinstance(params, dict) else None,
            prefill_s,
        )

    def encode(self) -> str:
        fields: dict[str, Any] = {"usage": self.usage, "params": self.params, "prefill_s": self.prefill_s}
        fields |= {"decision": self.decision, "error": self.error}
        return base64.urlsafe_b64encode(orjson.dumps(fields)).decode()

    @classmethod
    def decode(cls, value: str) -> PrefillReport:
        """Raises ValueError when the header is not one."""
        try:
            fields = orjson.loads(base64.urlsafe_b64decode(value))
            return cls(
                fields["usage"],
                fields["params"],
                float(fields["prefill_s"]),
                str(fields["decision"]),
                str(fields["error"]),
            )
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a prefill report: {exc}") from None

    def apply(self, progress: TurnProgress) -> None:
        """Records the P leg in the turn's progress, as the gateway's P leg does."""
        if self.decision:
            progress.decision = self.decision
        if self.error:
            progress.error = self.error
        if self.usage is not None or self.params is not None:
            progress.sources = prompt_sources({"usage": self.usage, "kv_transfer_params": self.params})
        progress.prefill_params = self.params
        progress.prefill_s = self.prefill_s
