"""`metadata:` in the settings file (KVPLANE_METADATA__<FIELD> in the environment)."""

from __future__ import annotations

from pydantic import Field

from kvplane.services.common.settings import Section


class MetadataSection(Section):
    default_lease_ttl_s: int = Field(10, ge=2, le=300)
    # A checked-out handle nobody read within this long is released (its turn never reached P),
    # seconds. Longer than a turn's wait in P's queue plus the gateway's prefill timeout.
    claim_deadline_s: float = Field(60.0, gt=0)
    # How often the claim reaper sweeps, seconds: an unused claim is released between
    # claim_deadline_s and claim_deadline_s plus this after it was made. Each sweep reads every
    # claim from etcd, on every metadata replica.
    claim_sweep_interval_s: float = Field(10.0, gt=0)
