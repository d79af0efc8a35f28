"""Filters: each drops the nodes that cannot take a leg. Importing registers them."""

from kvplane.services.routing.policy.filters import (
    fingerprint,
    live,
    model,
    not_draining,
    role,
)

__all__ = ["fingerprint", "live", "model", "not_draining", "role"]
