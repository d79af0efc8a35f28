"""Stand-ins for node agents on the eviction command stream, and replica helpers.

`CommandNode` is a real gRPC client of EvictionService.Commands: it says
hello, applies each command id at most once (as a node agent must), records
everything it saw, and acknowledges. It cycles through the replicas it is
given, moving on when one answers UNAVAILABLE (a standby) or goes away.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc

from kvplane.services.common.runtime.telemetry import Telemetry
from kvplane.services.dev.local_etcd import LocalEtcd
from kvplane.services.eviction.app import install
from kvplane.services.eviction.coordinator import EvictionCoordinator
from kvplane.services.process import ServiceProcess
from kvplane.v1 import eviction_pb2, eviction_pb2_grpc
from tests.conftest import node_headers, settings_for
from tests.support.polling import eventually


@dataclass
class AppliedRelease:
    command_id: str
    handle_id: str
    tenant: str
    conversation: str
    remote_request_id: str
    reason: int


@dataclass
class CommandNode:
    node_id: str
    incarnation: str
    targets: Sequence[str]
    # Acknowledge commands (False: apply but never ack, like a node that dies
    # before its ack leaves).
    ack: bool = True
    # Says in its hello that it takes MoveCommands; refuses each (ack not ok) when refuse_moves.
    accepts_moves: bool = False
    refuse_moves: bool = False
    applied: dict[str, AppliedRelease] = field(default_factory=dict)
    moves: dict[str, eviction_pb2.MoveCommand] = field(default_factory=dict)
    received: list[str] = field(default_factory=list)
    drains: list[str] = field(default_factory=list)
    errors: list[grpc.StatusCode] = field(default_factory=list)
    connects: int = 0
    streams_opened: int = 0

    def __post_init__(self) -> None:
        self._out: asyncio.Queue[eviction_pb2.CommandsRequest | None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._connected = asyncio.Event()

    # -- what tests look at -----------------------------------------------------

    @property
    def released_handles(self) -> Counter[str]:
        """How many distinct commands released each handle id (must stay <= 1)."""
        return Counter(a.handle_id for a in self.applied.values())

    def released_conversations(self) -> set[tuple[str, str]]:
        return {(a.tenant, a.conversation) for a in self.applied.values()}

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    # -- control ---------------------------------------------------------------------

    def start(self) -> None:
        self._stopping = False
        self._task = asyncio.create_task(self._run(), name=f"test-node-{self.node_id}")

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._connected.clear()

    def send_demand(self, blocks: int) -> None:
        """Reports KV demand on the open stream, in order with the acks sent so far."""
        assert self._out is not None, "no open stream"
        demand = eviction_pb2.KvDemand(blocks=blocks, measured_unix_ms=int(time.time() * 1000))
        self._out.put_nowait(eviction_pb2.CommandsRequest(demand=demand))

    def acknowledge(self, command_id: str) -> None:
        """Acknowledges an applied command late (for nodes started with ack=False)."""
        assert self._out is not None, "no open stream"
        self._out.put_nowait(
            eviction_pb2.CommandsRequest(ack=eviction_pb2.CommandAck(command_id=command_id, ok=True))
        )

    async def disconnect(self) -> None:
        """Drops the stream as a network fault would; `start()` reconnects."""
        await self.stop()

    # -- the stream ------------------------------------------------------------------

    async def _run(self) -> None:
        i = 0
        while not self._stopping:
            target = self.targets[i % len(self.targets)]
            i += 1
            try:
                await self._stream(target)
            except grpc.aio.AioRpcError as exc:
                self.errors.append(exc.code())
            finally:
                self._connected.clear()
            await asyncio.sleep(0.05)  # reconnect backoff, as an agent would

    async def _stream(self, target: str) -> None:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = eviction_pb2_grpc.EvictionServiceStub(channel)
            out: asyncio.Queue[eviction_pb2.CommandsRequest | None] = asyncio.Queue()
            self._out = out
            out.put_nowait(
                eviction_pb2.CommandsRequest(
                    hello=eviction_pb2.NodeHello(
                        node_id=self.node_id, incarnation=self.incarnation, accepts_moves=self.accepts_moves
                    )
                )
            )

            async def requests() -> AsyncIterator[eviction_pb2.CommandsRequest]:
                while (msg := await out.get()) is not None:
                    yield msg

            call = stub.Commands(requests(), metadata=node_headers(self.node_id))
            self.streams_opened += 1
            try:
                # The leader sends nothing until there is a command, so the
                # stream counts as connected once the call is up.
                await call.wait_for_connection()
                self.connects += 1
                self._connected.set()
                async for command in call:
                    self._apply(command)
                    if self.ack:
                        ok = not (self.refuse_moves and command.WhichOneof("command") == "move")
                        error = "" if ok else "no room in the host tier"
                        out.put_nowait(
                            eviction_pb2.CommandsRequest(
                                ack=eviction_pb2.CommandAck(command_id=command.command_id, ok=ok, error=error)
                            )
                        )
            finally:
                out.put_nowait(None)
                call.cancel()

    def _apply(self, command: eviction_pb2.CommandsResponse) -> None:
        self.received.append(command.command_id)
        if command.command_id in self.applied or command.command_id in self.drains:
            return  # at most once per command id
        if command.WhichOneof("command") == "drain":
            self.drains.append(command.command_id)
            return
        if command.WhichOneof("command") == "move":
            self.moves[command.command_id] = command.move
            return
        r = command.release
        self.applied[command.command_id] = AppliedRelease(
            command.command_id, r.handle_id, r.tenant, r.conversation, r.remote_request_id, r.reason
        )


async def start_replica(
    etcd: LocalEtcd, prefix: str, *, telemetry: Telemetry | None = None, **eviction: object
) -> ServiceProcess:
    """An in-process eviction replica (its own store, view, lease and gRPC port)."""
    # A lease long enough that a starved CI box does not cost the leader its
    # term mid-test; failover tests pass a short one.
    # No wait at a term's start for nodes that may take moves (`mover.py`): a test's node
    # connects when the test says so, and tests of that wait set it.
    values: dict[str, object] = {
        "lease_ttl_s": 5,
        "evaluate_interval_s": 0.2,
        "orphan_sweep_interval_s": 0.5,
        "move_grace_s": 0,
    }
    values.update(eviction)
    process = ServiceProcess(
        settings_for(etcd, prefix, eviction=values), [install], telemetry or Telemetry.disabled()
    )
    await process.start()
    return process


async def start_purging_leader(etcd: LocalEtcd, prefix: str) -> ServiceProcess:
    """An eviction replica with no retention policy, once it leads: the one component that
    purges a dead node's handles, and nothing else."""
    process = await start_replica(etcd, prefix, policy={"policies": []})

    async def leads() -> bool:
        return coordinator_of(process).is_leader

    try:
        await eventually(leads, what="the eviction replica to lead")
    except BaseException:
        await process.stop()
        raise
    return process


def coordinator_of(process: ServiceProcess) -> EvictionCoordinator:
    for component in process.components:
        if isinstance(component, EvictionCoordinator):
            return component
    raise LookupError("no eviction coordinator in this process")


def target_of(process: ServiceProcess) -> str:
    return f"127.0.0.1:{process.grpc_port}"
