"""kvplane.v1.EvictionService: the node command channel and status.

Only the leader serves command streams; a standby answers UNAVAILABLE so the
node agent retries, and finds the leader among the replicas. A node's KV demand
travels on the same stream, in order with its acknowledgements: an ack read
before a demand report means the report already counts that release.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc

from kvplane.services.common.model import validation
from kvplane.services.common.model.errors import InvalidArgument, KvplaneError, NotLeader
from kvplane.services.common.runtime.auth import PrincipalKind
from kvplane.services.common.runtime.grpc_errors import rpc_method
from kvplane.services.common.runtime.server import caller
from kvplane.services.eviction.coordinator import EvictionCoordinator
from kvplane.services.eviction.sessions import NodeSession, SessionClosed
from kvplane.v1 import eviction_pb2, eviction_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = eviction_pb2.DESCRIPTOR.services_by_name["EvictionService"].full_name
_INTERNAL = (PrincipalKind.NODE, PrincipalKind.OPERATOR)
# Acknowledgements of one stream being written to etcd at once.
_ACKS_IN_FLIGHT = 32


class EvictionService(eviction_pb2_grpc.EvictionServiceServicer):
    def __init__(self, coordinator: EvictionCoordinator) -> None:
        self.coordinator = coordinator

    @rpc_method
    async def Commands(
        self,
        request_iterator: AsyncIterator[eviction_pb2.CommandsRequest],
        context: grpc.aio.ServicerContext[eviction_pb2.CommandsRequest, eviction_pb2.CommandsResponse],
    ) -> AsyncIterator[eviction_pb2.CommandsResponse]:
        principal = caller(self, context)
        principal.require(PrincipalKind.NODE)
        term = self.coordinator.term
        if term is None or not term.active:
            leader = self.coordinator.election.leader_id
            raise NotLeader(f"replica {self.coordinator.replica_id} is a standby; leader is {leader!r}")
        hello = await _hello(request_iterator)
        # The stream carries this node's release commands (tenants and conversations in
        # clear) and its acks delete them: only the node itself may open it.
        principal.as_node(hello.node_id, "hello.node_id")
        if self.coordinator.term is not term or not term.active:
            # The term ended while the hello was on its way: open nothing.
            raise NotLeader("leadership moved to another replica; reconnect")
        session = self.coordinator.open_session(
            hello.node_id, hello.incarnation, hello.wants_spill_order, hello.accepts_moves
        )
        log.info("node connected", extra={"node": hello.node_id, "incarnation": hello.incarnation})
        reader = asyncio.create_task(self._read_acks(request_iterator, session), name=f"acks-{hello.node_id}")
        try:
            while True:
                try:
                    command = await session.next_command()
                except SessionClosed:
                    break
                yield command
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            self.coordinator.sessions.discard(session, session.close_reason or "stream ended")
            if self.coordinator.sessions.get(hello.node_id) is None:
                # No newer stream from the node: its demand is unknown until it reconnects.
                self.coordinator.forget_demand(hello.node_id, hello.incarnation)
            log.info(
                "node disconnected",
                extra={"node": hello.node_id, "reason": session.close_reason, "acked": session.acked},
            )
        if self.coordinator.term is not term:
            raise NotLeader("leadership moved to another replica; reconnect")

    async def _read_acks(
        self, requests: AsyncIterator[eviction_pb2.CommandsRequest], session: NodeSession
    ) -> None:
        # Each acknowledgement is an independent etcd delete: several in
        # flight keep a node's outbox from draining one round trip at a time.
        limit = asyncio.Semaphore(_ACKS_IN_FLIGHT)
        in_flight: set[asyncio.Task[None]] = set()

        async def acknowledge(ack: eviction_pb2.CommandAck) -> None:
            try:
                await session.acknowledge(ack)
            except Exception:
                # Shutting down under it, most likely. The entry stays in etcd
                # and is replayed on the next connect; the node acks it again.
                log.warning("could not record ack %s", ack.command_id, exc_info=True)
            finally:
                limit.release()

        try:
            async for request in requests:
                kind = request.WhichOneof("message")
                if kind == "demand":
                    self.coordinator.on_demand(
                        session.node_id,
                        session.incarnation,
                        request.demand.blocks,
                        request.demand.measured_unix_ms,
                    )
                elif kind == "ack":
                    # Before any later demand report is read: that report counts this release.
                    self.coordinator.releaser.acknowledged(session.node_id, request.ack.command_id)
                    await limit.acquire()  # back-pressure on the node while deletes catch up
                    task = asyncio.create_task(acknowledge(request.ack))
                    in_flight.add(task)
                    task.add_done_callback(in_flight.discard)
            reason = "node closed the stream"
        except (grpc.aio.AioRpcError, grpc.RpcError, KvplaneError) as exc:
            reason = f"stream broke: {exc}"
        self.coordinator.sessions.discard(session, reason)

    @rpc_method
    async def GetStatus(
        self,
        request: eviction_pb2.GetStatusRequest,
        context: grpc.aio.ServicerContext[eviction_pb2.GetStatusRequest, eviction_pb2.GetStatusResponse],
    ) -> eviction_pb2.GetStatusResponse:
        caller(self, context).require(*_INTERNAL)
        leader = self.coordinator.is_leader
        leader_id = self.coordinator.replica_id
        if not leader:
            record = await self.coordinator.store.election_leader(self.coordinator.settings.election_name)
            leader_id = record.candidate if record is not None else ""
        return eviction_pb2.GetStatusResponse(
            leader=leader,
            leader_id=leader_id,
            connected_nodes=len(self.coordinator.sessions),
            pending_commands=await self.coordinator.pending_commands(),
        )


async def _hello(requests: AsyncIterator[eviction_pb2.CommandsRequest]) -> eviction_pb2.NodeHello:
    try:
        first = await anext(aiter(requests))
    except StopAsyncIteration:
        raise InvalidArgument("hello", "the stream ended before the hello") from None
    if first.WhichOneof("message") != "hello":
        raise InvalidArgument("hello", "the first message must be a hello")
    validation.ident(first.hello.node_id, "hello.node_id")
    validation.ident(first.hello.incarnation, "hello.incarnation")
    return first.hello
