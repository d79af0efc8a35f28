"""Scorers: each rates a node for a leg in [0, 1]. Importing registers them."""

from kvplane.services.routing.policy.scorers import (
    free_kv,
    holder_affinity,
    holder_locality,
    last_decode,
    last_prefill,
    queued_prefill,
    running_load,
)

__all__ = [
    "free_kv",
    "holder_affinity",
    "holder_locality",
    "last_decode",
    "last_prefill",
    "queued_prefill",
    "running_load",
]
