"""Leaving out nodes that just failed: the turn's own failed legs, and the
nodes any replica has marked suspect (kvplane.services.common.model.suspects).

Pure: the marks are an argument, no I/O. Writing a mark is the service's
(`kvplane.services.routing.suspect_marker`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from kvplane.services.common.model.suspects import NodeSuspect
from kvplane.services.routing.policy import NodeState


def usable_nodes(
    states: tuple[NodeState, ...], suspects: Mapping[str, NodeSuspect], failed: Collection[str]
) -> tuple[NodeState, ...]:
    """The nodes a route may choose from: none that failed this turn or stands suspect."""
    out = []
    for state in states:
        node = state.node
        if node.node_id in failed:
            continue
        suspect = suspects.get(node.node_id)
        if suspect is not None and suspect.stands(node, state.load):
            continue
        out.append(state)
    return tuple(out)
