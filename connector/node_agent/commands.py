"""The EvictionService.Commands stream: says hello, applies each ReleaseCommand by calling
`on_release(remote_request_id)` (DrainCommand: `on_drain()`), at most once per command id, and
acknowledges every command; the engine's demand (`demand.py`) shares the stream. An engine with a
host tier (`on_spill_order`) asks for the leader's order of its moves there in its hello, and is
handed each SpillOrder as it comes (`on_spill_order(device_ids, host_ids)`; not acknowledged),
and an empty one whenever a stream opens: the leader at its other end knows of no order before.
An engine that moves handles there on the leader's word (`on_move`) says so in its hello, and each
MoveCommand calls `on_move(remote_request_id)`: "" when the move started (or the handle is gone
already), else why the engine cannot move it, which the ack carries (not ok), so the leader
releases the handle instead.

A release whose command says the coordinator records the freed blocks itself on the ack
(`ack_records_freed`) is noted in `AckedFrees` before `on_release` runs: the engine's report of
those blocks (`NodeAgent.report_released`) is then dropped, as the ack writes what it would.

Runs on the agent's thread; so do `on_release`, `on_drain`, `on_spill_order` and `on_move`, which must be
thread-safe, quick and must not block.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import grpc

from kvplane.connector.node_agent.control_plane import REFUSED, Backoff, ControlPlane
from kvplane.connector.node_agent.demand import DemandReporter
from kvplane.v1 import eviction_pb2

log = logging.getLogger(__name__)


class AckedFrees:
    """Request ids whose freeing the coordinator records on the command's ack, until the engine
    reports them freed (at most `max_ids`, oldest forgotten first: an engine that never reports
    one, because it had freed the blocks already, leaves nothing behind for long). Any thread."""

    def __init__(self, max_ids: int) -> None:
        self._max_ids = max_ids
        self._lock = threading.Lock()
        self._ids: collections.OrderedDict[str, None] = collections.OrderedDict()

    def add(self, request_id: str) -> None:
        with self._lock:
            self._ids[request_id] = None
            while len(self._ids) > self._max_ids:
                self._ids.popitem(last=False)

    def discard(self, request_id: str) -> None:
        with self._lock:
            self._ids.pop(request_id, None)

    def take(self, request_id: str) -> bool:
        """True (once) if the ack records this id's freeing: the engine's report is not needed."""
        with self._lock:
            if request_id not in self._ids:
                return False
            del self._ids[request_id]
            return True


class CommandStream:
    """Keeps the command stream open and applies what comes down it."""

    def __init__(
        self,
        plane: ControlPlane,
        on_release: Callable[[str], None],
        on_drain: Callable[[], None] | None,
        demand: DemandReporter | None,
        acked_frees: AckedFrees | None = None,
        on_spill_order: Callable[[Sequence[str], Sequence[str]], None] | None = None,
        on_move: Callable[[str], str] | None = None,
    ) -> None:
        self._plane = plane
        self._on_spill_order = on_spill_order
        self._on_move = on_move
        self._on_release = on_release
        self._acked_frees = acked_frees
        self._on_drain = on_drain
        self._demand = demand
        self._seen: collections.OrderedDict[str, bool] = collections.OrderedDict()
        # Whether the engine takes moves now (its host tier can be switched off and on): every
        # hello says it, and `set_accepts_moves` reopens the stream to say it again.
        self._accepts_moves = on_move is not None
        self._call: grpc.aio.StreamStreamCall[Any, Any] | None = None
        self._reopening = False
        self.applied = 0
        self.duplicates = 0
        self.opened = 0
        self.spill_orders = 0

    @property
    def accepts_moves(self) -> bool:
        return self._accepts_moves

    def set_accepts_moves(self, accepts: bool) -> None:
        """Takes moves from now on, or not (on the agent's loop). The open stream is ended and
        opened again at once, so that the leader hears it in a new hello: an engine whose host
        tier is off is sent releases where it would have been sent moves it must refuse."""
        accepts = accepts and self._on_move is not None
        if accepts == self._accepts_moves:
            return
        self._accepts_moves = accepts
        if self._call is not None:
            self._reopening = True
            self._call.cancel()

    async def run(self) -> None:
        """Reconnects after every end of the stream, with backoff, until the agent stops."""
        plane = self._plane
        backoff = Backoff(plane.settings.backoff_initial_s, plane.settings.backoff_max_s)
        while not plane.is_stopping():
            await plane.session_ready.wait()
            try:
                received = await self._run_stream()
                if received:
                    backoff.reset()
            except grpc.aio.AioRpcError as err:
                if self._reopening and err.code() == grpc.StatusCode.CANCELLED:
                    pass  # ended to reopen, below
                elif err.code() in REFUSED:
                    plane.note_error("the eviction command stream", err)
                else:
                    if err.code() not in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAVAILABLE):
                        log.info("eviction command stream: %s %s", err.code(), err.details())
                    plane.rpc_errors += 1
            if self._reopening:
                # Ended to say something new in the hello: reopened at once.
                self._reopening = False
                continue
            # The stream ended or failed: reconnect after a pause either way.
            await plane.sleep_or_stop(backoff.next_delay())

    async def _run_stream(self) -> bool:
        plane = self._plane
        acks: asyncio.Queue[eviction_pb2.CommandsRequest | None] = asyncio.Queue()
        await acks.put(
            eviction_pb2.CommandsRequest(
                hello=eviction_pb2.NodeHello(
                    node_id=plane.node_id,
                    incarnation=plane.incarnation,
                    wants_spill_order=self._on_spill_order is not None,
                    accepts_moves=self._accepts_moves,
                )
            )
        )

        async def outgoing() -> AsyncIterator[eviction_pb2.CommandsRequest]:
            while (msg := await acks.get()) is not None:
                yield msg

        call = plane.evict.Commands(outgoing(), metadata=plane.call_metadata)
        self._call = call
        self.opened += 1
        if self._on_spill_order is not None:
            # A new stream's leader knows of no order sent before (it may be another replica):
            # the engine drops the last one and moves oldest first until this leader sends one.
            self._take_spill_order(eviction_pb2.SpillOrder())
        received = False
        demand = (
            asyncio.create_task(self._demand.send(acks), name="kvplane-agent-demand")
            if self._demand is not None
            else None
        )
        try:
            async for command in call:
                received = True
                if command.WhichOneof("command") == "spill_order":
                    self._take_spill_order(command.spill_order)
                    continue  # a hint: not acknowledged
                ok, error = self._apply(command)
                await acks.put(
                    eviction_pb2.CommandsRequest(
                        ack=eviction_pb2.CommandAck(command_id=command.command_id, ok=ok, error=error)
                    )
                )
        except asyncio.CancelledError:
            # The call cancelled to reopen it (`set_accepts_moves`) ends this stream only; the
            # task itself cancelled (the agent stopping) ends the loop too.
            task = asyncio.current_task()
            if not self._reopening or (task is not None and task.cancelling()):
                raise
        finally:
            self._call = None
            if demand is not None:
                demand.cancel()
            await acks.put(None)
            call.cancel()
        return received

    def _take_spill_order(self, order: eviction_pb2.SpillOrder) -> None:
        if self._on_spill_order is None:
            return  # never asked for (a hello without wants_spill_order)
        try:
            self._on_spill_order(tuple(order.device_request_ids), tuple(order.host_request_ids))
        except Exception:
            log.exception("applying a spill order failed")
            return
        self.spill_orders += 1

    def _apply(self, command: eviction_pb2.CommandsResponse) -> tuple[bool, str]:
        """Apply one command at most once; return the ack's (ok, error)."""
        if command.command_id in self._seen:
            self._seen.move_to_end(command.command_id)
            self.duplicates += 1
            return True, ""
        kind = command.WhichOneof("command")
        release = command.release
        # The ids the ack records as freed, when it does (None: the engine's report must).
        acked_frees = self._acked_frees if kind == "release" and release.ack_records_freed else None
        try:
            if kind == "release":
                if acked_frees is not None:
                    # Before on_release: an engine may report the free from inside it.
                    acked_frees.add(release.remote_request_id)
                self._on_release(release.remote_request_id)
            elif kind == "move":
                if self._on_move is None:
                    return False, "this engine has no host tier"
                if not self._accepts_moves:
                    return False, "this engine's host tier is off"
                refused = self._on_move(command.move.remote_request_id)
                if refused:
                    return False, refused
            elif kind == "drain":
                if self._on_drain is None:
                    return False, "this engine cannot drain"
                self._on_drain()
            else:
                return False, f"unknown command {kind!r}"
        except Exception as exc:
            log.exception("applying command %s failed", command.command_id)
            if acked_frees is not None:
                # Not applied: the ack records nothing, so the engine's own report must go out.
                acked_frees.discard(release.remote_request_id)
            return False, f"{type(exc).__name__}: {exc}"
        self._seen[command.command_id] = True
        while len(self._seen) > self._plane.settings.seen_commands_max:
            self._seen.popitem(last=False)
        self.applied += 1
        return True, ""
