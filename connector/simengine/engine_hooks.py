"""The seam between a sim-engine and kvplane's node agent.

The engine calls an ``EngineObserver`` at the same points where kvplane's
vLLM connector hooks into vLLM, and the node agent drives the engine back
through ``EngineControl``:

| vLLM connector hook                          | sim-engine                         |
|----------------------------------------------|------------------------------------|
| ``get_num_new_matched_tokens`` (P)           | ``EngineObserver.check_pull``      |
| ``request_finished`` with a retained handle  | ``EngineObserver.on_handle_retained`` |
| ``update_connector_output.finished_sending`` | ``EngineObserver.on_blocks_freed`` |
| (host tier: a handle moved to host memory)   | ``EngineObserver.on_handle_moved`` |
| ``build_connector_meta`` early release       | ``EngineControl.release_early``    |
| drain                                        | ``EngineControl.drain``            |
| (host tier: the leader's spill order)        | ``EngineControl.set_spill_order``  |
| load snapshot                                | ``EngineControl.load``             |

Who calls what: observer methods run on the engine's event-loop thread, in
the request path or the reaper, so they must not block; an agent enqueues
and does its network work on its own thread. ``EngineControl`` methods are
cheap and safe to call from any thread (the node agent calls them from its
own).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class EngineLoad:
    """A snapshot of the engine's load, in the units of kvplane.v1.NodeLoad."""

    # Requests waiting for the prefill stage.
    queued_requests: int
    # Prompt tokens the engine has yet to compute: those requests' and what the prefill computing
    # now has left of its own.
    queued_prefill_tokens: int
    # Requests prefilling or decoding now.
    running_requests: int
    free_kv_blocks: int
    total_kv_blocks: int
    # Bytes of the KV cache held for remote readers (D handles and P leases).
    retained_bytes: int
    # How many D handles and P leases are held (in either tier).
    retained_handles: int
    # The host tier: its blocks, those free, and the bytes of the handles moved there.
    host_total_blocks: int = 0
    host_free_blocks: int = 0
    host_retained_bytes: int = 0
    # Blocks that requests waiting for KV memory need (each its whole allocation).
    waiting_kv_blocks: int = 0


class EngineObserver(Protocol):
    """Receives the engine's KV events. Event-loop thread; must not block."""

    def check_pull(self, kv_transfer_params: dict[str, Any], prompt_token_ids: Sequence[int]) -> None:
        """P, before it sizes a pull from D's handle: may clip the params in place.

        ``kvplane.connector.prefix_check.check_pull`` does exactly this: it
        cuts ``remote_block_ids``/``remote_num_tokens`` to the verified prefix,
        or sets ``remote_num_tokens`` to 0 (P then pulls nothing and still
        notifies D, which frees the spent handle).
        """

    def on_handle_retained(
        self,
        kv_transfer_params: dict[str, Any],
        all_token_ids: Sequence[int],
        retained_bytes: int,
        request_kv_transfer_params: Mapping[str, Any],
    ) -> None:
        """D kept a finished turn's blocks; ``kv_transfer_params`` is the handle it will return.

        Keys added to ``kv_transfer_params`` here go out with it (the vLLM
        connector adds its handle id and token digests the same way).
        ``all_token_ids`` is prompt + output; the blocks hold KV for the first
        ``remote_num_tokens`` of them. ``request_kv_transfer_params`` is what
        the request came with (kvplane's tenant and conversation keys).
        """

    def on_blocks_freed(self, request_id: str, read: bool) -> None:
        """A retained handle's blocks were freed: read by P (`read`), expired, or released
        early."""

    def on_handle_moved(
        self, request_id: str, kv_transfer_params: dict[str, Any], settle: Callable[[bool], None]
    ) -> None:
        """D copied a retained handle's blocks to its host tier: ``kv_transfer_params`` names the
        same request and tokens on the new blocks. ``settle(stored)``, once, from any thread, says
        whether the handle now lives there (its cache blocks are then freed) or stays where it
        is (the control plane refused the relocation: someone checked it out or released it)."""


class EngineControl(Protocol):
    """Commands the node agent may send to the engine. Thread-safe."""

    @property
    def incarnation(self) -> str:
        """New at every engine start; part of every lease stamp."""

    def release_early(self, request_id: str) -> bool:
        """Free a retained handle now; False if it was not held when called."""

    def drain(self) -> None:
        """Free every retained handle and keep no new ones."""

    def set_spill_order(self, device: Sequence[str], host: Sequence[str]) -> None:
        """The control plane's order of moves to the host tier (request ids of handles in the
        KV cache) and of drops there (of handles in host memory), least valuable first."""

    def load(self) -> EngineLoad:
        """The current load."""


class NullObserver:
    """Observer used when no control plane is attached."""

    def check_pull(self, kv_transfer_params: dict[str, Any], prompt_token_ids: Sequence[int]) -> None:
        return None

    def on_handle_retained(
        self,
        kv_transfer_params: dict[str, Any],
        all_token_ids: Sequence[int],
        retained_bytes: int,
        request_kv_transfer_params: Mapping[str, Any],
    ) -> None:
        return None

    def on_blocks_freed(self, request_id: str, read: bool) -> None:
        return None

    def on_handle_moved(
        self, request_id: str, kv_transfer_params: dict[str, Any], settle: Callable[[bool], None]
    ) -> None:
        settle(True)  # nobody else hands it out: nothing can refuse the move
