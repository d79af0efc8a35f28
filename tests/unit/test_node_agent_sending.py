"""The node agent's sender: publishes and release reports from the outbox, in order, batched by kind,
release reports riding in the call of the publishes behind them; what a failure does to the batch;
and the publishes it gives up, freeing their blocks."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Literal

import grpc
import pytest

from kvplane.connector.node_agent.control_plane import ControlPlane
from kvplane.connector.node_agent.outbox import Item, Outbox
from kvplane.connector.node_agent.sending import Sender
from kvplane.v1 import metadata_pb2
from tests.unit.node_agent_fakes import NODE, FakeMetadata, handle, plane, rpc_error, until


def publish(request_id: str, **kw: object) -> Item:
    return Item("publish", handle=handle(request_id), **kw)  # type: ignore[arg-type]


def release(request_id: str, *, read: bool = False) -> Item:
    return Item("release", remote_request_id=request_id, lingers=read)


def outbox(*items: Item) -> Outbox:
    box = Outbox(queue_max=100, batch_max=10)
    for item in items:
        box.put(item)
    return box


async def test_a_batch_of_publishes_is_one_call_naming_this_life_of_the_node_as_holder() -> None:
    cp, meta, _ = plane()
    freed: list[str] = []
    sender = Sender(cp, outbox(publish("a"), publish("b"), release("c")), freed.append)
    assert await sender.send_one_batch() is True
    [request] = meta.PublishHandles.requests
    assert [h.vllm.remote_request_id for h in request.handles] == ["a", "b"]
    assert {(h.holder_node_id, h.holder_incarnation) for h in request.handles} == {(NODE.node_id, "life-1")}
    assert sender.published == 2 and meta.ReportReleased.requests == [], "a batch is of one kind"
    assert await sender.send_one_batch() is True
    [released] = meta.ReportReleased.requests
    assert (released.node_id, released.incarnation, list(released.remote_request_ids)) == (
        "d0",
        "life-1",
        ["c"],
    )
    assert sender.released_reported == 1
    assert await sender.send_one_batch() is False, "nothing left"
    assert freed == []


async def test_a_batch_joins_the_trace_of_its_first_traced_handle() -> None:
    cp, meta, _ = plane()
    traced = (("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"),)
    sender = Sender(cp, outbox(publish("a"), publish("b", trace_context=traced)), lambda _: None)
    await sender.send_one_batch()
    assert traced[0] in meta.PublishHandles.metadata[0]
    assert set(cp.call_metadata) <= set(meta.PublishHandles.metadata[0]), "with the node's own credentials"


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND])
async def test_a_batch_that_may_succeed_later_goes_back_to_the_head_marked_failing(
    code: grpc.StatusCode,
) -> None:
    cp, meta, _ = plane()
    box = outbox(publish("a"), publish("b"))
    meta.PublishHandles.replies.append(rpc_error(code))
    sender = Sender(cp, box, lambda _: None)
    before = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError):
        await sender.send_one_batch()
    assert [i.handle.vllm.remote_request_id for i in box.items() if i.handle] == ["a", "b"]
    assert all(i.failing_since >= before for i in box.items())
    assert await sender.send_one_batch() is True and sender.published == 2


async def test_a_batch_resending_cannot_help_is_dropped_and_counted() -> None:
    cp, meta, _ = plane()
    box = outbox(release("a"), release("b"))
    meta.ReportReleased.replies.append(rpc_error(grpc.StatusCode.INVALID_ARGUMENT, "bad id"))
    with pytest.raises(grpc.aio.AioRpcError):
        await Sender(cp, box, lambda _: None).send_one_batch()
    assert box.counts() == (0, 2)


async def test_a_handle_that_expired_before_its_publish_is_given_up_and_its_blocks_freed() -> None:
    cp, meta, _ = plane()
    freed: list[str] = []
    sender = Sender(
        cp, outbox(Item("publish", handle=handle("old", life_s=-1)), publish("new")), freed.append
    )
    assert await sender.send_one_batch() is True
    assert freed == ["old"] and sender.publishes_given_up == 1
    assert [h.vllm.remote_request_id for h in meta.PublishHandles.requests[0].handles] == ["new"]


async def test_a_publish_that_kept_failing_too_long_is_given_up_so_it_holds_up_nothing() -> None:
    cp, meta, _ = plane(publish_give_up_s=5.0)
    freed: list[str] = []
    stuck = publish("stuck", failing_since=time.monotonic() - 6.0)
    recent = publish("recent", failing_since=time.monotonic() - 1.0)
    sender = Sender(cp, outbox(stuck, recent), freed.append)
    assert await sender.send_one_batch() is True
    assert freed == ["stuck"] and [
        h.vllm.remote_request_id for h in meta.PublishHandles.requests[0].handles
    ] == ["recent"]


async def test_a_batch_given_up_whole_sends_nothing_and_a_failing_release_hook_stops_nothing() -> None:
    cp, meta, _ = plane()

    def broken(request_id: str) -> None:
        raise RuntimeError("engine gone")

    sender = Sender(cp, outbox(Item("publish", handle=handle("old", life_s=-1)), release("r")), broken)
    assert await sender.send_one_batch() is True and meta.PublishHandles.requests == []
    assert sender.publishes_given_up == 1
    assert await sender.send_one_batch() is True and sender.released_reported == 1


async def test_releases_ride_in_the_call_of_the_publish_queued_behind_them() -> None:
    cp, meta, _ = plane()
    sender = Sender(cp, outbox(release("r1"), release("r2"), publish("a")), lambda _: None)
    assert await sender.send_one_batch() is True
    [request] = meta.PublishHandles.requests
    assert list(request.released_remote_request_ids) == ["r1", "r2"]
    assert [h.vllm.remote_request_id for h in request.handles] == ["a"]
    assert meta.ReportReleased.requests == [], "no call of their own"
    assert (sender.published, sender.released_reported) == (1, 2)


async def test_releases_a_service_older_than_the_field_ignored_are_reported_alone_from_then_on() -> None:
    cp, meta, _ = plane()
    meta.PublishHandles.replies.append(metadata_pb2.PublishHandlesResponse())  # released_recorded 0
    box = outbox(release("r1"), publish("a"), release("r2"), publish("b"))
    sender = Sender(cp, box, lambda _: None)
    assert await sender.send_one_batch() is True
    assert [list(r.remote_request_ids) for r in meta.ReportReleased.requests] == [["r1"]]
    assert sender.releases_ride is False and sender.released_reported == 1
    assert await sender.send_one_batch() is True
    assert [list(r.remote_request_ids) for r in meta.ReportReleased.requests] == [["r1"], ["r2"]]
    assert list(meta.PublishHandles.requests[-1].released_remote_request_ids) == []
    assert (sender.published, sender.released_reported) == (2, 2)


async def test_a_failed_call_puts_the_releases_and_the_publishes_back_in_order() -> None:
    cp, meta, _ = plane()
    box = outbox(release("r1"), publish("a"), publish("b"))
    meta.PublishHandles.replies.append(rpc_error(grpc.StatusCode.UNAVAILABLE))
    sender = Sender(cp, box, lambda _: None)
    with pytest.raises(grpc.aio.AioRpcError):
        await sender.send_one_batch()
    assert [i.remote_request_id or (i.handle and i.handle.vllm.remote_request_id) for i in box.items()] == [
        "r1",
        "a",
        "b",
    ]
    assert (sender.published, sender.released_reported) == (0, 0)


class CountedEvent(asyncio.Event):
    """An event that counts the waits begun on it: a test can tell the sender is parked there."""

    def __init__(self) -> None:
        super().__init__()
        self.waits = 0

    async def wait(self) -> Literal[True]:
        self.waits += 1
        return await super().wait()


@contextlib.asynccontextmanager
async def running(sender: Sender, cp: ControlPlane, box: Outbox) -> AsyncIterator[CountedEvent]:
    """`sender.run()` as the agent runs it, on `box` woken by puts (the wake event, yielded);
    stopped on the way out."""
    wake = CountedEvent()
    box.attach(asyncio.get_running_loop(), wake)
    task = asyncio.create_task(sender.run())
    try:
        yield wake
    finally:
        cp.stopping.set()  # type: ignore[union-attr]
        box.wake.set()  # type: ignore[union-attr]
        await asyncio.wait_for(task, 10)


def linger_sender(linger_s: float, *items: Item) -> tuple[ControlPlane, FakeMetadata, Outbox, Sender]:
    """A sender whose read reports wait `linger_s` for a publish, over an outbox of `items`."""
    cp, meta, _ = plane(release_linger_s=linger_s)
    box = outbox(*items)
    return cp, meta, box, Sender(cp, box, lambda _: None)


async def test_a_release_waits_for_a_publish_to_ride_with() -> None:
    cp, meta, box, sender = linger_sender(3600.0, release("r1", read=True))
    async with running(sender, cp, box) as wake:
        cp.session_ready.set()
        await until(lambda: wake.waits == 1, "the sender to wait, with the release held, for what comes")
        assert meta.ReportReleased.requests == [] and meta.PublishHandles.requests == []
        box.put(publish("a"))
        await until(lambda: sender.published == 1, "the publish to take the release with it")
        [request] = meta.PublishHandles.requests
        assert list(request.released_remote_request_ids) == ["r1"]
        assert meta.ReportReleased.requests == []


async def test_a_release_no_publish_came_for_is_sent_alone_when_its_linger_runs_out() -> None:
    cp, meta, box, sender = linger_sender(0.2, release("r1", read=True))
    async with running(sender, cp, box):
        cp.session_ready.set()
        await until(lambda: sender.released_reported == 1, "the release to go alone")
        [request] = meta.ReportReleased.requests
        assert list(request.remote_request_ids) == ["r1"] and meta.PublishHandles.requests == []


async def test_the_sender_waits_for_the_session_sends_what_is_queued_and_retries_after_errors() -> None:
    cp, meta, _ = plane(release_linger_s=0.0)
    box = outbox(release("a"))
    meta.ReportReleased.replies.append(rpc_error(grpc.StatusCode.UNAVAILABLE))
    sender = Sender(cp, box, lambda _: None)
    cp.session_ready = session = CountedEvent()
    async with running(sender, cp, box):
        await until(lambda: session.waits == 1, "the sender to wait for the node's registration")
        assert meta.ReportReleased.requests == [], "nothing is sent before the node is registered"
        cp.session_ready.set()
        await until(lambda: sender.released_reported == 1, "the release to be reported after one error")
        assert cp.rpc_errors == 1
        box.put(release("b"))
        await until(lambda: sender.released_reported == 2, "a new item to wake the sender")


async def test_a_publish_refused_because_its_blocks_were_freed_frees_them_and_reports_nothing_stored() -> (
    None
):
    cp, meta, _ = plane()
    outcomes: list[bool] = []
    meta.PublishHandles.replies.append(
        metadata_pb2.PublishHandlesResponse(
            results=[
                metadata_pb2.PublishResult(handle_id="h-a"),
                metadata_pb2.PublishResult(blocks_freed=True),
            ]
        )
    )
    freed: list[str] = []
    box = outbox(publish("a", on_outcome=outcomes.append), publish("b", on_outcome=outcomes.append))
    sender = Sender(cp, box, freed.append)
    assert await sender.send_one_batch() is True
    # "b" came late (or was re-sent after its handle was read or released): the engine frees it
    # now, not at its TTL, and whoever asked is told it was not stored.
    assert freed == ["b"] and outcomes == [True, False]
    assert sender.publishes_refused_freed == 1 and sender.relocations_refused == 0
