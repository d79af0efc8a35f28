"""The node agent against the real metadata service and etcd, and a real gRPC eviction stream."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence

import grpc
import pytest

from kvplane.connector.node_agent.agent import NodeAgent
from kvplane.connector.node_agent.settings import NodeAgentSettings
from kvplane.services.common.model.handles import KvTier
from kvplane.services.common.model.nodes import Node, NodeLoad
from kvplane.services.common.runtime.ports import free_port
from kvplane.services.process import ServiceProcess
from kvplane.v1 import eviction_pb2, eviction_pb2_grpc, handle_pb2, metadata_pb2, metadata_pb2_grpc
from tests.conftest import MESH_CREDENTIALS, OPERATOR_HEADERS, make_node, tenant_headers
from tests.support.factories import make_handle
from tests.support.polling import eventually, until


class Recorder:
    """Thread-safe record of what the agent's callbacks were given."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.released: list[str] = []
        self.drains = 0

    def on_release(self, remote_request_id: str) -> None:
        with self._lock:
            self.released.append(remote_request_id)

    def on_drain(self) -> None:
        with self._lock:
            self.drains += 1


def fast_settings(target: str, **overrides: object) -> NodeAgentSettings:
    values: dict[str, object] = {
        "metadata_target": target,
        "lease_ttl_s": 3,
        "load_interval_s": 0.1,
        "backoff_initial_s": 0.02,
        "backoff_max_s": 0.3,
        "rpc_timeout_s": 1.0,
        "credentials": MESH_CREDENTIALS,
    }
    values.update(overrides)
    return NodeAgentSettings(**values)  # type: ignore[arg-type]


@pytest.fixture
def agents() -> Iterator[list[NodeAgent]]:
    started: list[NodeAgent] = []
    yield started
    for agent in started:
        agent.stop(timeout_s=5.0)


@pytest.fixture
def start_agent(agents: list[NodeAgent]) -> Callable[..., tuple[NodeAgent, Recorder]]:
    def start(
        settings: NodeAgentSettings, node: Node, load: NodeLoad | None = None
    ) -> tuple[NodeAgent, Recorder]:
        recorder = Recorder()
        agent = NodeAgent(
            settings,
            node,
            lambda: (
                load or NodeLoad(node.node_id, "", running_requests=3, free_kv_blocks=7, total_kv_blocks=9)
            ),
            recorder.on_release,
            on_drain=recorder.on_drain,
        )
        agent.start()
        agents.append(agent)
        return agent, recorder

    return start


async def list_nodes(channel: grpc.aio.Channel) -> list[metadata_pb2.NodeStatus]:
    response = await metadata_pb2_grpc.MetadataServiceStub(channel).ListNodes(
        metadata_pb2.ListNodesRequest(), metadata=OPERATOR_HEADERS
    )
    return list(response.nodes)


async def get_handle(channel: grpc.aio.Channel, conversation: str) -> metadata_pb2.GetHandleResponse | None:
    try:
        result: metadata_pb2.GetHandleResponse = await metadata_pb2_grpc.MetadataServiceStub(
            channel
        ).GetHandle(
            metadata_pb2.GetHandleRequest(tenant="acme", conversation=conversation), metadata=OPERATOR_HEADERS
        )
        return result
    except grpc.aio.AioRpcError as err:
        if err.code() == grpc.StatusCode.NOT_FOUND:
            return None
        raise


def target_of(process: ServiceProcess) -> str:
    return f"127.0.0.1:{process.grpc_port}"


async def test_agent_registers_under_a_new_incarnation_and_reports_load(
    metadata_process: ServiceProcess,
    metadata_channel: grpc.aio.Channel,
    start_agent: Callable[..., tuple[NodeAgent, Recorder]],
) -> None:
    agent, _ = start_agent(fast_settings(target_of(metadata_process)), make_node("d-load", incarnation=""))

    async def registered_with_load() -> metadata_pb2.NodeStatus | None:
        for status in await list_nodes(metadata_channel):
            if status.node.node_id == "d-load" and status.load.running_requests == 3:
                return status
        return None

    status = await eventually(registered_with_load, what="node registered with its load")
    assert status.node.incarnation == agent.incarnation != ""
    assert (status.load.free_kv_blocks, status.load.total_kv_blocks) == (7, 9)
    assert status.load.incarnation == agent.incarnation


async def test_published_handle_is_stored_then_removed_when_released(
    metadata_process: ServiceProcess,
    metadata_channel: grpc.aio.Channel,
    start_agent: Callable[..., tuple[NodeAgent, Recorder]],
) -> None:
    node = make_node("d-pub", incarnation="")
    agent, _ = start_agent(fast_settings(target_of(metadata_process)), node)
    # The agent stamps holder node and incarnation; the caller need not know them.
    handle = dataclasses.replace(
        make_handle(node, conversation="conv-pub", request_id="cmpl-pub-1"), handle_id="h-pub-1"
    )
    agent.publish(handle)

    stored = await eventually(lambda: get_handle(metadata_channel, "conv-pub"), what="handle published")
    assert stored.handle.handle_id == handle.handle_id
    assert stored.handle.holder_node_id == "d-pub"
    assert stored.handle.holder_incarnation == agent.incarnation
    assert stored.handle.vllm.remote_request_id == "cmpl-pub-1"

    agent.report_released("cmpl-pub-1")

    async def gone() -> bool:
        return await get_handle(metadata_channel, "conv-pub") is None

    await eventually(gone, what="handle removed after ReportReleased")
    assert agent.stats().published == 1 and agent.stats().released_reported == 1


async def test_restart_registers_a_new_incarnation(
    metadata_process: ServiceProcess,
    metadata_channel: grpc.aio.Channel,
    start_agent: Callable[..., tuple[NodeAgent, Recorder]],
) -> None:
    agent, _ = start_agent(fast_settings(target_of(metadata_process)), make_node("d-restart", incarnation=""))
    await until(lambda: agent.stats().registered, "first registration")
    first = agent.incarnation
    agent.stop()
    agent.start()
    second = agent.incarnation
    assert second != first

    async def shows_second() -> bool:
        return any(s.node.incarnation == second for s in await list_nodes(metadata_channel))

    await eventually(shows_second, what="new incarnation registered")


async def test_agent_registers_again_when_its_lease_is_gone(
    metadata_process: ServiceProcess,
    metadata_channel: grpc.aio.Channel,
    start_agent: Callable[..., tuple[NodeAgent, Recorder]],
) -> None:
    agent, _ = start_agent(fast_settings(target_of(metadata_process)), make_node("d-lease", incarnation=""))
    await until(lambda: agent.stats().registered, "first registration")
    # An operator removes the node: its lease is revoked, and KeepAlive answers NOT_FOUND.
    await metadata_pb2_grpc.MetadataServiceStub(metadata_channel).DeregisterNode(
        metadata_pb2.DeregisterNodeRequest(node_id="d-lease", incarnation=agent.incarnation),
        metadata=OPERATOR_HEADERS,
    )

    async def back() -> bool:
        present = any(s.node.node_id == "d-lease" for s in await list_nodes(metadata_channel))
        return present and agent.stats().registrations >= 2

    await eventually(back, timeout_s=15.0, what="re-registration after lease loss")


async def test_unreachable_control_plane_never_blocks_and_drops_oldest(
    start_agent: Callable[..., tuple[NodeAgent, Recorder]],
) -> None:
    node = make_node("d-offline", incarnation="")
    agent, _ = start_agent(fast_settings(f"127.0.0.1:{free_port()}", queue_max=3), node)
    t0 = time.perf_counter()
    for i in range(5):
        agent.publish(make_handle(node, conversation=f"c{i}", request_id=f"r{i}"))
    agent.report_released("r0")
    elapsed = time.perf_counter() - t0
    assert elapsed < 0.05
    stats = agent.stats()
    assert (stats.queued, stats.dropped, stats.registered) == (3, 3, False)
    handles, releases = agent.pending()
    assert [h.conversation for h in handles] == ["c3", "c4"] and releases == ["r0"]
    t0 = time.perf_counter()
    agent.stop(timeout_s=5.0)
    assert time.perf_counter() - t0 < 3.0


# ---------------------------------------------------------------------------- eviction commands


class ScriptedCoordinator(eviction_pb2_grpc.EvictionServiceServicer):
    """A coordinator whose every stream replays the same commands, then ends the stream."""

    def __init__(self, commands: list[eviction_pb2.CommandsResponse]) -> None:
        self.commands = commands
        self.hellos: list[eviction_pb2.NodeHello] = []
        self.acks: list[eviction_pb2.CommandAck] = []

    async def Commands(
        self, request_iterator: AsyncIterator[eviction_pb2.CommandsRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[eviction_pb2.CommandsResponse]:
        first = await request_iterator.__anext__()
        self.hellos.append(first.hello)
        for command in self.commands:
            yield command
        # Every command is acked but a spill order, a hint.
        wanted = len(self.acks) + sum(c.WhichOneof("command") != "spill_order" for c in self.commands)
        async for message in request_iterator:
            self.acks.append(message.ack)
            if len(self.acks) >= wanted:
                return


@pytest.fixture
async def coordinator() -> AsyncIterator[tuple[ScriptedCoordinator, str]]:
    servicer = ScriptedCoordinator(
        [
            eviction_pb2.CommandsResponse(
                command_id="cmd-1",
                release=eviction_pb2.ReleaseCommand(tenant="acme", remote_request_id="r-1"),
            ),
            eviction_pb2.CommandsResponse(
                command_id="cmd-1",
                release=eviction_pb2.ReleaseCommand(tenant="acme", remote_request_id="r-1"),
            ),
            eviction_pb2.CommandsResponse(command_id="cmd-2", drain=eviction_pb2.DrainCommand()),
        ]
    )
    server = grpc.aio.server()
    eviction_pb2_grpc.add_EvictionServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


async def test_release_commands_are_applied_once_and_every_command_is_acked(
    metadata_process: ServiceProcess,
    coordinator: tuple[ScriptedCoordinator, str],
    start_agent: Callable[..., tuple[NodeAgent, Recorder]],
) -> None:
    servicer, eviction_target = coordinator
    agent, recorder = start_agent(
        fast_settings(target_of(metadata_process), eviction_target=eviction_target),
        make_node("d-cmd", incarnation=""),
    )
    # Each stream replays cmd-1 twice and cmd-2 once; wait for two streams' worth of acks.
    await until(lambda: len(servicer.acks) >= 6, "acks from two streams")
    assert recorder.released == ["r-1"]
    assert recorder.drains == 1
    assert all(ack.ok for ack in servicer.acks)
    assert [ack.command_id for ack in servicer.acks[:3]] == ["cmd-1", "cmd-1", "cmd-2"]
    assert servicer.hellos[0].node_id == "d-cmd" and servicer.hellos[0].incarnation == agent.incarnation
    stats = agent.stats()
    assert stats.commands_applied == 2 and stats.commands_duplicate >= 4
    assert stats.command_streams_opened >= 2


def _release(command_id: str, request_id: str, *, ack_records_freed: bool) -> eviction_pb2.CommandsResponse:
    return eviction_pb2.CommandsResponse(
        command_id=command_id,
        release=eviction_pb2.ReleaseCommand(
            tenant="acme", remote_request_id=request_id, ack_records_freed=ack_records_freed
        ),
    )


async def test_blocks_a_release_commands_ack_records_are_not_reported_freed_again(
    metadata_process: ServiceProcess, agents: list[NodeAgent]
) -> None:
    servicer = ScriptedCoordinator(
        [
            _release("cmd-acked", "r-acked", ack_records_freed=True),
            _release("cmd-plain", "r-plain", ack_records_freed=False),
            _release("cmd-failing", "r-failing", ack_records_freed=True),
        ]
    )
    server = grpc.aio.server()
    eviction_pb2_grpc.add_EvictionServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    holder: list[NodeAgent] = []

    def on_release(request_id: str) -> None:
        # As the sim-engine does: the blocks are freed, and reported, inside the call.
        if request_id == "r-failing":
            raise RuntimeError("the engine could not free them now")
        holder[0].report_released(request_id)

    node = make_node("d-acked", incarnation="")
    agent = NodeAgent(
        fast_settings(target_of(metadata_process), eviction_target=f"127.0.0.1:{port}"),
        node,
        lambda: NodeLoad(node.node_id, "", running_requests=0, free_kv_blocks=7, total_kv_blocks=9),
        on_release,
    )
    holder.append(agent)
    try:
        agent.start()
        agents.append(agent)
        await until(lambda: len(servicer.acks) >= 3, "the three commands acked")
        assert [(a.command_id, a.ok) for a in servicer.acks[:3]] == [
            ("cmd-acked", True),
            ("cmd-plain", True),
            ("cmd-failing", False),
        ]
        # The engine frees the blocks it could not free then, later, on its own: reported.
        agent.report_released("r-failing")
        # Reports go out in order: once the last is sent, any report queued before it was too.
        await until(
            lambda: agent.stats().released_reported >= 2 and agent.pending() == ([], []),
            "the reports sent",
        )
        assert agent.stats().released_reported == 2, "r-plain and r-failing, not r-acked"
    finally:
        await server.stop(0)


async def test_an_engine_with_a_host_tier_asks_for_spill_orders_and_is_handed_each_unacked(
    metadata_process: ServiceProcess, agents: list[NodeAgent]
) -> None:
    order = eviction_pb2.SpillOrder(device_request_ids=["r-young", "r-old"], host_request_ids=["r-h"])
    servicer = ScriptedCoordinator(
        [eviction_pb2.CommandsResponse(spill_order=order), _release("cmd-r", "r-1", ack_records_freed=True)]
    )
    server = grpc.aio.server()
    eviction_pb2_grpc.add_EvictionServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    orders: list[tuple[tuple[str, ...], tuple[str, ...]]] = []
    lock = threading.Lock()

    def on_spill_order(device: Sequence[str], host: Sequence[str]) -> None:
        with lock:
            orders.append((tuple(device), tuple(host)))

    try:
        for node_id, callback in (("d-host", on_spill_order), ("d-plain", None)):
            node = make_node(node_id, incarnation="")
            agent = NodeAgent(
                fast_settings(target_of(metadata_process), eviction_target=f"127.0.0.1:{port}"),
                node,
                lambda: NodeLoad("", "", running_requests=0, free_kv_blocks=7, total_kv_blocks=9),
                lambda _request_id: None,
                on_spill_order=callback,
            )
            agent.start()
            agents.append(agent)
        await until(lambda: {h.node_id for h in servicer.hellos} == {"d-host", "d-plain"}, "both hellos")
        await until(lambda: agents[0].stats().spill_orders >= 2, "the order handed to the engine")
        await until(lambda: len(servicer.acks) >= 2, "the releases acked")
        wants = {h.node_id: h.wants_spill_order for h in servicer.hellos}
        assert wants == {"d-host": True, "d-plain": False}
        with lock:
            # Each stream starts the engine over from no order (oldest first), then the leader's.
            assert orders[:2] == [((), ()), (("r-young", "r-old"), ("r-h",))]
        assert {a.command_id for a in servicer.acks} == {"cmd-r"}, "the order itself is never acked"
        assert agents[1].stats().spill_orders == 0, "a node that did not ask takes none"
    finally:
        await server.stop(0)


async def test_an_engine_that_takes_moves_says_so_and_acks_each_as_the_engine_answers(
    metadata_process: ServiceProcess, agents: list[NodeAgent]
) -> None:
    def move(command_id: str, request_id: str) -> eviction_pb2.CommandsResponse:
        return eviction_pb2.CommandsResponse(
            command_id=command_id, move=eviction_pb2.MoveCommand(tenant="acme", remote_request_id=request_id)
        )

    servicer = ScriptedCoordinator([move("m-1", "r-ok"), move("m-2", "r-big"), move("m-3", "r-failing")])
    server = grpc.aio.server()
    eviction_pb2_grpc.add_EvictionServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    asked: list[str] = []
    lock = threading.Lock()

    def on_move(request_id: str) -> str:
        with lock:
            asked.append(request_id)
        if request_id == "r-failing":
            raise RuntimeError("engine stopped")
        return "too large for the host tier" if request_id == "r-big" else ""

    try:
        for node_id, callback in (("d-moves", on_move), ("d-plain", None)):
            agent = NodeAgent(
                fast_settings(target_of(metadata_process), eviction_target=f"127.0.0.1:{port}"),
                make_node(node_id, incarnation=""),
                lambda: NodeLoad("", "", running_requests=0, free_kv_blocks=7, total_kv_blocks=9),
                lambda _request_id: None,
                on_move=callback,
            )
            agent.start()
            agents.append(agent)
        no_tier = (False, "this engine has no host tier")
        # Each node's answer: the engine's, and that of the node without a host tier. (The
        # script replays its commands on every stream, so an answer may come more than once.)
        expected = {
            "m-1": {no_tier, (True, "")},
            "m-2": {no_tier, (False, "too large for the host tier")},
            "m-3": {no_tier, (False, "RuntimeError: engine stopped")},
        }

        def answers() -> dict[str, set[tuple[bool, str]]]:
            by_id: dict[str, set[tuple[bool, str]]] = {}
            for ack in list(servicer.acks):
                by_id.setdefault(ack.command_id, set()).add((ack.ok, ack.error))
            return by_id

        await until(lambda: answers() == expected, "every move answered by both nodes")
        assert {h.node_id: h.accepts_moves for h in servicer.hellos} == {"d-moves": True, "d-plain": False}
        with lock:
            assert sorted(set(asked)) == ["r-big", "r-failing", "r-ok"]
    finally:
        await server.stop(0)


async def test_missing_eviction_service_does_not_stop_publishing(
    metadata_process: ServiceProcess,
    metadata_channel: grpc.aio.Channel,
    start_agent: Callable[..., tuple[NodeAgent, Recorder]],
) -> None:
    # The metadata process serves no EvictionService: the stream fails with UNIMPLEMENTED.
    node = make_node("d-noevict", incarnation="")
    agent, _ = start_agent(fast_settings(target_of(metadata_process)), node)
    await until(lambda: agent.stats().command_streams_opened >= 2, "stream retries")
    agent.publish(make_handle(node, conversation="conv-noevict", request_id="r-ne"))
    await eventually(lambda: get_handle(metadata_channel, "conv-noevict"), what="handle published")


class ChangingLoad:
    """A load_fn whose value the test sets, counting the agent's samples."""

    def __init__(self, node_id: str) -> None:
        self._lock = threading.Lock()
        self.samples = 0
        self.load = NodeLoad(node_id, "", running_requests=1, free_kv_blocks=500, total_kv_blocks=1000)

    def __call__(self) -> NodeLoad:
        with self._lock:
            self.samples += 1
            return self.load

    def set(self, **changes: int) -> None:
        with self._lock:
            self.load = dataclasses.replace(self.load, **changes)


def start_with_load(
    agents: list[NodeAgent], settings: NodeAgentSettings, node: Node, load: ChangingLoad
) -> NodeAgent:
    agent = NodeAgent(settings, node, load, Recorder().on_release)
    agent.start()
    agents.append(agent)
    return agent


async def test_an_idle_agent_reports_its_load_once_however_often_it_samples_it(
    metadata_process: ServiceProcess, metadata_channel: grpc.aio.Channel, agents: list[NodeAgent]
) -> None:
    load = ChangingLoad("d-idle")
    settings = fast_settings(target_of(metadata_process), load_interval_s=0.02, load_heartbeat_s=3600.0)
    agent = start_with_load(agents, settings, make_node("d-idle", incarnation=""), load)

    async def sampled(n: int) -> bool:
        return load.samples >= n

    await eventually(lambda: sampled(40), what="40 samples of an unchanged load")
    assert agent.stats().load_reports == 1, "an unchanged load is reported once, at registration"

    # A change is reported at the next sample; a change smaller than 1% of the blocks is not.
    load.set(free_kv_blocks=495)
    before = load.samples
    await eventually(lambda: sampled(before + 10), what="10 more samples")
    assert agent.stats().load_reports == 1
    load.set(running_requests=2)

    async def reported() -> bool:
        loads = [s.load for s in await list_nodes(metadata_channel) if s.node.node_id == "d-idle"]
        return bool(loads) and loads[0].running_requests == 2

    await eventually(reported, what="the changed load in etcd")

    async def counted() -> bool:
        return agent.stats().load_reports >= 2

    # etcd may show the report before the agent's call has returned and counted it.
    await eventually(counted, what="the second report counted")
    assert agent.stats().load_reports == 2


async def test_a_quiet_agent_still_reports_its_load_every_heartbeat(
    metadata_process: ServiceProcess, metadata_channel: grpc.aio.Channel, agents: list[NodeAgent]
) -> None:
    load = ChangingLoad("d-quiet")
    settings = fast_settings(target_of(metadata_process), load_interval_s=0.02, load_heartbeat_s=0.2)
    agent = start_with_load(agents, settings, make_node("d-quiet", incarnation=""), load)

    async def reports(n: int) -> bool:
        return agent.stats().load_reports >= n

    async def stamp() -> int:
        statuses = await list_nodes(metadata_channel)
        return next(s.load.reported_unix_ms for s in statuses if s.node.node_id == "d-quiet")

    await eventually(lambda: reports(2), what="a heartbeat report of an unchanged load")
    first = await stamp()
    count = agent.stats().load_reports

    async def newer() -> bool:
        return agent.stats().load_reports > count and await stamp() > first

    await eventually(newer, what="the next heartbeat, stamped later")


def test_a_heartbeat_shorter_than_the_sampling_period_is_refused() -> None:
    with pytest.raises(ValueError, match="load_heartbeat_s"):
        NodeAgentSettings(metadata_target="x:1", load_interval_s=1.0, load_heartbeat_s=0.5)


async def test_an_engine_that_says_its_load_changed_has_it_sampled_at_once_but_not_written_to_etcd(
    metadata_process: ServiceProcess, metadata_channel: grpc.aio.Channel, agents: list[NodeAgent]
) -> None:
    # Sampled once an hour: only the engine's word makes the agent look again within the test.
    load = ChangingLoad("d-told")
    settings = fast_settings(target_of(metadata_process), load_interval_s=3600.0, load_heartbeat_s=3600.0)
    agent = start_with_load(agents, settings, make_node("d-told", incarnation=""), load)

    async def first_reported() -> bool:
        return agent.stats().load_reports >= 1

    await eventually(first_reported, what="the load reported at registration")
    # A request finished: the engine's load changed, and it says so, twice.
    load.set(running_requests=0, free_kv_blocks=100)
    for n in (1, 2):
        before = load.samples
        agent.notify_load()

        async def sampled(before: int = before) -> bool:
            return load.samples > before

        await eventually(sampled, what=f"notified sample {n}")
    # The first notified sample was decided on before the second was taken: the streams to
    # routing carry it (test_routing_prefix_cache_stream), etcd hears only the interval's samples.
    assert agent.stats().load_reports == 1
    stored = [s.load for s in await list_nodes(metadata_channel) if s.node.node_id == "d-told"]
    assert stored and stored[0].free_kv_blocks == 500


async def test_a_relocation_of_a_handle_checked_out_meanwhile_is_refused_and_counted(
    metadata_process: ServiceProcess,
    metadata_channel: grpc.aio.Channel,
    start_agent: Callable[..., tuple[NodeAgent, Recorder]],
) -> None:
    node = make_node("d-move", incarnation="")
    agent, _ = start_agent(fast_settings(target_of(metadata_process)), node)
    handle = dataclasses.replace(
        make_handle(node, conversation="conv-move", request_id="cmpl-move-1"), handle_id="h-move-1"
    )
    outcomes: list[tuple[str, bool]] = []
    agent.publish(handle, on_outcome=lambda stored: outcomes.append(("handle", stored)))
    await eventually(lambda: get_handle(metadata_channel, "conv-move"), what="handle published")
    await metadata_pb2_grpc.MetadataServiceStub(metadata_channel).CheckOutHandle(
        metadata_pb2.CheckOutHandleRequest(conversation="conv-move"), metadata=tenant_headers("acme")
    )

    moved = dataclasses.replace(
        handle, handle_id="h-move-2", tier=KvTier.HOST, relocates_handle_id="h-move-1"
    )
    agent.publish(moved, on_outcome=lambda stored: outcomes.append(("moved", stored)))

    await until(lambda: agent.stats().relocations_refused == 1, "the refusal")
    assert agent.stats().published == 2 and agent.stats().dropped == 0
    # The engine is told (it keeps the blocks for the check-out to read).
    await until(lambda: len(outcomes) == 2, "both outcomes")
    assert outcomes == [("handle", True), ("moved", False)]
    # The check-out stands; nothing was stored over it.
    view = await get_handle(metadata_channel, "conv-move")
    assert view is not None and view.handle.handle_id == "h-move-1"
    assert view.state == handle_pb2.HANDLE_STATE_CHECKED_OUT


async def test_a_stored_relocation_is_told_to_the_engine(
    metadata_process: ServiceProcess,
    metadata_channel: grpc.aio.Channel,
    start_agent: Callable[..., tuple[NodeAgent, Recorder]],
) -> None:
    node = make_node("d-moved", incarnation="")
    agent, _ = start_agent(fast_settings(target_of(metadata_process)), node)
    handle = dataclasses.replace(
        make_handle(node, conversation="conv-moved", request_id="cmpl-moved-1"), handle_id="h-moved-1"
    )
    agent.publish(handle)
    await eventually(lambda: get_handle(metadata_channel, "conv-moved"), what="handle published")
    outcomes: list[bool] = []
    moved = dataclasses.replace(
        handle, handle_id="h-moved-2", tier=KvTier.HOST, relocates_handle_id="h-moved-1"
    )
    agent.publish(moved, on_outcome=outcomes.append)
    await until(lambda: outcomes == [True], "the move stored")
    view = await get_handle(metadata_channel, "conv-moved")
    assert view is not None and view.handle.handle_id == "h-moved-2"
    assert view.handle.tier == handle_pb2.KV_TIER_HOST


async def test_a_publish_the_control_plane_rejects_is_dropped_and_told_as_not_stored(
    metadata_process: ServiceProcess,
    start_agent: Callable[..., tuple[NodeAgent, Recorder]],
) -> None:
    node = make_node("d-bad", incarnation="")
    agent, _ = start_agent(fast_settings(target_of(metadata_process)), node)
    outcomes: list[bool] = []
    bad = dataclasses.replace(
        make_handle(node, conversation="conv-bad", request_id="cmpl-bad"), conversation=""
    )
    agent.publish(bad, on_outcome=outcomes.append)
    await until(lambda: outcomes == [False], "the rejection told")
    assert agent.stats().published == 0


class HoldingCoordinator(eviction_pb2_grpc.EvictionServiceServicer):
    """A coordinator that sends one move on every stream and then holds the stream open: a second
    hello comes only from the agent reopening it."""

    def __init__(self) -> None:
        self.hellos: list[eviction_pb2.NodeHello] = []
        self.acks: list[eviction_pb2.CommandAck] = []

    async def Commands(
        self, request_iterator: AsyncIterator[eviction_pb2.CommandsRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[eviction_pb2.CommandsResponse]:
        first = await request_iterator.__anext__()
        self.hellos.append(first.hello)
        yield eviction_pb2.CommandsResponse(
            command_id=f"m-{len(self.hellos)}",
            move=eviction_pb2.MoveCommand(tenant="acme", remote_request_id="r-1"),
        )
        async for message in request_iterator:
            if message.HasField("ack"):
                self.acks.append(message.ack)


async def test_an_engine_whose_host_tier_is_switched_says_so_in_a_new_hello_and_refuses_moves_while_off(
    metadata_process: ServiceProcess, agents: list[NodeAgent]
) -> None:
    servicer = HoldingCoordinator()
    server = grpc.aio.server()
    eviction_pb2_grpc.add_EvictionServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    moved: list[str] = []

    def on_move(request_id: str) -> str:
        moved.append(request_id)
        return ""

    try:
        agent = NodeAgent(
            fast_settings(target_of(metadata_process), eviction_target=f"127.0.0.1:{port}"),
            make_node("d-switch", incarnation=""),
            lambda: NodeLoad("", "", running_requests=0, free_kv_blocks=7, total_kv_blocks=9),
            lambda _request_id: None,
            on_move=on_move,
        )
        agent.start()
        agents.append(agent)

        def said() -> list[bool]:
            return [h.accepts_moves for h in servicer.hellos]

        def answered() -> list[tuple[str, bool, str]]:
            return [(a.command_id, a.ok, a.error) for a in servicer.acks]

        await until(lambda: answered() == [("m-1", True, "")], "the first stream's move applied")
        agent.set_accepts_moves(False)
        await until(lambda: said() == [True, False], "the stream reopened, saying no moves")
        await until(lambda: len(answered()) == 2, "the second stream's move answered")
        assert answered()[1] == ("m-2", False, "this engine's host tier is off")
        agent.set_accepts_moves(False)  # no change: the stream stays as it is
        agent.set_accepts_moves(True)
        await until(lambda: said() == [True, False, True], "reopened again, taking moves")
        await until(lambda: answered()[2:] == [("m-3", True, "")], "the third stream's move applied")
        assert moved == ["r-1", "r-1"]
    finally:
        await server.stop(0)
