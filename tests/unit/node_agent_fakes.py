"""A node agent's control plane with scripted stubs: the agent's jobs tested one at a time, without a
network. Each stub method records its request and answers with the next scripted reply or error."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from kvplane.connector.node_agent.control_plane import ControlPlane
from kvplane.connector.node_agent.settings import NodeAgentSettings
from kvplane.services.common.model.handles import CacheHandle
from kvplane.v1 import eviction_pb2, metadata_pb2
from tests.unit.routing_policy_fixtures import history, mk_handle, mk_node

NODE = mk_node("d0")


def rpc_error(code: grpc.StatusCode, details: str = "") -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class Scripted:
    """One RPC: records each request (and its metadata), answers with the next of `replies` (an
    exception is raised), then with `default` once the script runs out (a callable: its answer to
    the request)."""

    def __init__(self, default: Any) -> None:
        self.replies: list[Any] = []
        self.default = default
        self.requests: list[Any] = []
        self.metadata: list[tuple[tuple[str, str], ...]] = []

    # The generated stubs' signature, `timeout` included.
    async def __call__(self, request: Any, *, timeout: float | None = None, metadata: Any = ()) -> Any:  # noqa: ASYNC109
        self.requests.append(request)
        self.metadata.append(tuple(metadata))
        reply = self.replies.pop(0) if self.replies else self.default
        if callable(reply):
            reply = reply(request)
        if isinstance(reply, Exception):
            raise reply
        return reply


class FakeMetadata:
    def __init__(self) -> None:
        self.RegisterNode = Scripted(metadata_pb2.RegisterNodeResponse(lease_id=0x51, lease_ttl_s=3))
        self.KeepAlive = Scripted(metadata_pb2.KeepAliveResponse())
        self.ReconcileRetained = Scripted(metadata_pb2.ReconcileRetainedResponse())
        # A current service: it records the freed requests a publish reports.
        self.PublishHandles = Scripted(
            lambda request: metadata_pb2.PublishHandlesResponse(
                released_recorded=len(request.released_remote_request_ids)
            )
        )
        self.ReportReleased = Scripted(metadata_pb2.ReportReleasedResponse())


class CommandsCall:
    """One open Commands stream: yields its scripted commands (then ends, or raises `end`), while
    everything the agent sends on it is collected in `sent`."""

    def __init__(
        self,
        requests: AsyncIterator[eviction_pb2.CommandsRequest],
        commands: list[eviction_pb2.CommandsResponse],
        end: Exception | None,
        sent_before_next: Callable[[list[eviction_pb2.CommandsRequest]], bool],
    ) -> None:
        self.sent: list[eviction_pb2.CommandsRequest] = []
        self._commands, self._end, self._ready = commands, end, sent_before_next
        self.cancelled = False
        self._said = asyncio.Event()
        self._reader = asyncio.create_task(self._read(requests))

    async def _read(self, requests: AsyncIterator[eviction_pb2.CommandsRequest]) -> None:
        async for request in requests:
            self.sent.append(request)
            if self._ready(self.sent):
                self._said.set()

    async def __aiter__(self) -> AsyncIterator[eviction_pb2.CommandsResponse]:
        for command in self._commands:
            yield command
        # The server ends the stream once the agent has said what the test waits for.
        if not self._ready(self.sent):
            await asyncio.wait_for(self._said.wait(), 10)
        if self._end is not None:
            raise self._end

    def cancel(self) -> None:
        self.cancelled = True

    async def finished(self) -> list[eviction_pb2.CommandsRequest]:
        await asyncio.wait_for(self._reader, 10)
        return self.sent


def acked_all(sent: list[eviction_pb2.CommandsRequest], commands: int) -> bool:
    return sum(1 for m in sent if m.HasField("ack")) >= commands


class FakeEviction:
    """Each Commands call takes the next script: (commands, error to end with or None). With the
    scripts used up, the agent is told to stop."""

    def __init__(self, plane: ControlPlane) -> None:
        self._plane = plane
        self.scripts: list[tuple[list[eviction_pb2.CommandsResponse], Exception | None]] = []
        self.calls: list[CommandsCall] = []
        self.metadata: list[tuple[tuple[str, str], ...]] = []
        # When a stream may end, given what the agent sent and how many commands went down it:
        # by default once the agent acked every one.
        self.ready: Callable[[list[eviction_pb2.CommandsRequest], int], bool] = acked_all

    def Commands(
        self, requests: AsyncIterator[eviction_pb2.CommandsRequest], *, metadata: Any = ()
    ) -> CommandsCall:
        self.metadata.append(tuple(metadata))
        commands, end = self.scripts.pop(0) if self.scripts else ([], None)
        if not self.scripts and not commands and end is None:
            assert self._plane.stopping is not None
            self._plane.stopping.set()
        expected = len(commands)
        call = CommandsCall(requests, commands, end, lambda sent: self.ready(sent, expected))
        self.calls.append(call)
        return call


def plane(**settings: Any) -> tuple[ControlPlane, FakeMetadata, FakeEviction]:
    """A control plane opened on the running loop, with scripted stubs."""
    s = NodeAgentSettings(
        metadata_target="127.0.0.1:1", **({"backoff_initial_s": 0.01, "backoff_max_s": 0.05} | settings)
    )
    cp = ControlPlane(s, NODE)
    cp.incarnation = "life-1"
    cp.stopping = asyncio.Event()
    meta, evict = FakeMetadata(), FakeEviction(cp)
    cp.meta, cp.evict = meta, evict  # type: ignore[assignment]
    return cp, meta, evict


def handle(request_id: str, *, life_s: float = 60.0) -> CacheHandle:
    """A handle of NODE's for `request_id`, expiring `life_s` from now (negative: already expired)."""
    h = mk_handle(NODE, history(32))
    vllm = dataclasses.replace(h.vllm, remote_request_id=request_id)
    return dataclasses.replace(
        h, handle_id=f"h-{request_id}", vllm=vllm, wall_expiry_unix_ms=int((time.time() + life_s) * 1000)
    )


async def until(predicate: Callable[[], object], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)
