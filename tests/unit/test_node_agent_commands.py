"""The eviction command stream: hello first, each command applied at most once and every one acked,
the engine's demand on the same stream, and a new stream after every end."""

from __future__ import annotations

import asyncio

import grpc

from kvplane.connector.node_agent.commands import CommandStream
from kvplane.connector.node_agent.control_plane import ControlPlane
from kvplane.connector.node_agent.demand import DemandReporter
from kvplane.v1 import eviction_pb2
from tests.unit.node_agent_fakes import FakeEviction, plane, rpc_error


def release(command_id: str, request_id: str) -> eviction_pb2.CommandsResponse:
    return eviction_pb2.CommandsResponse(
        command_id=command_id, release=eviction_pb2.ReleaseCommand(remote_request_id=request_id)
    )


def drain(command_id: str) -> eviction_pb2.CommandsResponse:
    return eviction_pb2.CommandsResponse(command_id=command_id, drain=eviction_pb2.DrainCommand())


def acks(sent: list[eviction_pb2.CommandsRequest]) -> list[tuple[str, bool, str]]:
    return [(m.ack.command_id, m.ack.ok, m.ack.error) for m in sent if m.HasField("ack")]


class Engine:
    def __init__(self, fail: bool = False) -> None:
        self.released: list[str] = []
        self.drains = 0
        self.fail = fail

    def release(self, request_id: str) -> None:
        if self.fail:
            raise RuntimeError("no such request")
        self.released.append(request_id)

    def drain(self) -> None:
        self.drains += 1


async def _run(
    cp: ControlPlane, stream: CommandStream, evict: FakeEviction
) -> list[list[eviction_pb2.CommandsRequest]]:
    """Runs the stream until the scripts are used up; what the agent sent on each stream."""
    cp.session_ready.set()
    await asyncio.wait_for(stream.run(), 10)
    return [await call.finished() for call in evict.calls]


async def test_a_stream_opens_with_hello_and_each_release_is_applied_and_acked() -> None:
    cp, _, evict = plane()
    engine = Engine()
    evict.scripts.append(([release("c1", "r1"), release("c2", "r2")], None))
    stream = CommandStream(cp, engine.release, engine.drain, None)
    first, _ = await _run(cp, stream, evict)
    hello = first[0].hello
    assert (hello.node_id, hello.incarnation) == ("d0", "life-1")
    assert acks(first) == [("c1", True, ""), ("c2", True, "")]
    assert engine.released == ["r1", "r2"] and stream.applied == 2
    assert set(cp.call_metadata) <= set(evict.metadata[0]), "the node's credentials go with the stream"
    assert evict.calls[0].cancelled, "the ended call is cancelled, so nothing stays open"


async def test_a_command_sent_again_is_acked_but_applied_once() -> None:
    cp, _, evict = plane()
    engine = Engine()
    evict.scripts += [
        ([release("c1", "r1")], rpc_error(grpc.StatusCode.UNAVAILABLE)),
        ([release("c1", "r1")], None),
    ]
    stream = CommandStream(cp, engine.release, engine.drain, None)
    first, second, _ = await _run(cp, stream, evict)
    assert acks(first) == acks(second) == [("c1", True, "")]
    assert engine.released == ["r1"] and stream.duplicates == 1 and stream.opened == 3


async def test_only_so_many_command_ids_are_remembered() -> None:
    cp, _, evict = plane(seen_commands_max=1)
    engine = Engine()
    evict.scripts.append(([release("c1", "r1"), release("c2", "r2"), release("c1", "r1")], None))
    stream = CommandStream(cp, engine.release, engine.drain, None)
    await _run(cp, stream, evict)
    assert engine.released == ["r1", "r2", "r1"], "c1 was forgotten when c2 came"


async def test_a_drain_is_applied_where_the_engine_can_drain_and_refused_where_it_cannot() -> None:
    cp, _, evict = plane()
    engine = Engine()
    evict.scripts.append(([drain("c1")], None))
    await _run(cp, CommandStream(cp, engine.release, engine.drain, None), evict)
    assert engine.drains == 1
    cp, _, evict = plane()
    evict.scripts.append(([drain("c1")], None))
    [sent, _] = await _run(cp, CommandStream(cp, engine.release, None, None), evict)
    assert acks(sent) == [("c1", False, "this engine cannot drain")]


async def test_a_command_that_fails_or_is_unknown_is_acked_as_failed_and_may_be_sent_again() -> None:
    cp, _, evict = plane()
    engine = Engine(fail=True)
    unknown = eviction_pb2.CommandsResponse(command_id="c2")
    evict.scripts.append(([release("c1", "r1"), unknown, release("c1", "r1")], None))
    stream = CommandStream(cp, engine.release, engine.drain, None)
    [sent, _] = await _run(cp, stream, evict)
    assert acks(sent) == [
        ("c1", False, "RuntimeError: no such request"),
        ("c2", False, "unknown command None"),
        ("c1", False, "RuntimeError: no such request"),
    ]
    assert stream.applied == 0 and stream.duplicates == 0


async def test_a_refused_stream_is_noted_and_opened_again() -> None:
    cp, _, evict = plane()
    evict.scripts.append(([], rpc_error(grpc.StatusCode.UNAUTHENTICATED, "bad token")))
    stream = CommandStream(cp, Engine().release, None, None)
    await _run(cp, stream, evict)
    assert stream.opened == 2 and cp.rpc_errors == 1


async def test_the_engines_demand_goes_out_on_the_same_stream() -> None:
    cp, _, evict = plane(demand_refresh_s=3600)
    demand = DemandReporter(cp, lambda: 9)
    demand.attach(asyncio.get_running_loop())
    evict.scripts.append(([release("c1", "r1")], None))
    evict.ready = lambda sent, commands: (
        any(m.HasField("demand") for m in sent) and len(acks(sent)) >= commands
    )
    engine = Engine()
    [sent, _] = await _run(cp, CommandStream(cp, engine.release, None, demand), evict)
    assert sent[0].HasField("hello") and [m.demand.blocks for m in sent if m.HasField("demand")] == [9]
