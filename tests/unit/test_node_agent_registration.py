"""The node's registration: RegisterNode under this life's incarnation, KeepAlive at a third of the
granted lease, registering again when the control plane no longer knows the node, and reconciling
the handles the engine holds after each registration."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterable

import grpc
import pytest

from kvplane.connector.node_agent.control_plane import ControlPlane
from kvplane.connector.node_agent.outbox import Item, Outbox
from kvplane.connector.node_agent.registration import MAX_RECONCILE_BATCH, Registration
from kvplane.v1 import metadata_pb2
from tests.unit.node_agent_fakes import FakeMetadata, handle, plane, rpc_error, until


class Running:
    def __init__(
        self, cp: ControlPlane, meta: FakeMetadata, registration: Registration, released: list[str]
    ) -> None:
        self.cp, self.meta, self.registration, self.released = cp, meta, registration, released


@pytest.fixture
async def running() -> AsyncIterator[Callable[..., Running]]:
    tasks: list[tuple[ControlPlane, asyncio.Task[None]]] = []

    def start(
        retained: Callable[[], Iterable[str]] | None = None, outbox: Outbox | None = None, **settings: object
    ) -> Running:
        cp, meta, _ = plane(**settings)
        released: list[str] = []
        registration = Registration(cp, outbox or Outbox(100, 10), released.append, retained)
        tasks.append((cp, asyncio.create_task(registration.run())))
        return Running(cp, meta, registration, released)

    yield start
    for cp, _ in tasks:
        assert cp.stopping is not None
        cp.stopping.set()
        cp.reregister.set()
    await asyncio.wait_for(asyncio.gather(*(t for _, t in tasks)), 10)


async def test_the_node_registers_under_this_lives_incarnation_and_opens_its_session(
    running: Callable[..., Running],
) -> None:
    r = running(lease_ttl_s=30)
    await until(lambda: r.cp.session_ready.is_set(), "the registration")
    [request] = r.meta.RegisterNode.requests
    assert request.node.node_id == "d0" and request.node.incarnation == "life-1" and request.lease_ttl_s == 30
    assert request.node.registered_unix_ms > 0
    assert r.cp.registered and r.cp.registrations == 1
    assert set(r.cp.call_metadata) <= set(r.meta.RegisterNode.metadata[0])


async def test_the_lease_is_kept_alive_at_a_third_of_the_ttl_granted(running: Callable[..., Running]) -> None:
    r = running(lease_ttl_s=30)  # asked for 30 s; the fake grants 3 s, so a KeepAlive each second
    await until(lambda: len(r.meta.KeepAlive.requests) >= 2, "two KeepAlives", timeout_s=20)
    ka = r.meta.KeepAlive.requests[0]
    assert (ka.node_id, ka.incarnation, ka.lease_id) == ("d0", "life-1", 0x51)
    assert r.cp.registrations == 1


async def test_a_node_the_control_plane_no_longer_knows_registers_again(
    running: Callable[..., Running],
) -> None:
    r = running()
    r.meta.KeepAlive.replies.append(rpc_error(grpc.StatusCode.NOT_FOUND, "no such node"))
    await until(lambda: r.cp.registrations == 2, "the second registration", timeout_s=20)
    assert r.cp.registered and r.cp.rpc_errors == 1


async def test_a_failed_keepalive_is_sent_again_promptly_not_a_lease_interval_later(
    running: Callable[..., Running],
) -> None:
    r = running()
    r.meta.RegisterNode.default = metadata_pb2.RegisterNodeResponse(lease_id=7, lease_ttl_s=300)
    r.meta.KeepAlive.replies.append(rpc_error(grpc.StatusCode.UNAVAILABLE))
    # The first KeepAlive comes after a hundred seconds; wake it now, as a reregister request would.
    await until(lambda: r.cp.session_ready.is_set(), "the registration")
    r.cp.reregister.set()
    await until(
        lambda: len(r.meta.KeepAlive.requests) >= 2, "the KeepAlive to be retried within half a second"
    )
    assert r.cp.registrations == 1, "the lease runs on while the control plane restarts"


async def test_registration_is_retried_until_the_control_plane_takes_it(
    running: Callable[..., Running],
) -> None:
    r = running()
    r.meta.RegisterNode.replies += [rpc_error(grpc.StatusCode.UNAVAILABLE)] * 2
    await until(lambda: r.cp.registered, "the third RegisterNode to succeed")
    assert len(r.meta.RegisterNode.requests) == 3 and r.cp.rpc_errors == 2


async def test_after_registering_the_engine_frees_what_nothing_references_unless_it_is_being_published(
    running: Callable[..., Running],
) -> None:
    box = Outbox(100, 10)
    box.put(Item("publish", handle=handle("c")))
    r = running(retained=lambda: ["a", "b", "c", "a"], outbox=box)
    r.meta.ReconcileRetained.default = metadata_pb2.ReconcileRetainedResponse(
        unreferenced_request_ids=["a", "c"]
    )
    await until(lambda: r.registration.reconciled_freed == 1, "the reconciliation")
    [request] = r.meta.ReconcileRetained.requests
    assert (request.node_id, request.incarnation) == ("d0", "life-1")
    assert list(request.remote_request_ids) == ["a", "b", "c"], "each id once"
    assert r.released == ["a"], "c is still queued for its publish: it will be referenced"


async def test_many_retained_handles_are_reconciled_in_batches_the_api_accepts(
    running: Callable[..., Running],
) -> None:
    held = [f"r{i}" for i in range(MAX_RECONCILE_BATCH + 3)]
    r = running(retained=lambda: held)
    await until(lambda: len(r.meta.ReconcileRetained.requests) == 2, "two ReconcileRetained calls")
    assert [len(q.remote_request_ids) for q in r.meta.ReconcileRetained.requests] == [MAX_RECONCILE_BATCH, 3]


async def test_a_failed_reconciliation_frees_nothing(running: Callable[..., Running]) -> None:
    r = running(retained=lambda: ["a"])
    r.meta.ReconcileRetained.replies.append(rpc_error(grpc.StatusCode.UNAVAILABLE))
    r.meta.ReconcileRetained.default = metadata_pb2.ReconcileRetainedResponse(unreferenced_request_ids=["a"])
    await until(
        lambda: r.meta.ReconcileRetained.requests and r.cp.rpc_errors == 1, "the failed reconciliation"
    )
    assert r.released == [] and r.registration.reconciled_freed == 0


async def test_without_a_retained_hook_nothing_is_reconciled(running: Callable[..., Running]) -> None:
    r = running()
    await until(lambda: len(r.meta.KeepAlive.requests) >= 1, "a KeepAlive after the registration")
    assert r.meta.ReconcileRetained.requests == []
