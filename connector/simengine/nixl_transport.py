"""Real NIXL (UCX backend, DRAM) under the simulated KV cache.

The whole block pool (its host tier included) is registered once, with one
transfer descriptor per block, as vLLM's connector does. Readers pull scattered blocks with one
prepared READ and ride the read-completion notification on the same
transfer, so the holder sees it only after the data has moved.

Everything here runs on the event-loop thread. The agent is created without
NIXL's progress thread: that thread polls with zero delay and would burn a
core per engine; progress is driven by the polls below instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvplane.connector.simengine.block_pool import BlockPool


class NixlUnavailableError(Exception):
    """The NIXL Python package is not installed."""


class TransferFailedError(Exception):
    """A NIXL transfer ended in an error state or timed out."""


class EngineNotStartedError(Exception):
    """The engine's NIXL agent is used before the engine started (or after it stopped)."""


def _load_nixl() -> Any:
    # nixl-cu12 is what kvplane[nixl] pins; the `nixl` meta package picks a CUDA flavour itself.
    for name in ("nixl_cu12._api", "nixl._api"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise NixlUnavailableError("install kvplane[nixl] (nixl-cu12) for the sim-engine")


@dataclass(frozen=True)
class RemoteAgent:
    """A peer's agent added to ours, with its block descriptors prepared."""

    name: str
    num_blocks: int
    prepped: Any


class NixlTransport:
    """One NIXL agent owning one registered block pool."""

    def __init__(self, agent_name: str, pool: BlockPool) -> None:
        api = _load_nixl()
        self.agent_name = agent_name
        self._pool = pool
        self._agent = api.nixl_agent(
            agent_name, api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        )
        base = pool.base_address
        size = pool.bytes_per_block
        count = pool.addressable_blocks
        self._reg = self._agent.register_memory([(base, count * size, 0, "")], "DRAM")
        descs = np.stack(
            [
                base + np.arange(count, dtype=np.uint64) * np.uint64(size),
                np.full(count, size, dtype=np.uint64),
                np.zeros(count, dtype=np.uint64),
            ],
            axis=1,
        ).astype(np.uint64)
        xfer_descs = self._agent.get_xfer_descs(descs, "DRAM")
        self._serialized_descs: bytes = self._agent.get_serialized_descs(xfer_descs)
        self._local = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs, "DRAM")
        self._remotes: dict[str, RemoteAgent] = {}

    def metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def serialized_descs(self) -> bytes:
        return self._serialized_descs

    def add_remote(self, metadata: bytes, serialized_descs: bytes, num_blocks: int) -> RemoteAgent:
        name = self._agent.add_remote_agent(metadata)
        if isinstance(name, bytes):
            name = name.decode()
        prepped = self._agent.prep_xfer_dlist(name, self._agent.deserialize_descs(serialized_descs))
        remote = RemoteAgent(name=name, num_blocks=num_blocks, prepped=prepped)
        self._remotes[name] = remote
        return remote

    def remove_remote(self, remote: RemoteAgent) -> None:
        if self._remotes.pop(remote.name, None) is None:
            return
        with contextlib.suppress(Exception):
            self._agent.release_dlist_handle(remote.prepped)
        with contextlib.suppress(Exception):
            self._agent.remove_remote_agent(remote.name)

    async def read(
        self,
        remote: RemoteAgent,
        local_blocks: list[int],
        remote_blocks: list[int],
        notif: bytes,
        timeout_s: float,
    ) -> float:
        """READ remote blocks into local ones, then deliver ``notif``; returns seconds taken."""
        if len(local_blocks) != len(remote_blocks):
            raise ValueError("local and remote block lists differ in length")
        if any(not 0 <= b < remote.num_blocks for b in remote_blocks):
            raise TransferFailedError(f"remote block id out of range 0..{remote.num_blocks - 1}")
        t0 = time.perf_counter()
        try:
            handle = self._agent.make_prepped_xfer(
                "READ",
                self._local,
                np.asarray(local_blocks, dtype=np.int32),
                remote.prepped,
                np.asarray(remote_blocks, dtype=np.int32),
                notif_msg=notif,
            )
        except Exception as e:  # NIXL raises its own status exceptions
            raise TransferFailedError(f"preparing READ failed: {e}") from e
        try:
            state = self._agent.transfer(handle)
            delay = 0.0
            while state == "PROC":
                if time.perf_counter() - t0 > timeout_s:
                    raise TransferFailedError(f"READ still in progress after {timeout_s:.1f} s")
                # Yield at once first (small reads finish in microseconds), then back off.
                await asyncio.sleep(delay)
                delay = min(0.002, delay * 2 + 0.0001)
                state = self._agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransferFailedError(f"READ ended in state {state}")
        except asyncio.CancelledError:
            # The caller frees the destination blocks next: let the READ land first, so a late
            # write never hits a block that was handed to another request.
            self._finish_blocking(handle, t0 + timeout_s)
            raise
        except TransferFailedError:
            raise
        except Exception as e:
            raise TransferFailedError(f"READ failed: {e}") from e
        finally:
            with contextlib.suppress(Exception):
                self._agent.release_xfer_handle(handle)
        return time.perf_counter() - t0

    def _finish_blocking(self, handle: Any, deadline: float) -> None:
        with contextlib.suppress(Exception):
            while self._agent.check_xfer_state(handle) == "PROC" and time.perf_counter() < deadline:
                time.sleep(0.0002)

    def send_notif(self, remote: RemoteAgent, msg: bytes) -> None:
        try:
            self._agent.send_notif(remote.name, msg)
        except Exception as e:
            raise TransferFailedError(f"notification to {remote.name} failed: {e}") from e

    def poll_notifs(self) -> list[tuple[str, bytes]]:
        out: list[tuple[str, bytes]] = []
        for agent, msgs in self._agent.get_new_notifs().items():
            name = agent.decode() if isinstance(agent, bytes) else str(agent)
            out.extend((name, bytes(m)) for m in msgs)
        return out

    def close(self) -> None:
        for remote in list(self._remotes.values()):
            self.remove_remote(remote)
        with contextlib.suppress(Exception):
            self._agent.release_dlist_handle(self._local)
        with contextlib.suppress(Exception):
            self._agent.deregister_memory(self._reg)
