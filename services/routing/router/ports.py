"""What the `Router` reads and calls outside itself, as Protocols: the cluster, the check-out, the clock.

The routing service implements them over its watch-fed view, the etcd store and the system
clock (`kvplane.services.routing.adapters`); the simulator over its fleet, an in-memory
check-out and simulated time (`kvplane.bench.sim.routers`). Domain types only: no protobuf.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping
from typing import Protocol

from kvplane.services.common.model.nodes import Node
from kvplane.services.common.model.suspects import NodeSuspect
from kvplane.services.common.store.records import CheckOut, HandleRecord
from kvplane.services.routing.policy import NodeState
from kvplane.services.routing.policy.snapshot import Prompt


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

        Raises HandleNotRetained or NotFound when another turn took it (or it went),
        HandleReplaced (with the current handle) when the conversation retains another one
        now, and StoreUnavailable or TimeoutError when the claim could not be made within
        `timeout_s`.
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


class PrefixCacheViews(Protocol):
    """What engines' own KV events say their prefix caches hold: prefill nodes', and decode
    nodes' where they stream them (the service: views fed by the node agents' streams,
    `state.engine_caches`; the simulator: its caches' event feeds)."""

    def __len__(self) -> int:
        """Views held (0: none; the router then keeps to its record)."""
        ...

    def prefix_tokens(
        self,
        nodes: Iterable[tuple[str, str]],
        prompt: Prompt,
        cache_salt: str | None,
        now_s: float,
        conversation: Hashable | None = None,
    ) -> Mapping[str, int]:
        """For each (node id, incarnation) with a fresh view: the tokens of the prompt's prefix it
        holds (0: none). Nodes without a fresh view are absent."""
        ...

    def forget_conversation(self, conversation: Hashable) -> None:
        """The conversation ended: anything kept for its prompts goes."""
        ...
