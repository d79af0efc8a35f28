"""Every gRPC method of the control plane fed random wire bytes and random well-formed messages
(hypothesis, bounded in examples and time): never UNKNOWN or INTERNAL, never a hang, the server
alive afterwards, and nothing written to etcd by a call that was refused.

The control plane (metadata, routing, eviction, real etcd) runs on an event loop in its own
thread; the test calls it with a blocking channel, as hypothesis drives a plain function.
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Coroutine, Iterator
from typing import Any, TypeVar

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor, ServiceDescriptor
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvplane.services.dev.local_etcd import LocalEtcd
from kvplane.services.process import ServiceProcess
from tests.support.trust import (
    all_methods,
    bearer,
    method_id,
    plane_settings,
    start_plane,
    target,
    token_auth,
)

T = TypeVar("T")

# Methods only a node may call: fuzzed as node-a, the rest as the operator, so that requests
# get past authorization to validation.
NODE_METHODS = {
    "RegisterNode",
    "KeepAlive",
    "ReportLoad",
    "PublishHandles",
    "ReportReleased",
    "Commands",
    "StreamPrefixCache",
}
# Streams may stay open on valid input; they get a short deadline, and running out of it is fine.
STREAM_DEADLINE_S = 0.5
UNARY_DEADLINE_S = 10.0
NEVER = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}

# Strings that reach interesting paths: the callers' own names, hostile keys and hosts, limits.
INTERESTING_TEXT = st.sampled_from(
    ["", "node-a", "acme", "tiny", "d0", "evil/../x", "../../nodes/d0", "\x00", "a" * 129, "x" * 600, "[::1]"]
)


class Plane:
    """The control plane on its own event loop thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="fuzzed-plane", daemon=True)
        self.thread.start()
        self.process: ServiceProcess | None = None

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 60) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def written_since(self, revision: int) -> list[bytes]:
        """Keys (elections aside) written after `revision`."""
        assert self.process is not None
        store = self.process.store
        _, events = self.run(store.read_prefix(store.keys.prefix.encode()))
        return [e.key for e in events if e.mod_revision > revision and b"/election/" not in e.key]

    def revision(self) -> int:
        assert self.process is not None
        store = self.process.store
        revision, _ = self.run(store.read_prefix(store.keys.prefix.encode()))
        return revision

    def close(self) -> None:
        if self.process is not None:
            self.run(self.process.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture(scope="module")
def plane(etcd: LocalEtcd) -> Iterator[Plane]:
    import uuid

    p = Plane()
    try:

        async def start() -> ServiceProcess:
            return await start_plane(plane_settings(etcd, f"/kvplane-fuzz/{uuid.uuid4().hex}/", token_auth()))

        p.process = p.run(start())
        yield p
    finally:
        p.close()


@pytest.fixture(scope="module")
def channel(plane: Plane) -> Iterator[grpc.Channel]:
    assert plane.process is not None
    with grpc.insecure_channel(target(plane.process)) as ch:
        yield ch


def _scalar(field: FieldDescriptor) -> st.SearchStrategy[Any]:
    t = field.type
    if t == FieldDescriptor.TYPE_STRING:
        return st.one_of(INTERESTING_TEXT, st.text(max_size=40))
    if t == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=40)
    if t == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if t in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return st.floats(
            allow_nan=True, allow_infinity=True, width=32 if t == FieldDescriptor.TYPE_FLOAT else 64
        )
    if t == FieldDescriptor.TYPE_ENUM:
        return st.integers(-3, 12)
    if t in (FieldDescriptor.TYPE_UINT32, FieldDescriptor.TYPE_FIXED32):
        return st.one_of(st.integers(0, 70_000), st.just(2**32 - 1))
    if t in (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64):
        return st.one_of(st.integers(0, 70_000), st.just(2**64 - 1), st.just(2**53 + 1))
    if t in (FieldDescriptor.TYPE_INT32, FieldDescriptor.TYPE_SINT32, FieldDescriptor.TYPE_SFIXED32):
        return st.integers(-(2**31), 2**31 - 1)
    return st.integers(-(2**63), 2**63 - 1)


def messages(descriptor: Descriptor, depth: int = 0) -> st.SearchStrategy[Any]:
    """Random well-formed messages of `descriptor`'s type (nested to a few levels)."""
    cls = message_factory.GetMessageClass(descriptor)
    parts: dict[str, st.SearchStrategy[Any]] = {}
    for field in descriptor.fields:
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            if field.message_type.GetOptions().map_entry:
                key, value = (
                    field.message_type.fields_by_name["key"],
                    field.message_type.fields_by_name["value"],
                )
                parts[field.name] = st.dictionaries(_scalar(key), _scalar(value), max_size=3)
                continue
            if depth >= 3:
                continue
            inner = messages(field.message_type, depth + 1)
            parts[field.name] = st.lists(inner, max_size=3) if field.is_repeated else inner
        else:
            parts[field.name] = st.lists(_scalar(field), max_size=4) if field.is_repeated else _scalar(field)
    optional = {name: st.none() | strategy for name, strategy in parts.items()}

    def build(values: dict[str, Any]) -> Any:
        message = cls()
        for name, value in values.items():
            if value is None:
                continue
            field = descriptor.fields_by_name[name]
            if field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type.GetOptions().map_entry:
                getattr(message, name).update(value)
            elif (field.is_repeated and field.type == FieldDescriptor.TYPE_MESSAGE) or field.is_repeated:
                getattr(message, name).extend(value)
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                getattr(message, name).CopyFrom(value)
            elif (
                isinstance(value, float)
                and field.type == FieldDescriptor.TYPE_FLOAT
                and not math.isfinite(value)
            ):
                setattr(message, name, value)
            else:
                setattr(message, name, value)
        return message

    return st.fixed_dictionaries({}, optional=optional).map(build)


def _call(
    channel: grpc.Channel, service: ServiceDescriptor, method: MethodDescriptor, payload: bytes
) -> grpc.StatusCode:
    path = f"/{service.full_name}/{method.name}"
    who = bearer("node-a" if method.name in NODE_METHODS else "ops")
    streaming = method.client_streaming or method.server_streaming
    timeout = STREAM_DEADLINE_S if streaming else UNARY_DEADLINE_S
    try:
        if method.client_streaming:
            for _ in channel.stream_stream(path)(iter([payload]), metadata=who, timeout=timeout):
                pass
        elif method.server_streaming:
            for _ in channel.unary_stream(path)(payload, metadata=who, timeout=timeout):
                pass
        else:
            channel.unary_unary(path)(payload, metadata=who, timeout=timeout)
    except grpc.RpcError as exc:
        code: grpc.StatusCode = exc.code()  # type: ignore[attr-defined]
        assert "Traceback" not in (exc.details() or "")  # type: ignore[attr-defined]
        return code
    return grpc.StatusCode.OK


def _check(
    plane: Plane, channel: grpc.Channel, service: ServiceDescriptor, method: MethodDescriptor, payload: bytes
) -> None:
    before = plane.revision()
    code = _call(channel, service, method, payload)
    assert code not in NEVER, f"{method.name} answered {code}"
    streaming = method.client_streaming or method.server_streaming
    if not streaming:
        # A unary call always answers within its deadline.
        assert code != grpc.StatusCode.DEADLINE_EXCEEDED, f"{method.name} hung"
    if code not in (grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED):
        assert plane.written_since(before) == [], f"{method.name} refused ({code}) but wrote to etcd"


FUZZ = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
)
PARAMS = [pytest.param(s, m, id=method_id((s, m))) for s, m in all_methods()]


@pytest.mark.parametrize(("service", "method"), PARAMS)
@FUZZ
@given(data=st.data())
def test_random_wire_bytes_never_get_unknown_internal_or_a_hang(
    plane: Plane,
    channel: grpc.Channel,
    service: ServiceDescriptor,
    method: MethodDescriptor,
    data: st.DataObject,
) -> None:
    payload = data.draw(st.binary(max_size=200), label="wire bytes")
    _check(plane, channel, service, method, payload)


@pytest.mark.parametrize(("service", "method"), PARAMS)
@FUZZ
@given(data=st.data())
def test_random_messages_never_get_unknown_internal_or_a_hang(
    plane: Plane,
    channel: grpc.Channel,
    service: ServiceDescriptor,
    method: MethodDescriptor,
    data: st.DataObject,
) -> None:
    message = data.draw(messages(method.input_type), label="message")
    _check(plane, channel, service, method, message.SerializeToString())


def test_the_plane_still_serves_after_the_fuzzing(channel: grpc.Channel) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
