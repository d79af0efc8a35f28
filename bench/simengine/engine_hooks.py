"""The seam between a sim-engine and kvplane's node agent.

The engine calls an ``EngineObserver`` (the node agent's side) when it
retains or frees a decode handle, and the agent calls the engine back
through ``EngineControl`` to release a handle early or to read its load:
the same events and commands the vLLM connector exchanges with the agent.

Who calls what: the observer methods run on the engine's event-loop thread,
inside the request path or the reaper, so they must not block; an agent
enqueues and does its gRPC work on its own thread or task. ``EngineControl``
methods are cheap, non-blocking and must be called on the engine's event
loop (from another thread, use ``loop.call_soon_threadsafe``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class EngineLoad:
    """A snapshot of the engine's load, in the units of kvplane.v1.NodeLoad."""

    # Requests waiting for the prefill stage.
    queued_requests: int
    # Prompt tokens those requests will compute, in tokens.
    queued_prefill_tokens: int
    # Requests prefilling or decoding now.
    running_requests: int
    free_kv_blocks: int
    total_kv_blocks: int
    # Bytes held for remote readers (D handles and P leases).
    retained_bytes: int
    # How many D handles and P leases are held.
    retained_handles: int


class EngineObserver(Protocol):
    """Receives the engine's retention events. Must not block."""

    def on_handle_retained(
        self, kv_transfer_params: Mapping[str, Any], all_token_ids: Sequence[int], retained_bytes: int
    ) -> None:
        """D kept a finished turn's blocks; ``kv_transfer_params`` is the handle it returned.

        ``all_token_ids`` is prompt + output; the blocks hold KV for all but
        the last of them (``remote_num_tokens``).
        """

    def on_blocks_freed(self, request_id: str) -> None:
        """A handle's blocks were freed: read by P, expired, released early or aborted."""


class EngineControl(Protocol):
    """Commands the node agent may send to the engine."""

    def release_early(self, request_id: str) -> bool:
        """Free a retained handle now; False if it is no longer held."""

    def load(self) -> EngineLoad:
        """The current load."""


class NullObserver:
    """Observer used when no control plane is attached."""

    def on_handle_retained(
        self, kv_transfer_params: Mapping[str, Any], all_token_ids: Sequence[int], retained_bytes: int
    ) -> None:
        return None

    def on_blocks_freed(self, request_id: str) -> None:
        return None
