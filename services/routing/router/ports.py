"""What the `Router` reads and calls outside itself, as Protocols: the cluster, the check-out, the clock.

The routing service implements them over its watch-fed view, the etcd store and the system
clock (`kvplane.services.routing.adapters`); the simulator over its fleet, an in-memory
check-out and simulated time (`kvplane.bench.sim.routers`). Domain types only: no protobuf.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from kvplane.services.common.model.nodes import Node
from kvplane.services.common.model.suspects import NodeSuspect
from kvplane.services.common.store.records import CheckOut, HandleRecord
from kvplane.services.routing.policy import NodeState


class Clock(Protocol):
    """The router's only source of time."""

    def unix_ms(self) -> int:
        """Wall-clock time, ms since the epoch (handles' expiries and load reports use it)."""
        ...

    def monotonic_s(self) -> float:
        """A monotonic clock, seconds: what a wait took out of the caller's deadline."""
        ...


class HandleCheckOut(Protocol):
    """The atomic check-out of a conversation's handle: at most one caller gets it."""

    async def check_out(
        self, tenant: str, conversation: str, route_id: str, expected: HandleRecord, timeout_s: float
    ) -> CheckOut:
        """The handle, claimed for `route_id`, if `expected` is still what is retained.

        Raises HandleNotRetained or NotFound when another turn took it (or it went), and
        StoreUnavailable or TimeoutError when the claim could not be made within `timeout_s`.
        """
        ...


class ClusterReader(Protocol):
    """What the router knows of the cluster: nodes and their loads, handles, suspect marks."""

    @property
    def healthy(self) -> bool:
        """Whether what is read is current (the view is connected to etcd)."""
        ...

    @property
    def suspects(self) -> Mapping[str, NodeSuspect]: ...

    def handle(self, tenant: str, conversation: str) -> HandleRecord | None:
        """The conversation's retained handle, if known."""
        ...

    def node_states(self) -> tuple[NodeState, ...]:
        """The registered nodes, each with its last load report."""
        ...

    def node(self, node_id: str) -> Node | None:
        """The node's current registration, if any."""
        ...

    def newest_report_unix_ms(self) -> int:
        """When the newest load report was taken, ms since the epoch (0: none)."""
        ...

    async def await_handle(self, tenant: str, conversation: str, handle_id: str, wait_s: float) -> bool:
        """Whether the conversation's handle is `handle_id`, waiting up to `wait_s` for its publish."""
        ...
