"""What every request through the picker shares: the gateway's turn steps, keys, salts and shares."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from opentelemetry import trace

from kvplane.services.epp.answers import PendingAnswers
from kvplane.services.epp.settings import EppSection
from kvplane.services.gateway import admission
from kvplane.services.gateway.admission import ReadLimits
from kvplane.services.gateway.cache_salt import CacheSalts
from kvplane.services.gateway.identity import ApiKeys
from kvplane.services.gateway.settings import GatewaySection
from kvplane.services.gateway.tenant_share import TenantShares
from kvplane.services.gateway.turn import TurnRunner


@dataclass(frozen=True)
class PickerState:
    epp: EppSection
    gateway: GatewaySection
    # The gateway's own turn steps: its prompt, Route (with fallback engines), reporter, and what it
    # knows about each decode engine's digests. Its legs are the sidecars' to run.
    turns: TurnRunner
    keys: ApiKeys
    salts: CacheSalts
    shares: TenantShares
    # Each tenant's request-body bytes being gathered and parsed at once.
    body_reads: TenantShares
    route_key: bytes
    route_ttl_s: float
    tracer: trace.Tracer
    # Turns awaiting their sidecar's report of D's answer, and where the sidecars send it; None
    # and "" when the picker reads D's answer from Envoy's response phase.
    answers: PendingAnswers | None = None
    answers_url: str = ""

    @cached_property
    def read_limits(self) -> ReadLimits:
        """The body limits, built once (every request reads them)."""
        return admission.read_limits(self.gateway)
