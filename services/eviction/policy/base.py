"""The shape every retention policy plugin has."""

from __future__ import annotations

from typing import Protocol

from kvplane.services.eviction.policy.model import Release, Snapshot
from kvplane.services.eviction.policy.value import ValueModel


class RetentionPolicy(Protocol):
    """A pure judgement over a snapshot: no I/O, no clock (time is in it)."""

    @property
    def name(self) -> str:
        """The plugin's configuration name, also the `policy` label of its releases."""
        ...

    def evaluate(self, snapshot: Snapshot, values: ValueModel) -> list[Release]:
        """Handles to release now, each with its reason."""
        ...


class PolicyConfigError(ValueError):
    """A policy configuration names an unknown plugin or a bad setting."""
